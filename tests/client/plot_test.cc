// fsdp8 watch --plot: the loss curve drawn by gnuplot.
#include "client/plot.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;

std::string Read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

uint32_t BigEndian32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) |
         (uint32_t(uint8_t(s[at + 2])) << 8) | uint32_t(uint8_t(s[at + 3]));
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fsdp8-plot-" + std::to_string(getpid()));
    fs::create_directories(dir_);
    for (int k = 1; k <= 40; ++k)
      points_.push_back({k, 5.5 * std::exp(-k / 10.0) + 1.2, k % 10 == 0 ? 1.4 + 3.0 / k : NAN});
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  std::vector<LossPoint> points_;
};

TEST_F(PlotTest, PngIsAPngOfTheRequestedSize) {
  const fs::path out = dir_ / "loss.png";
  absl::Status s = WriteLossPlot(out.string(), "fsdp8 job job-1", points_);
  ASSERT_TRUE(s.ok()) << s;
  const std::string png = Read(out);
  ASSERT_GE(png.size(), 33u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_EQ(BigEndian32(png, 16), 1000u);  // width
  EXPECT_EQ(BigEndian32(png, 20), 600u);   // height
  EXPECT_GT(png.size(), 10000u) << "an empty canvas compresses to a few hundred bytes";
  // Nothing left behind but the image.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST_F(PlotTest, SvgHasTitleAxesAndBothCurves) {
  const fs::path out = dir_ / "loss.svg";
  absl::Status s = WriteLossPlot(out.string(), "fsdp8 job job-'7'", points_);
  ASSERT_TRUE(s.ok()) << s;
  const std::string svg = Read(out);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("fsdp8 job job-'7'"), std::string::npos) << "the title, quote intact";
  EXPECT_NE(svg.find("train loss"), std::string::npos);
  EXPECT_NE(svg.find("val loss"), std::string::npos);
  EXPECT_NE(svg.find("step"), std::string::npos);
}

TEST_F(PlotTest, RefusesBadFileNamesEmptyCurvesAndMissingGnuplot) {
  absl::Status s = WriteLossPlot((dir_ / "loss.jpg").string(), "t", points_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find(".png, .svg or .pdf"), std::string::npos) << s;
  EXPECT_EQ(CheckPlotPath("x.pdf").code(), absl::StatusCode::kOk);
  s = WriteLossPlot((dir_ / "loss.png").string(), "t", {});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  // No gnuplot on PATH: a clear message naming the package.
  const std::string path = getenv("PATH") ? getenv("PATH") : "";
  setenv("PATH", dir_.c_str(), 1);
  s = WriteLossPlot((dir_ / "loss.png").string(), "t", points_);
  setenv("PATH", path.c_str(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("apt-get install gnuplot-nox"), std::string::npos) << s;
  EXPECT_FALSE(fs::exists(dir_ / "loss.png"));
}

}  // namespace
}  // namespace fsdp8
