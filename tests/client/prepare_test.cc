// `fsdp8 prepare`: two text files -> train.bin + val.bin whose bytes are the concatenation.
#include "client/prepare.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/token_shard.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp8-prep-XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    dir_ = mkdtemp(buf.data());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& bytes) {
    std::string p = dir_ + "/" + name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  std::string dir_;
};

TEST_F(PrepareTest, RoundTripSplitsTheConcatenationAtTheFraction) {
  std::string a, b;
  for (int i = 0; i < 700; ++i) a += static_cast<char>('a' + i % 26);
  for (int i = 0; i < 300; ++i) b += static_cast<char>(i % 256);  // every byte value, incl. 0 and 255
  std::string fa = Write("a.txt", a), fb = Write("b.txt", b);
  auto r = PrepareTokenShards({fa, fb}, dir_ + "/out", 0.1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->train_tokens, 900);
  EXPECT_EQ(r->val_tokens, 100);
  auto train = ReadTokenShard(dir_ + "/out/train.bin");
  auto val = ReadTokenShard(dir_ + "/out/val.bin");
  ASSERT_TRUE(train.ok()) << train.status();
  ASSERT_TRUE(val.ok()) << val.status();
  EXPECT_EQ(train->tokens.size(), 900u);
  EXPECT_EQ(val->tokens.size(), 100u);
  std::string joined;
  for (uint16_t t : train->tokens) {
    ASSERT_LT(t, 256);
    joined += static_cast<char>(t);
  }
  for (uint16_t t : val->tokens) {
    ASSERT_LT(t, 256);
    joined += static_cast<char>(t);
  }
  EXPECT_EQ(joined, a + b);
}

// The tokenizer record beside the shards (docs/usage.md, `fsdp8 prepare`): bytes, no BOS / EOS / padding
// token; a record of an earlier run (another tokenizer's files) is replaced, not merged.
TEST_F(PrepareTest, RecordsByteTokensWithNoSpecialTokens) {
  const std::string out = dir_ + "/out";
  std::filesystem::create_directories(out + "/tokenizer");
  std::ofstream(out + "/tokenizer/tokenizer.json") << "{}";  // left by an earlier BPE run
  ASSERT_TRUE(PrepareTokenShards({Write("a.txt", "hello")}, out, 0.2).ok());
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(out + "/tokenizer")) {
    files.push_back(e.path().filename().string());
  }
  EXPECT_EQ(files, std::vector<std::string>{"token_ids.json"});
  google::protobuf::Struct record;
  std::ifstream in(out + "/tokenizer/token_ids.json");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(text, &record).ok()) << text;
  const auto& f = record.fields();
  ASSERT_EQ(f.count("kind"), 1u) << text;
  EXPECT_EQ(f.at("kind").string_value(), "bytes");
  EXPECT_EQ(f.at("vocab_size").number_value(), 256);
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    ASSERT_EQ(f.count(k), 1u) << k << " in " << text;
    EXPECT_EQ(f.at(k).kind_case(), google::protobuf::Value::kNullValue) << k;
  }
}

TEST_F(PrepareTest, OrderOfFilesIsKept) {
  std::string fa = Write("a.txt", "first "), fb = Write("b.txt", "second");
  auto r = PrepareTokenShards({fb, fa}, dir_ + "/out2", 0.0);
  ASSERT_TRUE(r.ok()) << r.status();
  auto train = ReadTokenShard(r->train_path);
  ASSERT_TRUE(train.ok());
  std::string joined(train->tokens.begin(), train->tokens.end());
  EXPECT_EQ(joined, "secondfirst ");
  EXPECT_EQ(r->val_tokens, 0);
}

TEST_F(PrepareTest, Errors) {
  EXPECT_EQ(PrepareTokenShards({}, dir_, 0.05).status().code(), absl::StatusCode::kInvalidArgument);
  std::string fa = Write("a.txt", "x");
  EXPECT_EQ(PrepareTokenShards({fa}, dir_, 1.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrepareTokenShards({fa}, dir_, -0.1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto missing = PrepareTokenShards({dir_ + "/nope.txt"}, dir_, 0.05);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.txt"), std::string::npos);
}

}  // namespace
}  // namespace fsdp8
