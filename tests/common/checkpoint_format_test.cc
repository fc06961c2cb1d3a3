// The checkpoint formats (common/checkpoint_format.h): the rank file's bytes against the documented
// layout, written out by hand here; round trips; every check of the readers (magic, version,
// truncation, size and CRC-32 against the trailer and the MANIFEST, malformed sections); the
// MANIFEST's JSON and rules; the directory names.
#include "common/checkpoint_format.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;

// ---- Hand encoding, independent of the code under test ----

std::string Le(uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}
std::string U32(uint32_t v) { return Le(v, 4); }
std::string U64(uint64_t v) { return Le(v, 8); }
std::string Str(const std::string& s) { return U32(static_cast<uint32_t>(s.size())) + s; }

// Bitwise CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), as zlib and Python compute it.
uint32_t ReferenceCrc32(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char c : bytes) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::string WithTrailer(const std::string& body) {
  return body + "FSDP8END" + U32(ReferenceCrc32(body));
}

// The header of rank 1 of 2 at step 7, fingerprint 0x0102030405060708, description "ab", 3
// buffers, byte by byte.
const std::string& HeaderBytes() {
  static const std::string h(
      "FSDP8CKP"
      "\x01\x00\x00\x00"                  // version 1
      "\x01\x00\x00\x00"                  // rank 1
      "\x02\x00\x00\x00"                  // world size 2
      "\x07\x00\x00\x00\x00\x00\x00\x00"  // step 7
      "\x08\x07\x06\x05\x04\x03\x02\x01"  // layout fingerprint
      "\x02\x00\x00\x00" "ab"             // description
      "\x03\x00\x00\x00",                 // 3 flat buffers
      8 + 4 + 4 + 4 + 8 + 8 + 6 + 4);
  return h;
}

RankFileHeader Header() {
  RankFileHeader h;
  h.rank = 1;
  h.world_size = 2;
  h.step = 7;
  h.layout_fingerprint = 0x0102030405060708ull;
  h.description = "ab";
  h.num_buffers = 3;
  return h;
}

std::string Encode(const std::function<void(RankFileEncoder*)>& sections) {
  std::string bytes;
  RankFileEncoder enc([&bytes](const void* p, size_t n) {
    bytes.append(static_cast<const char*>(p), n);
  });
  sections(&enc);
  return bytes;
}

std::string TempPath(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/ckpt_format_" + std::to_string(::getpid());
  fs::create_directories(dir);
  return dir + "/" + name;
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

RankFileReader OpenOk(const std::string& path) {
  absl::StatusOr<RankFileReader> r = RankFileReader::Open(path);
  EXPECT_TRUE(r.ok()) << r.status();
  return std::move(*r);
}

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), text)) << s << "\n  expected: " << text;
}

TEST(CheckpointFormat, ReferenceCrc32MatchesTheStandardCheckValue) {
  EXPECT_EQ(ReferenceCrc32("123456789"), 0xCBF43926u);
}

// ---- Encoding: the documented bytes ----

TEST(CheckpointFormat, HeaderIsEncodedAsDocumented) {
  const std::string bytes = Encode([](RankFileEncoder* e) { e->Header(Header()); });
  EXPECT_EQ(bytes, HeaderBytes());
  ASSERT_EQ(bytes.size(), 46u);
  EXPECT_EQ(bytes.substr(36, 4), U32(2));  // the description's length at offset 36
}

TEST(CheckpointFormat, BufferShardsReplicatedAndTrailerAreEncodedAsDocumented) {
  RankFileReplicated rep;
  rep.weight_scales.push_back({"w", 2.0f, 0.5f, 1.0f});
  ScalingState act;
  act.name = "x";
  act.e5m2 = true;
  act.initialised = true;
  act.scale = 4.0f;
  act.scale_inv = 0.25f;
  act.history = {3.0f, 0.0f};
  rep.act_scaling.push_back(act);
  rep.adamw_step = 7;
  const float shard[2] = {1.0f, -2.0f};
  uint32_t crc = 0;
  int64_t count = 0;
  const std::string bytes = Encode([&](RankFileEncoder* e) {
    e->BufferHeader({1, 0, 2, 5, 6, 3});
    e->ShardArray(shard, 2);
    e->Replicated(rep);
    e->Trailer();
    crc = e->crc32();
    count = e->bytes();
  });
  const std::string body =
      U32(1) + U32(0) + U32(2) + U32(0) + U64(5) + U64(6) + U64(3) +  // buffer header
      U32(0x3f800000) + U32(0xc0000000) +                             // 1.0f, -2.0f
      U32(1) + Str("w") + U32(0x40000000) + U32(0x3f000000) + U32(0x3f800000) +
      U32(1) + Str("x") + std::string("\x01\x01\x00\x00", 4) + U32(0x40800000) +
      U32(0x3e800000) + U32(2) + U32(0x40400000) + U32(0) +  // history {3.0f, 0.0f}
      U64(7);                                                 // AdamW step
  const std::string expected = WithTrailer(body);
  EXPECT_EQ(bytes, expected);
  EXPECT_EQ(count, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(crc, ReferenceCrc32(expected));  // the whole file's, as CheckpointSaved reports it
}

// A buffer with BF16 moments: moment dtype 1 in the header, then the f32 master and the two
// moment arrays as bfloat16 bit patterns, 2 bytes each; read back as f32 (widened exactly), and
// skipped by their own size.
TEST(CheckpointFormat, Bf16MomentsAreEncodedInTwoBytesAndReadAsF32) {
  const float master[2] = {1.0f, -2.0f};
  const uint16_t m[2] = {0x3FC0, 0xBE80};  // 1.5, -0.25
  const uint16_t v[2] = {0x4040, 0x0001};  // 3.0, the smallest bfloat16 subnormal
  RankFileBufferHeader bh{1, 0, 2, 2, 2, 2};
  bh.moments = RankFileArrayDtype::kBf16;
  const std::string bytes = Encode([&](RankFileEncoder* e) {
    e->BufferHeader(bh);
    e->ShardArray(master, 2);
    e->ShardArrayBf16(m, 2);
    e->ShardArrayBf16(v, 2);
  });
  const std::string expected = U32(1) + U32(0) + U32(2) + U32(1) + U64(2) + U64(2) + U64(2) +
                               U32(0x3f800000) + U32(0xc0000000) +
                               std::string("\xC0\x3F\x80\xBE\x40\x40\x01\x00", 8);
  EXPECT_EQ(bytes, expected);

  // The same buffer inside a file: header, this buffer, an empty replicated section.
  const std::string file = Encode([&](RankFileEncoder* e) {
    RankFileHeader h = Header();
    h.num_buffers = 1;
    e->Header(h);
    e->BufferHeader(bh);
    e->ShardArray(master, 2);
    e->ShardArrayBf16(m, 2);
    e->ShardArrayBf16(v, 2);
    e->Replicated(RankFileReplicated{});
    e->Trailer();
  });
  RankFileReader r = OpenOk(WriteFile("bf16_moments.ckpt", file));
  ASSERT_TRUE(r.Verify().ok());
  RankFileHeader h;
  ASSERT_TRUE(r.ReadHeader(&h).ok());
  RankFileBufferHeader got;
  ASSERT_TRUE(r.ReadBufferHeader(&got).ok());
  EXPECT_EQ(got.moments, RankFileArrayDtype::kBf16);
  std::vector<float> x(2), y(1);
  ASSERT_TRUE(r.ReadShardArray(2, 0, 2, x.data()).ok());
  EXPECT_EQ(x, (std::vector<float>{1.0f, -2.0f}));
  ASSERT_TRUE(r.ReadShardArray(2, 1, 1, y.data(), got.moments).ok());  // m: [1, 2)
  EXPECT_EQ(y[0], -0.25f);
  ASSERT_TRUE(r.ReadShardArray(2, 0, 2, x.data(), got.moments).ok());  // v: all
  EXPECT_EQ(x[0], 3.0f);
  EXPECT_EQ(x[1], std::ldexp(1.0f, -133));
  RankFileReplicated rep;
  EXPECT_TRUE(r.ReadReplicated(&rep).ok());  // the body ends right after it: sizes were right
}

TEST(CheckpointFormat, UnknownMomentDtypeIsDataLoss) {
  std::string body = HeaderBytes() + U32(0) + U32(0) + U32(2) + U32(7) + U64(1) + U64(1) + U64(1);
  RankFileReader r = OpenOk(WriteFile("moment_dtype.ckpt", WithTrailer(body)));
  RankFileHeader h;
  ASSERT_TRUE(r.ReadHeader(&h).ok());
  RankFileBufferHeader bh;
  ExpectError(r.ReadBufferHeader(&bh), absl::StatusCode::kDataLoss, "moment dtype 7");
}

// ---- Round trip ----

struct Sample {
  std::string bytes;
  std::vector<std::vector<float>> arrays;  // per buffer: master, m, v of 4 elements each
  RankFileReplicated rep;
};

Sample MakeSample() {
  Sample s;
  for (int a = 0; a < 6; ++a) {
    s.arrays.push_back({a + 0.5f, -a - 0.25f, a * 3.0f, 1e-30f * (a + 1)});
  }
  s.rep.weight_scales = {{"layers.0.attn.q_proj.w", 3.5f, 1 / 3.5f, 0.125f}, {"b", 1, 1, 0}};
  ScalingState st;
  st.name = "layers.0.attn.q_proj.dy";
  st.e5m2 = true;
  st.scale = 8.0f;
  st.scale_inv = 0.125f;
  st.history = {5.0f, 4.0f, 3.0f};
  st.initialised = true;
  s.rep.act_scaling = {st, ScalingState{}};
  s.rep.adamw_step = 7;
  s.bytes = Encode([&](RankFileEncoder* e) {
    RankFileHeader h = Header();
    h.num_buffers = 2;
    e->Header(h);
    for (uint32_t b = 0; b < 2; ++b) {
      e->BufferHeader({0, b, b, 7, 8, 4});
      for (int a = 0; a < 3; ++a) e->ShardArray(s.arrays[b * 3 + a].data(), 4);
    }
    e->Replicated(s.rep);
    e->Trailer();
  });
  return s;
}

TEST(CheckpointFormat, RankFileRoundTrips) {
  const Sample s = MakeSample();
  RankFileReader r = OpenOk(WriteFile("roundtrip.ckpt", s.bytes));
  EXPECT_EQ(r.size(), static_cast<int64_t>(s.bytes.size()));
  v1::CheckpointFile recorded;
  recorded.set_bytes(static_cast<int64_t>(s.bytes.size()));
  recorded.set_crc32(ReferenceCrc32(s.bytes));
  ASSERT_TRUE(r.Verify(&recorded).ok()) << r.Verify(&recorded);
  RankFileHeader h;
  ASSERT_TRUE(r.ReadHeader(&h).ok());
  EXPECT_EQ(h.rank, 1);
  EXPECT_EQ(h.world_size, 2);
  EXPECT_EQ(h.step, 7);
  EXPECT_EQ(h.layout_fingerprint, 0x0102030405060708ull);
  EXPECT_EQ(h.description, "ab");
  EXPECT_EQ(h.num_buffers, 2u);
  for (uint32_t b = 0; b < 2; ++b) {
    RankFileBufferHeader bh;
    ASSERT_TRUE(r.ReadBufferHeader(&bh).ok());
    EXPECT_EQ(bh.unit, 0u);
    EXPECT_EQ(bh.buffer, b);
    EXPECT_EQ(bh.wire, b);
    EXPECT_EQ(bh.numel, 7);
    EXPECT_EQ(bh.padded_numel, 8);
    EXPECT_EQ(bh.shard_numel, 4);
    std::vector<float> all(4), mid(2);
    ASSERT_TRUE(r.ReadShardArray(4, 0, 4, all.data()).ok());                 // master: all
    EXPECT_EQ(all, s.arrays[b * 3]);
    ASSERT_TRUE(r.ReadShardArray(4, 1, 2, mid.data()).ok());                 // m: [1, 3)
    EXPECT_EQ(mid, std::vector<float>(s.arrays[b * 3 + 1].begin() + 1, s.arrays[b * 3 + 1].begin() + 3));
    ASSERT_TRUE(r.ReadShardArray(4, 0, 0, nullptr).ok());                    // v: skipped
  }
  RankFileReplicated rep;
  ASSERT_TRUE(r.ReadReplicated(&rep).ok());
  ASSERT_EQ(rep.weight_scales.size(), 2u);
  EXPECT_EQ(rep.weight_scales[0].name, "layers.0.attn.q_proj.w");
  EXPECT_EQ(rep.weight_scales[0].scale, 3.5f);
  EXPECT_EQ(rep.weight_scales[0].scale_inv, 1 / 3.5f);
  EXPECT_EQ(rep.weight_scales[0].amax, 0.125f);
  EXPECT_EQ(rep.weight_scales[1].name, "b");
  ASSERT_EQ(rep.act_scaling.size(), 2u);
  const ScalingState& a = rep.act_scaling[0];
  EXPECT_EQ(a.name, "layers.0.attn.q_proj.dy");
  EXPECT_TRUE(a.e5m2);
  EXPECT_TRUE(a.initialised);
  EXPECT_EQ(a.scale, 8.0f);
  EXPECT_EQ(a.scale_inv, 0.125f);
  EXPECT_EQ(std::vector<float>(a.history.begin(), a.history.end()), (std::vector<float>{5, 4, 3}));
  EXPECT_FALSE(rep.act_scaling[1].e5m2);
  EXPECT_FALSE(rep.act_scaling[1].initialised);
  EXPECT_TRUE(rep.act_scaling[1].history.empty());
  EXPECT_EQ(rep.adamw_step, 7);
}

// ---- Reader: every check ----

TEST(CheckpointFormat, MissingFileIsNotFound) {
  ExpectError(RankFileReader::Open(TempPath("nope.ckpt")).status(), absl::StatusCode::kNotFound,
              "nope.ckpt is missing");
}

TEST(CheckpointFormat, BadMagicIsDataLoss) {
  std::string body = HeaderBytes();
  body[7] = 'Q';  // "FSDP8CKQ"
  RankFileReader r = OpenOk(WriteFile("magic.ckpt", WithTrailer(body)));
  ASSERT_TRUE(r.Verify().ok());  // the trailer is intact: only the magic is wrong
  RankFileHeader h;
  ExpectError(r.ReadHeader(&h), absl::StatusCode::kDataLoss, "magic.ckpt: not an fsdp8 checkpoint file (bad magic)");
}

TEST(CheckpointFormat, OtherVersionIsFailedPrecondition) {
  std::string body = HeaderBytes();
  body.replace(8, 4, U32(2));
  RankFileReader r = OpenOk(WriteFile("version.ckpt", WithTrailer(body)));
  ASSERT_TRUE(r.Verify().ok());
  RankFileHeader h;
  ExpectError(r.ReadHeader(&h), absl::StatusCode::kFailedPrecondition,
              "version.ckpt: format version 2, this build reads version 1");
}

TEST(CheckpointFormat, TruncatedFilesAreDataLoss) {
  // Shorter than a magic and a trailer.
  RankFileReader tiny = OpenOk(WriteFile("tiny.ckpt", std::string("FSDP8CKP\x01\x00", 10)));
  ExpectError(tiny.Verify(), absl::StatusCode::kDataLoss, "tiny.ckpt: truncated (10 bytes)");
  // The trailer cut off.
  const std::string whole = WithTrailer(HeaderBytes());
  RankFileReader cut = OpenOk(WriteFile("cut.ckpt", whole.substr(0, whole.size() - 5)));
  ExpectError(cut.Verify(), absl::StatusCode::kDataLoss, "cut.ckpt: no checkpoint trailer");
  // A header cut inside the step, with a valid trailer.
  RankFileReader header = OpenOk(WriteFile("header.ckpt", WithTrailer(HeaderBytes().substr(0, 22))));
  ASSERT_TRUE(header.Verify().ok());
  RankFileHeader h;
  ExpectError(header.ReadHeader(&h), absl::StatusCode::kDataLoss,
              "header.ckpt: malformed or truncated at byte 20 (header)");
  // A description longer than 1 MiB.
  std::string big = HeaderBytes();
  big.replace(36, 4, U32((1u << 20) + 1));
  RankFileReader desc = OpenOk(WriteFile("desc.ckpt", WithTrailer(big)));
  ExpectError(desc.ReadHeader(&h), absl::StatusCode::kDataLoss, "(header)");
  // Shard data past the body.
  const std::string shard = U32(1) + U32(0) + U32(2) + U32(0) + U64(5) + U64(6) + U64(3) + U32(0);
  RankFileReader data = OpenOk(WriteFile("data.ckpt", WithTrailer(shard)));
  RankFileBufferHeader bh;
  ASSERT_TRUE(data.ReadBufferHeader(&bh).ok());
  EXPECT_EQ(bh.shard_numel, 3);
  float dst[3];
  ExpectError(data.ReadShardArray(3, 0, 3, dst), absl::StatusCode::kDataLoss,
              "data.ckpt: malformed or truncated at byte 40 (shard data)");
  // Every later read fails too.
  EXPECT_FALSE(data.ReadShardArray(3, 0, 0, nullptr).ok());
}

TEST(CheckpointFormat, SizeMismatchWithTheManifestIsDataLoss) {
  const std::string bytes = WithTrailer(HeaderBytes());
  RankFileReader r = OpenOk(WriteFile("size.ckpt", bytes));
  v1::CheckpointFile recorded;
  recorded.set_bytes(static_cast<int64_t>(bytes.size()) + 1);
  recorded.set_crc32(ReferenceCrc32(bytes));
  ExpectError(r.Verify(&recorded), absl::StatusCode::kDataLoss,
              absl::StrCat("size.ckpt: ", bytes.size(), " bytes, the MANIFEST says ", bytes.size() + 1));
}

TEST(CheckpointFormat, CrcMismatchIsDataLoss) {
  const std::string bytes = WithTrailer(HeaderBytes());
  // Against the trailer: one flipped bit in the description.
  std::string flipped = bytes;
  flipped[40] ^= 0x10;
  RankFileReader r = OpenOk(WriteFile("flip.ckpt", flipped));
  ExpectError(r.Verify(), absl::StatusCode::kDataLoss,
              absl::StrCat("flip.ckpt: checksum mismatch (CRC-32 ",
                           ReferenceCrc32(flipped.substr(0, 46)), ", trailer says ",
                           ReferenceCrc32(HeaderBytes()), ")"));
  // Against the MANIFEST (checked before the trailer).
  v1::CheckpointFile recorded;
  recorded.set_bytes(static_cast<int64_t>(flipped.size()));
  recorded.set_crc32(ReferenceCrc32(bytes));
  ExpectError(r.Verify(&recorded), absl::StatusCode::kDataLoss,
              absl::StrCat("flip.ckpt: CRC-32 ", ReferenceCrc32(flipped), ", the MANIFEST says ",
                           ReferenceCrc32(bytes), ": the file is corrupt"));
}

TEST(CheckpointFormat, MalformedReplicatedSectionsAreDataLoss) {
  struct Case {
    std::string body;
    std::string what;
  };
  const std::string one_act = U32(0) + U32(1) + Str("x") + std::string("\0\0\0\0", 4) + U32(0) +
                              U32(0);
  const Case cases[] = {
      {U32((1u << 24) + 1) + U32(0), "(weight scaling count)"},  // 8 bytes: a minimal body
      {U32(1) + Str("w") + U32(0), "(weight scaling)"},
      {U32(0) + U32((1u << 24) + 1), "(activation scaling count)"},
      {one_act + U32((1u << 20) + 1), "(activation scaling)"},
      {one_act + U32(2) + U32(0), "(amax history)"},
      {one_act + U32(0), "(AdamW step)"},
      {one_act + U32(0) + U64(3) + "z", "(trailing bytes before the trailer)"},
  };
  for (const Case& c : cases) {
    RankFileReader r = OpenOk(WriteFile("rep.ckpt", WithTrailer(c.body)));
    ASSERT_TRUE(r.Verify().ok());
    RankFileReplicated rep;
    ExpectError(r.ReadReplicated(&rep), absl::StatusCode::kDataLoss, c.what);
  }
  RankFileReader ok = OpenOk(WriteFile("rep.ckpt", WithTrailer(one_act + U32(0) + U64(3))));
  RankFileReplicated rep;
  ASSERT_TRUE(ok.ReadReplicated(&rep).ok());
  EXPECT_EQ(rep.adamw_step, 3);
}

// ---- Layout fingerprint ----

uint64_t ReferenceFnv(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

TEST(CheckpointFormat, LayoutFingerprintHashesTheDocumentedFields) {
  EXPECT_EQ(LayoutFingerprint(ShardPlan{}), 0xcbf29ce484222325ull);
  ShardPlan plan;
  plan.world_size = 4;  // not hashed
  plan.alignment = 8;   // not hashed
  UnitPlan unit;
  unit.name = "u";
  BufferPlan buf;
  buf.wire = WireDtype::kBf16;
  buf.numel = 6;
  buf.padded_numel = 32;  // not hashed
  buf.shard_numel = 8;    // not hashed
  TensorSpec t;
  t.name = "t";
  t.shape = {2, 3};
  t.numel = 6;
  buf.tensors = {t};
  buf.offsets = {0};
  unit.buffers = {buf};
  plan.units = {unit};
  const std::string fields = std::string("u\0", 2) + U32(1) + U64(6) + std::string("t\0", 2) +
                             U64(2) + U64(3) + U64(6) + U64(0);
  EXPECT_EQ(LayoutFingerprint(plan), ReferenceFnv(fields));
}

// ---- Directory names ----

TEST(CheckpointFormat, DirectoryAndFileNames) {
  EXPECT_EQ(CheckpointFileName(3), "rank-3.ckpt");
  EXPECT_EQ(StepDirName(12), "step-12");
  EXPECT_EQ(StepOfDirName("step-12"), 12);
  EXPECT_EQ(StepOfDirName("step-0"), 0);
  for (const char* bad : {"step-", "step-x", "step-+1", "step--1", "step-1.old", "Step-1",
                          "step-1234567890123456789", "notes"}) {
    EXPECT_EQ(StepOfDirName(bad), -1) << bad;
  }
}

// ---- MANIFEST ----

v1::CheckpointManifest Manifest() {
  v1::CheckpointManifest m;
  m.set_format_version(1);
  m.set_job_id("job-1");
  m.set_step(4);
  m.set_world_size(2);
  m.mutable_spec()->mutable_model()->set_d_model(32);
  for (int r = 0; r < 2; ++r) {
    v1::CheckpointFile* f = m.add_files();
    f->set_rank(r);
    f->set_file(CheckpointFileName(r));
    f->set_bytes(100 + r);
    f->set_crc32(0xfffffff0u + r);
  }
  m.set_time(1.5);
  m.set_tokens(4096);
  return m;
}

TEST(CheckpointFormat, ManifestRoundTripsThroughItsJson) {
  const v1::CheckpointManifest m = Manifest();
  absl::StatusOr<std::string> json = EncodeManifest(m);
  ASSERT_TRUE(json.ok()) << json.status();
  // Proto field names, indented.
  EXPECT_TRUE(absl::StrContains(*json, "\"format_version\": 1")) << *json;
  EXPECT_TRUE(absl::StrContains(*json, "\"world_size\": 2")) << *json;
  EXPECT_TRUE(absl::StrContains(*json, "\"file\": \"rank-1.ckpt\"")) << *json;
  absl::StatusOr<v1::CheckpointManifest> back = DecodeManifest(*json, "here");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m.SerializeAsString());
}

TEST(CheckpointFormat, ManifestTextWrittenByHandDecodes) {
  const std::string text = R"({
    "format_version": 1, "job_id": "j", "step": "3", "world_size": 1,
    "files": [{"rank": 0, "file": "rank-0.ckpt", "bytes": "120", "crc32": 4294967295}],
    "tokens": "64", "a_newer_field": true
  })";
  absl::StatusOr<v1::CheckpointManifest> m = DecodeManifest(text, "here");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->job_id(), "j");
  EXPECT_EQ(m->step(), 3);
  EXPECT_EQ(m->world_size(), 1);
  ASSERT_EQ(m->files_size(), 1);
  EXPECT_EQ(m->files(0).bytes(), 120);
  EXPECT_EQ(m->files(0).crc32(), 0xffffffffu);
  EXPECT_EQ(m->tokens(), 64);
}

TEST(CheckpointFormat, InvalidManifestsAreRefused) {
  ExpectError(DecodeManifest("{\"step\": [", "where").status(), absl::StatusCode::kDataLoss,
              "where: invalid MANIFEST: ");
  v1::CheckpointManifest m = Manifest();
  m.set_format_version(2);
  ExpectError(CheckManifest(m, "where"), absl::StatusCode::kFailedPrecondition,
              "where: MANIFEST format_version 2, this build reads 1");
  struct Case {
    std::function<void(v1::CheckpointManifest*)> edit;
    std::string why;
  };
  const Case cases[] = {
      {[](v1::CheckpointManifest* x) { x->set_step(-1); }, "step -1"},
      {[](v1::CheckpointManifest* x) { x->set_world_size(0); }, "world_size 0"},
      {[](v1::CheckpointManifest* x) { x->set_world_size(3); }, "2 files for world_size 3"},
      {[](v1::CheckpointManifest* x) { x->mutable_files(1)->set_rank(0); }, "files[1].rank is 0"},
      {[](v1::CheckpointManifest* x) { x->mutable_files(0)->set_file("../escape"); },
       "files[0].file \"../escape\" is not a plain file name"},
      {[](v1::CheckpointManifest* x) { x->mutable_files(0)->set_file("MANIFEST"); },
       "files[0].file \"MANIFEST\" is not a plain file name"},
      {[](v1::CheckpointManifest* x) { x->mutable_files(0)->set_file(""); },
       "files[0].file \"\" is not a plain file name"},
      {[](v1::CheckpointManifest* x) { x->mutable_files(1)->set_bytes(-1); }, "files[1].bytes -1"},
  };
  for (const Case& c : cases) {
    v1::CheckpointManifest x = Manifest();
    c.edit(&x);
    ExpectError(CheckManifest(x, "where"), absl::StatusCode::kDataLoss,
                "where: invalid MANIFEST: " + c.why);
  }
  EXPECT_TRUE(CheckManifest(Manifest(), "where").ok());
}

TEST(CheckpointFormat, ManifestFileIsReadFromItsStepDirectory) {
  const std::string root = TempPath("manifests");
  fs::remove_all(root);
  ExpectError(ReadManifestFile(root + "/step-4").status(), absl::StatusCode::kNotFound,
              "no such directory");
  fs::create_directories(root + "/step-4");
  ExpectError(ReadManifestFile(root + "/step-4").status(), absl::StatusCode::kNotFound,
              "checkpoint " + root + "/step-4: no MANIFEST (not a committed checkpoint)");
  std::ofstream(root + "/step-4/MANIFEST") << *EncodeManifest(Manifest());
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifestFile(root + "/step-4/");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step(), 4);
  // Under another step's name, or any name: only step-<k> names are checked.
  fs::create_directories(root + "/step-5");
  fs::copy_file(root + "/step-4/MANIFEST", root + "/step-5/MANIFEST");
  ExpectError(ReadManifestFile(root + "/step-5").status(), absl::StatusCode::kDataLoss,
              "invalid MANIFEST: step 4 in a directory named step-5");
  fs::create_directories(root + "/export");
  fs::copy_file(root + "/step-4/MANIFEST", root + "/export/MANIFEST");
  EXPECT_TRUE(ReadManifestFile(root + "/export").ok());
  std::ofstream(root + "/step-4/MANIFEST", std::ios::trunc) << "{\"format_version\": ";
  ExpectError(ReadManifestFile(root + "/step-4").status(), absl::StatusCode::kDataLoss,
              "checkpoint " + root + "/step-4: invalid MANIFEST");
}

}  // namespace
}  // namespace fsdp8
