// Hugging Face interchange (common/hf_model.h, train/hf_import.h): checkpoint -> export -> a job
// initialised from the export holds the same weights (F32 bit for bit; BF16 as the nearest bf16),
// on another world size; FP8 weight scales come from the loaded weights (C08); bad directories and
// files are refused with messages naming the field or tensor.
#include "train/hf_import.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_format.h"
#include "common/hf_model.h"
#include "common/safetensors.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/train/hf_test_util.h"
#include "tests/train/trainer_test_util.h"

namespace fsdp8 {
namespace {

using testing::CpuBackend;
using testing::RunRanks;
using testing::Weights;
namespace fs = std::filesystem;

const std::string& TrainFile() {
  static const std::string p = testing::MakeTokenFile("hf_train.bin", 20000, 11);
  return p;
}

std::string Fresh(const std::string& name) {
  // Per process: ctest runs these cases as parallel processes (each builds its own checkpoint).
  const std::string d = ::testing::TempDir() + "/hf_" + std::to_string(static_cast<long>(::getpid())) +
                        "_" + name;
  fs::remove_all(d);
  return d;
}

// The committed checkpoint every test exports (trained 2 steps on 2 ranks), built once.
struct Saved {
  std::string root;
  Weights master;
};
const Saved& Checkpoint() {
  static const Saved s = [] {
    Saved out;
    out.root = Fresh("ckpt");
    auto m = testing::WriteCommittedCheckpoint(testing::InterchangeSpec(TrainFile()), 2, 2, out.root);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) out.master = *m;
    return out;
  }();
  return s;
}

struct Loaded {
  std::vector<absl::Status> status;
  Weights master;
  std::vector<WeightScaling> scaling;  // rank 0's, after the load
  std::vector<WeightScaling> scaling_before;
};

// A job of `spec` with init.from_hf = dir on `world` ranks: Create, LoadHfWeights, GatherAll.
Loaded LoadJob(v1::JobSpec spec, const std::string& dir, int world) {
  spec.mutable_init()->set_from_hf(dir);
  Loaded out;
  out.status.resize(world);
  RunRanks(world, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    if (r == 0) out.scaling_before = (*t)->params().weight_scaling();
    out.status[r] = LoadHfWeights(t->get(), dir);
    if (!out.status[r].ok()) return;
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    if (r == 0) {
      out.master = *m;
      out.scaling = (*t)->params().weight_scaling();
    }
  });
  return out;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// A checkpoint whose AdamW moments are bf16 (optimizer.state_precision BF16: 2-byte moment arrays in
// the rank files) exports its master weights as an FP32-moment one does: loaded back, bit for bit.
TEST(HfInterchange, ExportOfACheckpointWithBf16MomentsHoldsItsMasterWeights) {
  v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
  spec.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
  const std::string root = Fresh("ckpt_bf16_moments");
  auto master = testing::WriteCommittedCheckpoint(spec, 2, 2, root);
  ASSERT_TRUE(master.ok()) << master.status();
  const std::string out = Fresh("export_bf16_moments");
  absl::Status s = ExportHf(root + "/step-2", out, SafetensorsDtype::kF32);
  ASSERT_TRUE(s.ok()) << s;
  const Loaded l = LoadJob(testing::InterchangeSpec(TrainFile()), out, 1);
  ASSERT_TRUE(l.status[0].ok()) << l.status[0];
  ASSERT_EQ(l.master.size(), master->size());
  for (const auto& [name, v] : *master) {
    ASSERT_EQ(l.master.at(name).size(), v.size()) << name;
    EXPECT_EQ(std::memcmp(l.master.at(name).data(), v.data(), v.size() * 4), 0) << name;
  }
}

TEST(HfInterchange, F32ExportLoadsBitIdenticalOnThreeRanksWithScalesFromTheLoadedWeights) {
  const Saved& ck = Checkpoint();
  ASSERT_FALSE(ck.master.empty());
  const std::string out = Fresh("export_f32");
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, SafetensorsDtype::kF32).ok());
  ASSERT_TRUE(fs::exists(out + "/config.json"));
  // A job with a different seed: its random init differs, the loaded weights must not.
  v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
  spec.mutable_training()->set_seed(99);
  const Loaded l = LoadJob(spec, out, 3);
  for (const absl::Status& s : l.status) ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(l.master.size(), ck.master.size());
  for (const auto& [name, v] : ck.master) {
    ASSERT_EQ(l.master.at(name).size(), v.size()) << name;
    EXPECT_EQ(std::memcmp(l.master.at(name).data(), v.data(), v.size() * 4), 0) << name;
  }
  // C08: each FP8 weight's amax is max |w| of the loaded tensor and its scale 448 / amax
  // (margin 0), not the values of the seed-99 initialisation.
  ASSERT_FALSE(l.scaling.empty());
  ASSERT_EQ(l.scaling.size(), l.scaling_before.size());
  for (size_t i = 0; i < l.scaling.size(); ++i) {
    const WeightScaling& w = l.scaling[i];
    const float amax = MaxAbs(ck.master.at(w.tensor));
    EXPECT_EQ(w.amax, amax) << w.tensor;
    EXPECT_FLOAT_EQ(w.scale, 448.0f / amax) << w.tensor;
    EXPECT_NE(l.scaling_before[i].amax, amax) << w.tensor;
  }
}

TEST(HfInterchange, Bf16ExportLoadsTheNearestBf16OfEachWeight) {
  const Saved& ck = Checkpoint();
  const std::string out = Fresh("export_bf16");
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, SafetensorsDtype::kBF16).ok());
  std::ifstream cfg(out + "/config.json");
  std::string text((std::istreambuf_iterator<char>(cfg)), {});
  EXPECT_NE(text.find("\"bfloat16\""), std::string::npos) << text;
  const Loaded l = LoadJob(testing::InterchangeSpec(TrainFile()), out, 1);
  ASSERT_TRUE(l.status[0].ok()) << l.status[0];
  int64_t checked = 0;
  for (const auto& [name, v] : ck.master) {
    const std::vector<float>& got = l.master.at(name);
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &got[i], 4);
      ASSERT_EQ(bits & 0xffffu, 0u) << name << "[" << i << "] is not a bf16 value";
      // The two bf16 neighbours of v[i]: truncation and one bf16 ulp away from zero.
      uint32_t vb;
      std::memcpy(&vb, &v[i], 4);
      const uint32_t lo_bits = vb & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
      float lo, hi;
      std::memcpy(&lo, &lo_bits, 4);
      std::memcpy(&hi, &hi_bits, 4);
      const float best = std::fabs(v[i] - lo) <= std::fabs(hi - v[i]) ? lo : hi;
      if (std::fabs(v[i] - lo) != std::fabs(hi - v[i])) {
        ASSERT_EQ(got[i], best) << name << "[" << i << "] = " << v[i];
      } else {
        ASSERT_TRUE(got[i] == lo || got[i] == hi) << name << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 10000);
}

// A safetensors file written by hand (header JSON text + raw bytes), independent of the writer.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
}

// Copies the F32 export to `dir` with model.safetensors rebuilt from `entries` (name, dtype,
// shape, element size): values are the exported ones where the name and size match, else zeros.
struct Entry {
  std::string name, dtype, shape;
  int64_t bytes;
};
void WriteEdited(const std::string& src, const std::string& dir, const std::vector<Entry>& entries) {
  fs::create_directories(dir);
  fs::copy_file(src + "/config.json", dir + "/config.json", fs::copy_options::overwrite_existing);
  std::string header = "{", data;
  for (const Entry& e : entries) {
    absl::StrAppend(&header, header.size() > 1 ? "," : "", "\"", e.name, "\":{\"dtype\":\"", e.dtype,
                    "\",\"shape\":[", e.shape, "],\"data_offsets\":[", data.size(), ",",
                    data.size() + e.bytes, "]}");
    data.append(static_cast<size_t>(e.bytes), '\0');
  }
  header += "}";
  WriteRaw(dir + "/model.safetensors", header, data);
}

// Every tensor of the model as entries (F32), from the checkpoint's plan order.
std::vector<Entry> ModelEntries() {
  std::vector<Entry> out;
  auto plan = MakeShardPlan(WithDefaults(testing::InterchangeSpec(TrainFile()), 1), 1);
  EXPECT_TRUE(plan.ok());
  for (const UnitPlan& u : plan->units) {
    for (const BufferPlan& b : u.buffers) {
      for (const TensorSpec& t : b.tensors) {
        std::string shape;
        for (int64_t d : t.shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", d);
        out.push_back({t.name, "F32", shape, t.numel * 4});
      }
    }
  }
  return out;
}

absl::Status LoadOneRank(const std::string& dir, v1::JobSpec spec = testing::InterchangeSpec(TrainFile())) {
  return LoadJob(std::move(spec), dir, 1).status[0];
}

TEST(HfInterchange, MismatchedOrDamagedDirectoriesAreRefusedNamingTheFieldOrTensor) {
  const Saved& ck = Checkpoint();
  const std::string good = Fresh("export_src");
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", good, SafetensorsDtype::kF32).ok());
  ASSERT_TRUE(LoadOneRank(good).ok());
  // The hand-built file with every tensor loads (zeros): the edits below are the only faults.
  const std::string all = Fresh("edit_all");
  WriteEdited(good, all, ModelEntries());
  EXPECT_TRUE(LoadOneRank(all).ok()) << LoadOneRank(all);

  auto expect = [](absl::Status s, absl::StatusCode code, const std::string& text) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
  };
  {  // config.json of another model
    v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
    spec.mutable_model()->set_ffn_dim(96);
    expect(LoadOneRank(good, spec), absl::StatusCode::kInvalidArgument,
           "init.from_hf: config.json intermediate_size is 64, model.ffn_dim is 96");
    spec = testing::InterchangeSpec(TrainFile());
    spec.mutable_model()->set_n_kv_heads(4);
    expect(LoadOneRank(good, spec), absl::StatusCode::kInvalidArgument,
           "num_key_value_heads is 2, model.n_kv_heads is 4");
    spec = testing::InterchangeSpec(TrainFile());
    spec.mutable_model()->set_seq_len(64);  // longer than max_position_embeddings 32
    expect(LoadOneRank(good, spec), absl::StatusCode::kInvalidArgument, "max_position_embeddings");
  }
  {  // missing tensor
    std::vector<Entry> e = ModelEntries();
    e.erase(e.begin() + 3);
    const std::string name = ModelEntries()[3].name;
    const std::string d = Fresh("edit_missing");
    WriteEdited(good, d, e);
    expect(LoadOneRank(d), absl::StatusCode::kFailedPrecondition, "tensor " + name + " is missing");
  }
  {  // transposed shape
    std::vector<Entry> e = ModelEntries();
    for (Entry& x : e) {
      if (x.name == "model.layers.0.mlp.down_proj.weight") x.shape = "64,32";
    }
    const std::string d = Fresh("edit_shape");
    WriteEdited(good, d, e);
    expect(LoadOneRank(d), absl::StatusCode::kFailedPrecondition,
           "tensor model.layers.0.mlp.down_proj.weight has shape [64, 32], this model needs [32, 64]");
  }
  {  // integer dtype
    std::vector<Entry> e = ModelEntries();
    e[0].dtype = "I32";
    const std::string d = Fresh("edit_dtype");
    WriteEdited(good, d, e);
    expect(LoadOneRank(d), absl::StatusCode::kFailedPrecondition, "has dtype I32");
  }
  {  // an extra tensor
    std::vector<Entry> e = ModelEntries();
    e.push_back({"model.layers.0.self_attn.q_proj.bias", "F32", "32", 128});
    const std::string d = Fresh("edit_extra");
    WriteEdited(good, d, e);
    expect(LoadOneRank(d), absl::StatusCode::kFailedPrecondition,
           "unexpected tensor model.layers.0.self_attn.q_proj.bias");
  }
  {  // offsets past the end of the file
    const std::string d = Fresh("edit_offsets");
    fs::create_directories(d);
    fs::copy_file(good + "/config.json", d + "/config.json");
    WriteRaw(d + "/model.safetensors",
             "{\"lm_head.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8000]}}",
             std::string(8, '\0'));
    expect(LoadOneRank(d), absl::StatusCode::kDataLoss, "out of range");
  }
  {  // no config.json
    const std::string d = Fresh("edit_noconfig");
    fs::create_directories(d);
    fs::copy_file(good + "/model.safetensors", d + "/model.safetensors");
    expect(LoadOneRank(d), absl::StatusCode::kInvalidArgument, "init.from_hf: must be a Hugging Face");
  }
}

TEST(HfInterchange, SpecValidationChecksTheDirectoryAgainstTheModelSection) {
  const Saved& ck = Checkpoint();
  const std::string out = Fresh("export_spec");
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, SafetensorsDtype::kF32).ok());
  v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
  spec.mutable_init()->set_from_hf(out);
  EXPECT_TRUE(ValidateSpec(spec, 0, {}, true).ok()) << ValidateSpec(spec, 0, {}, true);
  spec.mutable_model()->set_d_model(64);
  const absl::Status s = ValidateSpec(spec, 0, {}, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("init.from_hf: config.json hidden_size is 32, model.d_model is 64"),
            std::string::npos) << s;
  spec = testing::InterchangeSpec(TrainFile());
  spec.mutable_init()->set_from_hf("/elsewhere/model");
  const std::string root = fs::path(TrainFile()).parent_path().string();
  const absl::Status r = ValidateSpec(spec, 0, {root}, false);
  EXPECT_NE(r.message().find("init.from_hf: must lie under one of the data roots"),
            std::string::npos) << r;
}

TEST(HfInterchange, ExportRefusesDamagedOrUncommittedCheckpoints) {
  const Saved& ck = Checkpoint();
  const std::string copy = Fresh("damaged");
  fs::copy(ck.root, copy, fs::copy_options::recursive);
  // Flip one byte in the middle of rank 1's file: the MANIFEST's CRC-32 no longer matches.
  const std::string rank1 = copy + "/step-2/rank-1.ckpt";
  {
    std::fstream f(rank1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(rank1) / 2));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(fs::file_size(rank1) / 2));
    f.write(&c, 1);
  }
  absl::Status s = ExportHf(copy + "/step-2", Fresh("out_damaged"), SafetensorsDtype::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank-1.ckpt: CRC-32"), std::string::npos) << s;
  fs::remove(copy + "/step-2/MANIFEST");
  s = ExportHf(copy + "/step-2", Fresh("out_uncommitted"), SafetensorsDtype::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  // Resolving: a root picks its newest committed step; --step must exist.
  auto d = ResolveCheckpointStepDir(ck.root, std::nullopt);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, ck.root + "/step-2");
  EXPECT_FALSE(ResolveCheckpointStepDir(ck.root, 5).ok());
  EXPECT_FALSE(ResolveCheckpointStepDir(copy, std::nullopt).ok());  // its only step lost its MANIFEST
}

// A checkpoint of the last release: its MANIFEST's spec has no tuning section and holds
// precision.fp8.forward_fast_accumulation in its old place. It exports as it did: the same
// weights as the checkpoint with today's MANIFEST.
TEST(HfInterchange, ExportOfAManifestWithMovedFieldsInTheirOldPlaces) {
  const Saved& ck = Checkpoint();
  const std::string copy = Fresh("old_manifest");
  fs::copy(ck.root, copy, fs::copy_options::recursive);
  auto m = ReadManifestFile(copy + "/step-2");
  ASSERT_TRUE(m.ok()) << m.status();
  v1::JobSpec* spec = m->mutable_spec();
  spec->clear_tuning();
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  spec->mutable_precision()->mutable_fp8()->set_forward_fast_accumulation(true);  // the old place
#pragma GCC diagnostic pop
  auto text = EncodeManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_NE(text->find("forward_fast_accumulation"), std::string::npos);
  ASSERT_EQ(text->find("tuning"), std::string::npos);
  std::ofstream(copy + "/step-2/MANIFEST", std::ios::trunc) << *text;
  const std::string old_out = Fresh("out_old_manifest"), new_out = Fresh("out_new_manifest");
  absl::Status s = ExportHf(copy + "/step-2", old_out, SafetensorsDtype::kF32);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", new_out, SafetensorsDtype::kF32).ok());
  auto a = SafetensorsFile::Open(old_out + "/model.safetensors");
  auto b = SafetensorsFile::Open(new_out + "/model.safetensors");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const auto& [name, t] : b->tensors()) {
    ASSERT_EQ(a->tensors().count(name), 1u) << name;
    std::vector<float> x(t.numel), y(t.numel);
    ASSERT_TRUE(a->Read(name, 0, t.numel, x.data()).ok());
    ASSERT_TRUE(b->Read(name, 0, t.numel, y.data()).ok());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << name;
  }
}

// Export copies the tokenizer files of --tokenizer (the five names transformers reads beside the
// weights), byte for byte, and nothing else from that directory, and names what it copied.
TEST(HfInterchange, ExportCopiesTheTokenizerFilesAndNamesThem) {
  const Saved& ck = Checkpoint();
  const std::string tok = Fresh("tokenizer_src");
  fs::create_directories(tok);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(tok + "/" + name) << text;
  };
  write("tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}");
  write("tokenizer_config.json", "{\"eos_token\": \"</s>\"}");
  write("notes.txt", "not a tokenizer file");
  const std::string out = Fresh("export_tokenizer");
  HfExportOptions o;
  o.tokenizer_dir = tok;
  std::vector<std::string> copied;
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, o, &copied).ok());
  EXPECT_EQ(copied, (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json"}));
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_EQ(read(out + "/tokenizer.json"), "{\"model\": {\"type\": \"BPE\"}}");
  EXPECT_EQ(read(out + "/tokenizer_config.json"), "{\"eos_token\": \"</s>\"}");
  EXPECT_FALSE(fs::exists(out + "/notes.txt"));
  EXPECT_FALSE(fs::exists(out + "/special_tokens_map.json"));
  EXPECT_TRUE(fs::exists(out + "/config.json"));
}

// Sharded export: with a small maximum shard size the weights go into model-<i>-of-<n>.safetensors
// files and model.safetensors.index.json (read back here with the safetensors reader, independent
// of HfWeights); imported on 3 ranks, each reading only its own ranges, they are the checkpoint's
// weights bit for bit. BF16 shards load as the bf16 rounding of each weight.
TEST(HfInterchange, ShardedExportOfFourOrMoreShardsLoadsBitIdenticalOnThreeRanks) {
  const Saved& ck = Checkpoint();
  const std::string out = Fresh("export_sharded");
  HfExportOptions o;
  o.max_shard_bytes = 16 * 1024;  // the 32 KiB embedding and head alone, the blocks split
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, o).ok());
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  std::ifstream idx(out + "/model.safetensors.index.json");
  const std::string index((std::istreambuf_iterator<char>(idx)), {});
  ASSERT_NE(index.find("\"weight_map\""), std::string::npos) << index;
  ASSERT_NE(index.find("\"total_size\""), std::string::npos) << index;
  int shards = 0;
  int64_t total = 0;
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("model-", 0) != 0) continue;
    ++shards;
    auto st = SafetensorsFile::Open(e.path().string());
    ASSERT_TRUE(st.ok()) << st.status();
    int64_t bytes = 0;
    for (const auto& [name, t] : st->tensors()) {
      bytes += t.end - t.begin;
      names.insert(name);
      // The index puts the tensor in this file.
      EXPECT_NE(index.find("\"" + name + "\": \"" + f + "\""), std::string::npos) << name;
    }
    EXPECT_TRUE(bytes <= o.max_shard_bytes || st->tensors().size() == 1) << f;
    total += bytes;
  }
  EXPECT_GE(shards, 4);
  EXPECT_EQ(names.size(), ck.master.size());
  EXPECT_NE(index.find(absl::StrCat("\"total_size\": ", total)), std::string::npos) << index;
  const Loaded l = LoadJob(testing::InterchangeSpec(TrainFile()), out, 3);
  for (const absl::Status& s : l.status) ASSERT_TRUE(s.ok()) << s;
  for (const auto& [name, v] : ck.master) {
    ASSERT_EQ(l.master.at(name).size(), v.size()) << name;
    EXPECT_EQ(std::memcmp(l.master.at(name).data(), v.data(), v.size() * 4), 0) << name;
  }
  // Re-exporting unsharded into the same directory removes the index (transformers would read it).
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, SafetensorsDtype::kBF16).ok());
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json"));
  o.dtype = SafetensorsDtype::kBF16;
  const std::string bf = Fresh("export_sharded_bf16");
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", bf, o).ok());
  const Loaded lb = LoadJob(testing::InterchangeSpec(TrainFile()), bf, 3);
  for (const absl::Status& s : lb.status) ASSERT_TRUE(s.ok()) << s;
  for (const auto& [name, v] : ck.master) {
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(lb.master.at(name)[i], Bf16ToFloat(FloatToBf16(v[i]))) << name << "[" << i << "]";
    }
  }
}

TEST(HfInterchange, ShardedIndexThatDisagreesWithItsShardsIsRefusedNamingTheFile) {
  const Saved& ck = Checkpoint();
  const std::string out = Fresh("export_badindex");
  HfExportOptions o;
  o.max_shard_bytes = 16 * 1024;
  ASSERT_TRUE(ExportHf(ck.root + "/step-2", out, o).ok());
  std::ifstream in(out + "/model.safetensors.index.json");
  std::string index((std::istreambuf_iterator<char>(in)), {});
  in.close();
  // Point the embedding at the last shard, which does not hold it.
  const std::string key = "\"model.embed_tokens.weight\": \"model-00001-of-";
  const size_t at = index.find(key);
  ASSERT_NE(at, std::string::npos) << index;
  const std::string n = index.substr(at + key.size(), 5);  // the shard count, 5 digits
  index.replace(at + key.size() - 9, 5, n);                // "00001" -> model-<n>-of-<n>
  std::ofstream(out + "/model.safetensors.index.json", std::ios::trunc) << index;
  const absl::Status s = LoadOneRank(out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("model.safetensors.index.json: weight_map puts model.embed_tokens.weight in model-" + n),
            std::string::npos) << s;
  // A shard named by the index that is missing.
  fs::remove(out + "/model-" + n + "-of-" + n + ".safetensors");
  EXPECT_EQ(LoadOneRank(out).code(), absl::StatusCode::kNotFound);
}

// Tied embeddings: the export has no lm_head.weight and says tie_word_embeddings: true; it loads
// on 2 ranks bit for bit.
TEST(HfInterchange, TiedModelExportsWithoutAHeadWeightAndLoadsBitIdentical) {
  v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
  spec.mutable_model()->set_tie_word_embeddings(true);
  const std::string root = Fresh("tied_ckpt");
  auto master = testing::WriteCommittedCheckpoint(spec, 3, 2, root);
  ASSERT_TRUE(master.ok()) << master.status();
  EXPECT_EQ(master->count("lm_head.weight"), 0u);
  const std::string out = Fresh("tied_export");
  ASSERT_TRUE(ExportHf(root + "/step-2", out, SafetensorsDtype::kF32).ok());
  auto st = SafetensorsFile::Open(out + "/model.safetensors");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->tensors().count("lm_head.weight"), 0u);
  std::ifstream cfg(out + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(cfg)), {});
  EXPECT_NE(text.find("\"tie_word_embeddings\": true"), std::string::npos) << text;
  const Loaded l = LoadJob(spec, out, 2);
  for (const absl::Status& s : l.status) ASSERT_TRUE(s.ok()) << s;
  for (const auto& [name, v] : *master) {
    EXPECT_EQ(std::memcmp(l.master.at(name).data(), v.data(), v.size() * 4), 0) << name;
  }
  // The untied model section refuses the tied directory, naming the key.
  const absl::Status s = LoadOneRank(out);
  EXPECT_NE(s.message().find("tie_word_embeddings is true, model.tie_word_embeddings is false"),
            std::string::npos) << s;
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// A hybrid-sharded job's committed checkpoint (2 replicas x 2 ranks, 2-element alignment so that
// its buffers are padded for 4 ranks, not for 2; SHARD_GROUP: 2 files of replica 0, WORLD: 4
// pieces in optimizer order) exports the master weights it trained, and a 2 x 2 WORLD job loads
// the export, each rank its own piece: bit for bit both ways.
TEST(HfInterchange, MeshCheckpointExportsAndLoadsOnAMesh) {
  for (v1::OptimizerSharding sh : {v1::OPTIMIZER_SHARDING_SHARD_GROUP, v1::OPTIMIZER_SHARDING_WORLD}) {
    SCOPED_TRACE(v1::OptimizerSharding_Name(sh));
    v1::JobSpec spec = testing::InterchangeSpec(TrainFile());
    spec.mutable_training()->set_global_batch(8);
    spec.mutable_sharding()->set_max_workers(4);
    spec.mutable_sharding()->set_replicas(2);
    spec.mutable_sharding()->set_optimizer_sharding(sh);
    const v1::JobSpec resolved = WithDefaults(spec, 4);
    const std::string root = Fresh(absl::StrCat("mesh_ckpt_", sh));
    coord::CheckpointStore store(root);
    absl::StatusOr<std::string> dir = store.Prepare(2);
    ASSERT_TRUE(dir.ok()) << dir.status();
    std::vector<v1::CheckpointSaved> saved(4);
    Weights master;
    testing::RunMeshRanks(2, 2, [&](int r, Communicator* world, const MeshComms& comms) {
      auto be = CpuBackend();
      auto t = Trainer::Create(resolved, r, 4, be.get(), world, comms);
      ASSERT_TRUE(t.ok()) << t.status();
      for (int k = 0; k < 2; ++k) ASSERT_TRUE((*t)->Step(k, false, false).ok());
      ASSERT_TRUE(SaveShard(**t, 2, *dir, &saved[r]).ok());
      auto m = (*t)->params().GatherAll(false);
      ASSERT_TRUE(m.ok()) << m.status();
      if (r == 0) master = *m;
    });
    const Mesh mesh = *MeshOf(resolved, 4);
    v1::CheckpointManifest m;
    m.set_job_id("job-mesh");
    m.set_step(2);
    m.set_world_size(mesh.OptimizerShards());
    *m.mutable_spec() = resolved;
    std::vector<v1::CheckpointFile> files(mesh.OptimizerShards());
    for (int r = 0; r < 4; ++r) {
      const CheckpointRole role = CheckpointRoleOf(mesh, r);
      if (!role.writes) continue;
      files[role.file_index].set_rank(role.file_index);
      files[role.file_index].set_file(saved[r].file());
      files[role.file_index].set_bytes(saved[r].bytes());
      files[role.file_index].set_crc32(saved[r].crc32());
    }
    for (const v1::CheckpointFile& f : files) *m.add_files() = f;
    ASSERT_TRUE(store.Commit(m).ok());
    const std::string out = Fresh(absl::StrCat("mesh_export_", sh));
    absl::Status s = ExportHf(root + "/step-2", out, SafetensorsDtype::kF32);
    ASSERT_TRUE(s.ok()) << s;
    v1::JobSpec load = spec;
    load.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
    load.mutable_init()->set_from_hf(out);
    Weights loaded;
    testing::RunMeshRanks(2, 2, [&](int r, Communicator* world, const MeshComms& comms) {
      auto be = CpuBackend();
      auto t = Trainer::Create(WithDefaults(load, 4), r, 4, be.get(), world, comms);
      ASSERT_TRUE(t.ok()) << t.status();
      absl::Status st = LoadHfWeights(t->get(), out);
      ASSERT_TRUE(st.ok()) << st;
      auto g = (*t)->params().GatherAll(false);
      ASSERT_TRUE(g.ok()) << g.status();
      if (r == 0) loaded = *g;
    });
    ASSERT_EQ(loaded.size(), master.size());
    for (const auto& [name, v] : master) {
      ASSERT_EQ(loaded.at(name).size(), v.size()) << name;
      EXPECT_EQ(std::memcmp(loaded.at(name).data(), v.data(), v.size() * 4), 0) << name;
    }
  }
}

}  // namespace
}  // namespace fsdp8
