// The exposition writer against the text format spec and the reference Python parser.
#include "common/prometheus_text.h"

#include <cmath>
#include <limits>

#include "common/http_server.h"
#include "gtest/gtest.h"
#include "tests/observability/test_util.h"

namespace fsdp8::prom {
namespace {

using namespace obs_test;  // NOLINT

TEST(PrometheusText, EscapingFollowsTheSpec) {
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");  // quotes stay in HELP text
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(NAN), "NaN");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_TRUE(ValidMetricName("fsdp8_step_duration_seconds"));
  EXPECT_TRUE(ValidMetricName("a:b"));
  EXPECT_FALSE(ValidMetricName("9lives"));
  EXPECT_FALSE(ValidMetricName("a-b"));
  EXPECT_FALSE(ValidLabelName("a:b"));
}

TEST(PrometheusTextDeathTest, CounterWithoutTotalAndRepeatedFamiliesAbort) {
  EXPECT_DEATH(
      {
        ExpositionWriter w;
        w.Family("fsdp8_steps", "counter", "x");
      },
      "must end in _total");
  EXPECT_DEATH(
      {
        ExpositionWriter w;
        w.Family("a_total", "counter", "x");
        w.Family("a_total", "counter", "x");
      },
      "written twice");
}

TEST(PrometheusText, ReferenceParserReadsBackEveryValueAndLabel) {
  ExpositionWriter w;
  w.Family("t_bytes_total", "counter", "help with \\ backslash\nand a newline");
  const std::string nasty = "q\"uote \\back\nline {x=\"1\"}";
  w.Sample({{"job", nasty}, {"rank", "0"}}, 12345678901.0);
  w.Family("t_gauge", "gauge", "g");
  w.Sample({{"k", "a"}}, 0.1);
  w.Sample({{"k", "b"}}, -2.5e-300);
  w.Sample({{"k", "c"}}, std::numeric_limits<double>::infinity());
  w.Sample({{"k", "d"}}, NAN);
  w.Sample({}, 1.0 / 3.0);
  Histogram h({0.5, 1, 0.1});  // unsorted on purpose
  for (double v : {0.05, 0.1, 0.7, 3.0}) h.Observe(v);
  w.Family("t_seconds", "histogram", "h");
  w.HistogramSeries({{"job", "j"}}, h);

  const fs::path dir = fs::temp_directory_path() / ("fsdp8-prom-" + std::to_string(getpid()));
  fs::create_directories(dir);
  Exposition e;
  std::string err;
  ASSERT_TRUE(ParseExposition(w.text(), dir / "t", &e, &err)) << err << "\n" << w.text();
  fs::remove_all(dir);
  ASSERT_EQ(e.count("t_bytes"), 1u) << w.text();
  EXPECT_EQ(e["t_bytes"].type, "counter");
  EXPECT_EQ(e["t_bytes"].help, "help with \\ backslash\nand a newline");
  EXPECT_EQ(Value(e, "t_bytes", "t_bytes_total", {{"job", nasty}, {"rank", "0"}}), 12345678901.0);
  EXPECT_EQ(Value(e, "t_gauge", "t_gauge", {{"k", "a"}}), 0.1);
  EXPECT_EQ(Value(e, "t_gauge", "t_gauge", {{"k", "b"}}), -2.5e-300);
  EXPECT_TRUE(std::isinf(Value(e, "t_gauge", "t_gauge", {{"k", "c"}})));
  EXPECT_TRUE(std::isnan(Value(e, "t_gauge", "t_gauge", {{"k", "d"}})));
  ASSERT_EQ(e["t_gauge"].samples.size(), 5u);
  EXPECT_TRUE(e["t_gauge"].samples[4].labels.empty());
  EXPECT_EQ(e["t_gauge"].samples[4].value, 1.0 / 3.0);
  // Cumulative buckets, by hand: <=0.1: {0.05, 0.1}; <=0.5: same; <=1: +0.7; +Inf: all 4.
  EXPECT_EQ(e["t_seconds"].type, "histogram");
  EXPECT_EQ(Value(e, "t_seconds", "t_seconds_bucket", {{"le", "0.1"}}), 2);
  EXPECT_EQ(Value(e, "t_seconds", "t_seconds_bucket", {{"le", "0.5"}}), 2);
  EXPECT_EQ(Value(e, "t_seconds", "t_seconds_bucket", {{"le", "1"}}), 3);
  EXPECT_EQ(Value(e, "t_seconds", "t_seconds_bucket", {{"le", "+Inf"}}), 4);
  EXPECT_EQ(Value(e, "t_seconds", "t_seconds_count", {{"job", "j"}}), 4);
  EXPECT_DOUBLE_EQ(Value(e, "t_seconds", "t_seconds_sum", {{"job", "j"}}), 3.85);
}

TEST(HttpServer, ServesTheHandlerAndRefusesBadAddresses) {
  auto s = HttpServer::Start("127.0.0.1", 0, [](const std::string& path, const std::string& query) {
    return HttpResponse{path == "/x" ? 200 : 404, "text/plain", path + "?" + query};
  });
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_GT((*s)->port(), 0);
  HttpResult r = HttpGet((*s)->port(), "/x?job=a&b=1");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/plain");
  EXPECT_EQ(r.body, "/x?job=a&b=1");
  EXPECT_EQ(HttpGet((*s)->port(), "/y").status, 404);
  EXPECT_EQ(HttpRequest((*s)->port(), "DELETE", "/x").status, 405);
  // The port is taken now: a second server on it fails with the address in the message.
  auto again = HttpServer::Start("127.0.0.1", (*s)->port(), nullptr);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("127.0.0.1:" + std::to_string((*s)->port())),
            std::string::npos);
  auto bad = HttpServer::Start("localhost", 0, nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpServer::Start("127.0.0.1", 70000, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fsdp8::prom
