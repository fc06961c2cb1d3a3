// safetensors files (common/safetensors.h) and config.json (common/hf_model.h): hand-built files
// read as their bytes say, the writer's output read back, malformed files refused with a message
// naming the fault, and config.json checked field by field.
#include "common/safetensors.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "common/hf_model.h"
#include "common/spec.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

std::string Path(const std::string& name) { return ::testing::TempDir() + "/st_" + name; }

// 8-byte little-endian length, header, data.
std::string WriteRaw(const std::string& name, const std::string& header, const std::string& data) {
  const std::string p = Path(name);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
  return p;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TEST(Safetensors, ReadsAHandBuiltFileOfF32Bf16AndF16) {
  // a: F32 [2, 2] = 1, -2, 0.5, 3; b: BF16 [3] bits 0x3F80 (1), 0xC040 (-3), 0x3E80 (0.25);
  // c: F16 [2] bits 0x3C00 (1), 0x3555 (0.333251953125); the header lists them out of order.
  const std::string data = Bytes(std::vector<float>{1, -2, 0.5f, 3}) +
                           Bytes(std::vector<uint16_t>{0x3F80, 0xC040, 0x3E80}) +
                           Bytes(std::vector<uint16_t>{0x3C00, 0x3555});
  const std::string header =
      R"({"c":{"dtype":"F16","shape":[2],"data_offsets":[22,26]},)"
      R"("__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}  )";
  auto f = SafetensorsFile::Open(WriteRaw("hand", header, data));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->tensors().at("a").shape, (std::vector<int64_t>{2, 2}));
  float a[4], b[3], c[2], mid[2];
  ASSERT_TRUE(f->Read("a", 0, 4, a).ok());
  ASSERT_TRUE(f->Read("a", 1, 2, mid).ok());
  ASSERT_TRUE(f->Read("b", 0, 3, b).ok());
  ASSERT_TRUE(f->Read("c", 0, 2, c).ok());
  EXPECT_EQ(std::vector<float>(a, a + 4), (std::vector<float>{1, -2, 0.5f, 3}));
  EXPECT_EQ(std::vector<float>(mid, mid + 2), (std::vector<float>{-2, 0.5f}));
  EXPECT_EQ(std::vector<float>(b, b + 3), (std::vector<float>{1, -3, 0.25f}));
  EXPECT_EQ(c[0], 1.0f);
  EXPECT_EQ(c[1], 0.333251953125f);
  EXPECT_EQ(f->Read("a", 3, 2, a).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f->Read("zz", 0, 1, a).code(), absl::StatusCode::kNotFound);
}

TEST(Safetensors, WriterOutputHasTheDocumentedLayout) {
  const std::vector<float> w = {1.0f, -0.0f, 3.5f, 1e-20f, 65504.0f, -7.25f};
  const std::vector<float> n = {0.5f, 2.0f};
  const std::string p = Path("written");
  ASSERT_TRUE(WriteSafetensors(p, {{"w", {2, 3}, w.data()}, {"norm", {2}, n.data()}},
                               SafetensorsDtype::kF32, {{"step", "7"}})
                  .ok());
  std::ifstream in(p, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), {});
  uint64_t hlen = 0;
  std::memcpy(&hlen, all.data(), 8);
  EXPECT_EQ(hlen % 8, 0u);
  ASSERT_EQ(all.size(), 8 + hlen + 8 * 4);
  // Data in the given order, raw little-endian f32.
  EXPECT_EQ(all.substr(8 + hlen), Bytes(w) + Bytes(n));
  const std::string header = all.substr(8, hlen);
  EXPECT_NE(header.find("\"format\":\"pt\""), std::string::npos) << header;
  auto f = SafetensorsFile::Open(p);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors().at("w").begin, 0);
  EXPECT_EQ(f->tensors().at("norm").begin, 24);
  EXPECT_EQ(f->metadata().at("step"), "7");
  EXPECT_FALSE(std::filesystem::exists(p + ".tmp"));
}

TEST(Safetensors, Bf16WriterRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: even is 1. 1 + 3 * 2^-8 is halfway between
  // 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6. 1 + 2^-8 + 2^-20 is above halfway: 1 + 2^-7.
  const std::vector<float> v = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.0f};
  const std::string p = Path("bf16");
  ASSERT_TRUE(WriteSafetensors(p, {{"v", {4}, v.data()}}, SafetensorsDtype::kBF16).ok());
  std::ifstream in(p, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), {});
  std::vector<uint16_t> bits(4);
  std::memcpy(bits.data(), all.data() + all.size() - 8, 8);
  EXPECT_EQ(bits, (std::vector<uint16_t>{0x3F80, 0x3F82, 0x3F81, 0xC000}));
}

void ExpectRefused(const std::string& name, const std::string& header, const std::string& data,
                   const std::string& text) {
  auto f = SafetensorsFile::Open(WriteRaw(name, header, data));
  ASSERT_FALSE(f.ok()) << name;
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_NE(f.status().message().find(text), std::string::npos) << f.status();
}

TEST(Safetensors, MalformedFilesAreRefusedNamingTheFault) {
  const std::string d8(8, '\0');
  ExpectRefused("not_json", "{\"a\": [1, 2", d8, "not a JSON object");
  ExpectRefused("offsets", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,80]}})", d8,
                "tensor \"a\": data_offsets [0, 80] out of range (the data section is 8 bytes)");
  ExpectRefused("size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8,
                "shape [3] of F32 needs 12");
  ExpectRefused("overlap",
                R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                d8, "overlap");
  ExpectRefused("gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8, "gap");
  ExpectRefused("tail", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", d8,
                "cover 4 bytes of a 8-byte data section");
  ExpectRefused("dtype", R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", d8,
                "unknown dtype \"F33\"");
  ExpectRefused("negdim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8,
                "non-integer or negative dimension");
  ExpectRefused("field", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", d8,
                "unknown field \"x\"");
  {  // a header length beyond the file
    const std::string p = Path("hlen");
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
    f.close();
    auto r = SafetensorsFile::Open(p);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find("header length 1000 out of range (file is 10 bytes"),
              std::string::npos) << r.status();
  }
  {  // shorter than the length field
    const std::string p = Path("short");
    std::ofstream(p, std::ios::binary | std::ios::trunc) << "abc";
    EXPECT_EQ(SafetensorsFile::Open(p).status().code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(SafetensorsFile::Open(Path("nonexistent")).status().code(), absl::StatusCode::kNotFound);
  // Integers parse but are not values this reader converts.
  auto ints = SafetensorsFile::Open(
      WriteRaw("ints", R"({"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", d8));
  ASSERT_TRUE(ints.ok()) << ints.status();
  float x;
  const absl::Status s = ints->Read("i", 0, 1, &x);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("dtype I64"), std::string::npos) << s;
}

v1::ModelConfig Model() {
  v1::ModelConfig m;
  m.set_d_model(64);
  m.set_n_layers(2);
  m.set_n_heads(4);
  m.set_n_kv_heads(2);
  m.set_ffn_dim(172);
  m.set_vocab_size(256);
  m.set_seq_len(128);
  m.set_rope_theta(500000);
  m.set_norm_eps(1e-5);
  return m;
}

TEST(HfConfig, ATransformersStyleConfigMatchesAndEachMismatchIsNamed) {
  // The shape of a config.json that transformers' LlamaConfig.save_pretrained writes.
  const std::string cfg = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 172, "max_position_embeddings": 2048,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "float32",
    "transformers_version": "4.44.0", "use_cache": true, "vocab_size": 256})";
  EXPECT_TRUE(CheckHfConfig(cfg, Model(), "init.from_hf").ok()) << CheckHfConfig(cfg, Model(), "f");
  v1::ModelConfig m = Model();
  m.set_n_layers(3);
  EXPECT_EQ(CheckHfConfig(cfg, m, "init.from_hf").message(),
            "init.from_hf: config.json num_hidden_layers is 2, model.n_layers is 3");
  m = Model();
  m.set_rope_theta(10000);
  EXPECT_EQ(CheckHfConfig(cfg, m, "init.from_hf").message(),
            "init.from_hf: config.json rope_theta is 500000, model.rope_theta is 10000");
  m = Model();
  m.set_norm_eps(1e-6);
  EXPECT_NE(CheckHfConfig(cfg, m, "x").message().find("rms_norm_eps"), std::string::npos);
  std::string tied = cfg;
  tied.replace(tied.find("\"tie_word_embeddings\": false"), 28, "\"tie_word_embeddings\": true");
  EXPECT_EQ(CheckHfConfig(tied, Model(), "x").message(),
            "x: config.json tie_word_embeddings is true, model.tie_word_embeddings is false");
  EXPECT_EQ(CheckHfConfig("[1, 2]", Model(), "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(CheckHfConfig(R"({"model_type": "gpt2"})", Model(), "x").message().find("model_type"),
            std::string::npos);
}

TEST(HfConfig, WrittenConfigRoundTrips) {
  const std::string cfg = HfConfigJson(Model(), SafetensorsDtype::kBF16);
  EXPECT_TRUE(CheckHfConfig(cfg, Model(), "x").ok()) << CheckHfConfig(cfg, Model(), "x") << cfg;
  for (const char* key : {"\"LlamaForCausalLM\"", "\"model_type\": \"llama\"", "\"bfloat16\"",
                          "\"tie_word_embeddings\": false", "\"num_key_value_heads\": 2"}) {
    EXPECT_NE(cfg.find(key), std::string::npos) << key << " in " << cfg;
  }
  auto back = ModelConfigFromHf(cfg);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->d_model(), 64);
  EXPECT_EQ(back->n_kv_heads(), 2);
  EXPECT_EQ(back->ffn_dim(), 172);
  EXPECT_EQ(back->seq_len(), 128);
  EXPECT_EQ(back->rope_theta(), 500000);
  EXPECT_EQ(back->norm_eps(), 1e-5);
}

// Llama 3.2 1B's published config.json (tied, llama3 RoPE scaling, head_dim given).
const char kLlama32_1B[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";

// Numbers that need all 17 digits, and a whole number beyond 1e15, come back from the printed
// section as the same doubles.
TEST(HfConfig, ModelSectionNumbersReadBackExactly) {
  for (const auto& [eps_text, theta_text] :
       {std::pair<std::string, std::string>{"1.0000000000000002e-05", "500000.1234567891"},
        {"3e-07", "2e+16"}}) {
    std::string cfg = kLlama32_1B;
    cfg.replace(cfg.find("1e-05"), 5, eps_text);
    cfg.replace(cfg.find("500000.0"), 8, theta_text);
    auto yaml = HfModelSectionYaml(cfg, 2048);
    ASSERT_TRUE(yaml.ok()) << yaml.status();
    auto spec = ParseSpec(*yaml);
    ASSERT_TRUE(spec.ok()) << spec.status() << "\n" << *yaml;
    EXPECT_EQ(spec->model().norm_eps(), std::strtod(eps_text.c_str(), nullptr)) << *yaml;
    EXPECT_EQ(spec->model().rope_theta(), std::strtod(theta_text.c_str(), nullptr)) << *yaml;
  }
}

TEST(HfConfig, ModelSectionOfLlama32IsItsPublishedShape) {
  auto yaml = HfModelSectionYaml(kLlama32_1B, 2048);
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  // The shortest text that reads back exactly (whole numbers without a fraction), not 17 digits
  // of the binary value.
  EXPECT_NE(yaml->find("  norm_eps: 1e-05\n"), std::string::npos) << *yaml;
  EXPECT_NE(yaml->find("  rope_theta: 500000\n"), std::string::npos) << *yaml;
  auto spec = ParseSpec(*yaml);
  ASSERT_TRUE(spec.ok()) << spec.status() << "\n" << *yaml;
  const v1::ModelConfig& m = spec->model();
  EXPECT_EQ(m.d_model(), 2048);
  EXPECT_EQ(m.n_layers(), 16);
  EXPECT_EQ(m.n_heads(), 32);
  EXPECT_EQ(m.n_kv_heads(), 8);
  EXPECT_EQ(m.ffn_dim(), 8192);
  EXPECT_EQ(m.vocab_size(), 128256);
  EXPECT_EQ(m.seq_len(), 2048);  // --seq-len, below max_position_embeddings
  EXPECT_EQ(m.rope_theta(), 500000.0);
  EXPECT_EQ(m.norm_eps(), 1e-5);
  EXPECT_TRUE(m.tie_word_embeddings());
  ASSERT_TRUE(m.has_rope_scaling());
  EXPECT_EQ(m.rope_scaling().rope_type(), "llama3");
  EXPECT_EQ(m.rope_scaling().factor(), 32.0);
  EXPECT_EQ(m.rope_scaling().low_freq_factor(), 1.0);
  EXPECT_EQ(m.rope_scaling().high_freq_factor(), 4.0);
  EXPECT_EQ(m.rope_scaling().original_max_position_embeddings(), 8192);
  // The section matches its own config, and a config written from it reads back the same.
  v1::ModelConfig at_max = m;
  at_max.set_seq_len(131072);
  EXPECT_TRUE(CheckHfConfig(kLlama32_1B, m, "x").ok()) << CheckHfConfig(kLlama32_1B, m, "x");
  const std::string written = HfConfigJson(at_max, SafetensorsDtype::kBF16);
  EXPECT_TRUE(CheckHfConfig(written, m, "x").ok()) << CheckHfConfig(written, m, "x") << written;
  auto back = ModelConfigFromHf(written);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), at_max.SerializeAsString()) << written;
}

// An export's config.json: special token ids as given (a list kept a list), null when unknown;
// an imported model's max_position_embeddings and rope_scaling as its config.json had them.
TEST(HfConfig, ExportExtrasGiveTokenIdsAndKeepTheSourcePositions) {
  auto parse = [](const std::string& text) {
    google::protobuf::Struct s;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(text, &s).ok()) << text;
    return s;
  };
  v1::ModelConfig m = Model();  // seq_len 128, no rope_scaling
  auto plain = HfConfigJson(m, SafetensorsDtype::kF32, HfConfigExtras{});
  ASSERT_TRUE(plain.ok()) << plain.status();
  const google::protobuf::Struct p = parse(*plain);
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    ASSERT_EQ(p.fields().count(k), 1u) << k << " in " << *plain;
    EXPECT_EQ(p.fields().at(k).kind_case(), google::protobuf::Value::kNullValue) << k;
  }
  EXPECT_EQ(p.fields().at("max_position_embeddings").number_value(), 128);

  auto ad = ModelConfigFromHf(kLlama32_1B);
  ASSERT_TRUE(ad.ok()) << ad.status();
  v1::ModelConfig llama = *ad;
  llama.set_seq_len(2048);
  HfConfigExtras extras;
  extras.token_ids_json = R"({"bos_token_id": 128000, "eos_token_id": [128001, 128009]})";
  extras.source_config_json = kLlama32_1B;
  auto written = HfConfigJson(llama, SafetensorsDtype::kBF16, extras);
  ASSERT_TRUE(written.ok()) << written.status();
  const google::protobuf::Struct w = parse(*written);
  EXPECT_EQ(w.fields().at("bos_token_id").number_value(), 128000);
  const auto& eos = w.fields().at("eos_token_id").list_value();
  ASSERT_EQ(eos.values_size(), 2) << *written;
  EXPECT_EQ(eos.values(0).number_value(), 128001);
  EXPECT_EQ(eos.values(1).number_value(), 128009);
  EXPECT_EQ(w.fields().at("pad_token_id").kind_case(), google::protobuf::Value::kNullValue);
  EXPECT_EQ(w.fields().at("max_position_embeddings").number_value(), 131072) << *written;
  const auto& rope = w.fields().at("rope_scaling").struct_value().fields();
  EXPECT_EQ(rope.at("factor").number_value(), 32);
  EXPECT_EQ(rope.at("original_max_position_embeddings").number_value(), 8192);
  EXPECT_EQ(rope.at("rope_type").string_value(), "llama3");
  EXPECT_TRUE(CheckHfConfig(*written, llama, "x").ok()) << CheckHfConfig(*written, llama, "x");

  extras.token_ids_json = "[1]";
  EXPECT_EQ(HfConfigJson(llama, SafetensorsDtype::kBF16, extras).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HfConfig, UnimplementedFeaturesAreRefusedNamingTheKey) {
  auto refused = [](const std::string& from, const std::string& to, const std::string& key) {
    std::string cfg = kLlama32_1B;
    const size_t at = cfg.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    cfg.replace(at, from.size(), to);
    auto m = ModelConfigFromHf(cfg);
    ASSERT_FALSE(m.ok()) << to;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find(key), std::string::npos) << m.status();
  };
  refused("\"attention_bias\": false", "\"attention_bias\": true", "attention_bias must be false");
  refused("\"mlp_bias\": false", "\"mlp_bias\": true", "mlp_bias must be false");
  refused("\"use_cache\": true", "\"use_cache\": true, \"sliding_window\": 4096",
          "sliding_window must be null");
  refused("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"",
          "rope_scaling.rope_type is \"yarn\"");
  refused("\"head_dim\": 64", "\"head_dim\": 128", "head_dim is 128");
  refused("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act must be \"silu\"");
  refused("\"use_cache\": true", "\"use_cache\": true, \"partial_rotary_factor\": 0.5",
          "partial_rotary_factor must be 1");
  refused("\"factor\": 32.0, ", "", "rope_scaling.factor is missing");
}

TEST(HfConfig, RopeScalingAndTieAreComparedWithTheModelSection) {
  auto m = ModelConfigFromHf(kLlama32_1B);
  ASSERT_TRUE(m.ok()) << m.status();
  m->set_seq_len(2048);
  v1::ModelConfig other = *m;
  other.mutable_rope_scaling()->set_factor(8.0);
  EXPECT_EQ(CheckHfConfig(kLlama32_1B, other, "init.from_hf").message(),
            "init.from_hf: config.json rope_scaling.factor is 32, model.rope_scaling.factor is 8");
  other = *m;
  other.clear_rope_scaling();
  EXPECT_NE(CheckHfConfig(kLlama32_1B, other, "x").message().find(
                "has rope_scaling llama3, model.rope_scaling is unset"),
            std::string::npos);
  other = *m;
  other.set_tie_word_embeddings(false);
  EXPECT_EQ(CheckHfConfig(kLlama32_1B, other, "x").message(),
            "x: config.json tie_word_embeddings is true, model.tie_word_embeddings is false");
  // transformers 5 writes rope_theta and the scaling together as rope_parameters.
  std::string v5 = kLlama32_1B;
  v5.replace(v5.find("\"rope_scaling\""), 14, "\"rope_parameters\"");
  v5.replace(v5.find("\"rope_type\": \"llama3\""), 21,
             "\"rope_type\": \"llama3\", \"rope_theta\": 500000.0");
  v5.replace(v5.find("\"rope_theta\": 500000.0, \"tie"), 24, "");
  EXPECT_TRUE(CheckHfConfig(v5, *m, "x").ok()) << CheckHfConfig(v5, *m, "x") << v5;
  auto from_v5 = ModelConfigFromHf(v5);
  ASSERT_TRUE(from_v5.ok()) << from_v5.status();
  EXPECT_EQ(from_v5->rope_theta(), 500000.0);
  EXPECT_EQ(from_v5->rope_scaling().factor(), 32.0);
}

}  // namespace
}  // namespace fsdp8
