#include "common/checkpoint_format.h"

#include <errno.h>
#include <sys/types.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checkpoint formats assume little-endian");

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;

constexpr size_t kIoChunk = 1 << 20;
constexpr uint32_t kMaxStrBytes = 1u << 20;
constexpr uint32_t kMaxScalingEntries = 1u << 24;
constexpr uint32_t kMaxAmaxHistory = 1u << 20;

uint32_t Crc(uint32_t crc, const void* p, size_t n) {
  const Bytef* b = static_cast<const Bytef*>(p);
  while (n > 0) {
    const uInt k = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(::crc32(crc, b, k));
    b += k;
    n -= k;
  }
  return crc;
}

void Fnv(uint64_t* h, const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    *h ^= b[i];
    *h *= 1099511628211ull;
  }
}

absl::Status OpenError(int err, const std::string& path) {
  const std::string msg = absl::StrCat("opening ", path, ": ", std::strerror(err));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// The file's CRC-32s over the body and over everything, and its last 12 bytes (the trailer).
struct Scan {
  uint32_t body_crc = 0;
  uint32_t file_crc = 0;
  char trailer[kRankFileTrailerBytes] = {};
};

absl::Status ScanFile(FILE* f, const std::string& path, int64_t size, Scan* scan) {
  const int64_t body = size - kRankFileTrailerBytes;
  if (fseeko(f, 0, SEEK_SET) != 0) return OpenError(errno, path);
  std::vector<char> buf(kIoChunk);
  for (int64_t pos = 0; pos < size;) {
    const size_t k = static_cast<size_t>(std::min<int64_t>(kIoChunk, size - pos));
    if (std::fread(buf.data(), 1, k, f) != k) {
      return absl::DataLossError(absl::StrCat(path, ": short read while checksumming"));
    }
    scan->file_crc = Crc(scan->file_crc, buf.data(), k);
    if (pos < body) scan->body_crc = Crc(scan->body_crc, buf.data(), std::min<int64_t>(k, body - pos));
    for (int64_t i = std::max(pos, body); i < pos + static_cast<int64_t>(k); ++i) {
      scan->trailer[i - body] = buf[static_cast<size_t>(i - pos)];
    }
    pos += static_cast<int64_t>(k);
  }
  return absl::OkStatus();
}

bool PlainFileName(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
         f != kManifestFileName && f != kStepJobFileName;
}

}  // namespace

// ---- Directory layout ----

std::string CheckpointFileName(int rank) { return absl::StrCat("rank-", rank, ".ckpt"); }

std::string StepDirName(int64_t step) { return absl::StrCat(kStepDirPrefix, step); }

int64_t StepOfDirName(const std::string& name) {
  if (name.rfind(kStepDirPrefix, 0) != 0) return -1;
  const std::string digits = name.substr(sizeof(kStepDirPrefix) - 1);
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
  }
  int64_t k = 0;
  if (!absl::SimpleAtoi(digits, &k)) return -1;
  return k;
}

// ---- Rank file: encoding ----

uint64_t LayoutFingerprint(const ShardPlan& plan) {
  uint64_t h = 14695981039346656037ull;
  for (const UnitPlan& u : plan.units) {
    Fnv(&h, u.name.data(), u.name.size() + 1);  // with the NUL as a separator
    for (const BufferPlan& b : u.buffers) {
      const uint32_t wire = static_cast<uint32_t>(b.wire);
      Fnv(&h, &wire, sizeof(wire));
      Fnv(&h, &b.numel, sizeof(b.numel));
      for (size_t t = 0; t < b.tensors.size(); ++t) {
        const TensorSpec& ts = b.tensors[t];
        Fnv(&h, ts.name.data(), ts.name.size() + 1);
        for (int64_t d : ts.shape) Fnv(&h, &d, sizeof(d));
        Fnv(&h, &ts.numel, sizeof(ts.numel));
        Fnv(&h, &b.offsets[t], sizeof(int64_t));
      }
    }
  }
  return h;
}

void RankFileEncoder::Put(const void* p, size_t n) {
  crc_ = Crc(crc_, p, n);
  bytes_ += static_cast<int64_t>(n);
  sink_(p, n);
}

void RankFileEncoder::Str(const std::string& s) {
  Pod<uint32_t>(static_cast<uint32_t>(s.size()));
  Put(s.data(), s.size());
}

void RankFileEncoder::Header(const RankFileHeader& h) {
  Put(kRankFileMagic, sizeof(kRankFileMagic));
  Pod<uint32_t>(kRankFileVersion);
  Pod<int32_t>(h.rank);
  Pod<int32_t>(h.world_size);
  Pod<int64_t>(h.step);
  Pod<uint64_t>(h.layout_fingerprint);
  Str(h.description);
  Pod<uint32_t>(h.num_buffers);
}

void RankFileEncoder::BufferHeader(const RankFileBufferHeader& b) {
  Pod<uint32_t>(b.unit);
  Pod<uint32_t>(b.buffer);
  Pod<uint32_t>(b.wire);
  Pod<uint32_t>(static_cast<uint32_t>(b.moments));
  Pod<int64_t>(b.numel);
  Pod<int64_t>(b.padded_numel);
  Pod<int64_t>(b.shard_numel);
}

void RankFileEncoder::ShardArray(const float* values, int64_t n) {
  Put(values, static_cast<size_t>(n) * sizeof(float));
}

void RankFileEncoder::ShardArrayBf16(const uint16_t* bits, int64_t n) {
  Put(bits, static_cast<size_t>(n) * sizeof(uint16_t));
}

void RankFileEncoder::Replicated(const RankFileReplicated& r) {
  Pod<uint32_t>(static_cast<uint32_t>(r.weight_scales.size()));
  for (const RankFileWeightScale& s : r.weight_scales) {
    Str(s.name);
    Pod<float>(s.scale);
    Pod<float>(s.scale_inv);
    Pod<float>(s.amax);
  }
  Pod<uint32_t>(static_cast<uint32_t>(r.act_scaling.size()));
  for (const ScalingState& s : r.act_scaling) {
    Str(s.name);
    Pod<uint8_t>(s.e5m2 ? 1 : 0);
    Pod<uint8_t>(s.initialised ? 1 : 0);
    Pod<uint16_t>(0);
    Pod<float>(s.scale);
    Pod<float>(s.scale_inv);
    Pod<uint32_t>(static_cast<uint32_t>(s.history.size()));
    for (float a : s.history) Pod<float>(a);
  }
  Pod<int64_t>(r.adamw_step);
}

void RankFileEncoder::Trailer() {
  const uint32_t body_crc = crc_;
  Put(kRankFileEndMagic, sizeof(kRankFileEndMagic));
  Pod<uint32_t>(body_crc);
}

// ---- Rank file: reading ----

void RankFileReader::FileCloser::operator()(FILE* f) const {
  if (f) std::fclose(f);
}

RankFileReader::RankFileReader(std::unique_ptr<FILE, FileCloser> f, std::string path, int64_t size)
    : f_(std::move(f)),
      path_(std::move(path)),
      size_(size),
      body_(std::max<int64_t>(0, size - kRankFileTrailerBytes)) {}

absl::StatusOr<RankFileReader> RankFileReader::Open(const std::string& path) {
  std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " is missing"));
    return OpenError(errno, path);
  }
  if (fseeko(f.get(), 0, SEEK_END) != 0) return OpenError(errno, path);
  const int64_t size = ftello(f.get());
  if (size < 0 || fseeko(f.get(), 0, SEEK_SET) != 0) return OpenError(errno, path);
  return RankFileReader(std::move(f), path, size);
}

absl::Status RankFileReader::Verify(const v1::CheckpointFile* recorded) {
  if (recorded && size_ != recorded->bytes()) {
    return absl::DataLossError(absl::StrCat(path_, ": ", size_, " bytes, the MANIFEST says ",
                                            recorded->bytes(), " (truncated or replaced)"));
  }
  if (size_ < kRankFileMinBytes) {
    return absl::DataLossError(absl::StrCat(path_, ": truncated (", size_, " bytes)"));
  }
  Scan scan;
  if (absl::Status s = ScanFile(f_.get(), path_, size_, &scan); !s.ok()) return s;
  if (recorded && scan.file_crc != recorded->crc32()) {
    return absl::DataLossError(absl::StrCat(path_, ": CRC-32 ", scan.file_crc,
                                            ", the MANIFEST says ", recorded->crc32(),
                                            ": the file is corrupt"));
  }
  uint32_t stored = 0;
  std::memcpy(&stored, scan.trailer + sizeof(kRankFileEndMagic), sizeof(stored));
  if (std::memcmp(scan.trailer, kRankFileEndMagic, sizeof(kRankFileEndMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path_, ": no checkpoint trailer (truncated file?)"));
  }
  if (scan.body_crc != stored) {
    return absl::DataLossError(absl::StrCat(path_, ": checksum mismatch (CRC-32 ", scan.body_crc,
                                            ", trailer says ", stored, "): the file is corrupt"));
  }
  if (fseeko(f_.get(), 0, SEEK_SET) != 0) return OpenError(errno, path_);
  pos_ = 0;
  return absl::OkStatus();
}

bool RankFileReader::Bytes(void* p, size_t n) {
  if (!ok_) return false;
  if (pos_ + static_cast<int64_t>(n) > body_ || std::fread(p, 1, n, f_.get()) != n) {
    return ok_ = false;
  }
  pos_ += static_cast<int64_t>(n);
  return true;
}

bool RankFileReader::Str(std::string* s) {
  uint32_t n = 0;
  if (!Pod(&n) || n > kMaxStrBytes) return ok_ = false;
  s->resize(n);
  return Bytes(s->data(), n);
}

bool RankFileReader::Skip(int64_t n) {
  if (!ok_) return false;
  if (n < 0 || pos_ + n > body_ || fseeko(f_.get(), static_cast<off_t>(n), SEEK_CUR) != 0) {
    return ok_ = false;
  }
  pos_ += n;
  return true;
}

absl::Status RankFileReader::Malformed(const std::string& what) const {
  return absl::DataLossError(
      absl::StrCat(path_, ": malformed or truncated at byte ", pos_, " (", what, ")"));
}

absl::Status RankFileReader::ReadHeader(RankFileHeader* h) {
  char magic[sizeof(kRankFileMagic)];
  if (!Bytes(magic, sizeof(magic)) || std::memcmp(magic, kRankFileMagic, sizeof(magic)) != 0) {
    ok_ = false;
    return absl::DataLossError(absl::StrCat(path_, ": not an fsdp8 checkpoint file (bad magic)"));
  }
  uint32_t version = 0;
  if (!Pod(&version)) return Malformed("version");
  if (version != kRankFileVersion) {
    ok_ = false;
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": format version ", version, ", this build reads version ", kRankFileVersion));
  }
  if (!Pod(&h->rank) || !Pod(&h->world_size) || !Pod(&h->step) || !Pod(&h->layout_fingerprint) ||
      !Str(&h->description) || !Pod(&h->num_buffers)) {
    return Malformed("header");
  }
  return absl::OkStatus();
}

absl::Status RankFileReader::ReadBufferHeader(RankFileBufferHeader* b) {
  uint32_t moments = 0;
  if (!Pod(&b->unit) || !Pod(&b->buffer) || !Pod(&b->wire) || !Pod(&moments) ||
      !Pod(&b->numel) || !Pod(&b->padded_numel) || !Pod(&b->shard_numel)) {
    return Malformed("buffer header");
  }
  if (moments > static_cast<uint32_t>(RankFileArrayDtype::kBf16)) {
    ok_ = false;
    return absl::DataLossError(absl::StrCat(path_, ": buffer header before byte ", pos_,
                                            ": unknown moment dtype ", moments,
                                            " (0: f32, 1: bf16)"));
  }
  b->moments = static_cast<RankFileArrayDtype>(moments);
  return absl::OkStatus();
}

absl::Status RankFileReader::ReadShardArray(int64_t shard_numel, int64_t lo, int64_t n,
                                            float* dst, RankFileArrayDtype dtype) {
  const bool bf16 = dtype == RankFileArrayDtype::kBf16;
  const int64_t e = bf16 ? static_cast<int64_t>(sizeof(uint16_t)) : static_cast<int64_t>(sizeof(float));
  if (lo < 0 || n < 0 || lo + n > shard_numel) {
    ok_ = false;
    return absl::InvalidArgumentError(absl::StrCat(path_, ": elements [", lo, ", ", lo + n,
                                                   ") of a shard of ", shard_numel));
  }
  if (n == 0) {
    if (!Skip(shard_numel * e)) return Malformed("shard data");
    return absl::OkStatus();
  }
  if (!Skip(lo * e)) return Malformed("shard data");
  if (!bf16) {
    if (!Bytes(dst, static_cast<size_t>(n * e))) return Malformed("shard data");
  } else {
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    if (!Bytes(bits.data(), static_cast<size_t>(n * e))) return Malformed("shard data");
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(&dst[i], &u, sizeof(float));
    }
  }
  if (!Skip((shard_numel - lo - n) * e)) return Malformed("shard data");
  return absl::OkStatus();
}

absl::Status RankFileReader::ReadScalingState(ScalingState* s) {
  uint8_t e5m2 = 0, initialised = 0;
  uint16_t reserved = 0;
  uint32_t h = 0;
  if (!Str(&s->name) || !Pod(&e5m2) || !Pod(&initialised) || !Pod(&reserved) ||
      !Pod(&s->scale) || !Pod(&s->scale_inv) || !Pod(&h) || h > kMaxAmaxHistory) {
    ok_ = false;
    return Malformed("activation scaling");
  }
  s->e5m2 = e5m2 != 0;
  s->initialised = initialised != 0;
  s->history.clear();
  for (uint32_t k = 0; k < h; ++k) {
    float amax = 0;
    if (!Pod(&amax)) return Malformed("amax history");
    s->history.push_back(amax);
  }
  return absl::OkStatus();
}

absl::Status RankFileReader::ReadReplicated(RankFileReplicated* r) {
  uint32_t nw = 0;
  if (!Pod(&nw) || nw > kMaxScalingEntries) return Malformed("weight scaling count");
  r->weight_scales.resize(nw);
  for (RankFileWeightScale& s : r->weight_scales) {
    if (!Str(&s.name) || !Pod(&s.scale) || !Pod(&s.scale_inv) || !Pod(&s.amax)) {
      return Malformed("weight scaling");
    }
  }
  uint32_t na = 0;
  if (!Pod(&na) || na > kMaxScalingEntries) return Malformed("activation scaling count");
  r->act_scaling.resize(na);
  for (ScalingState& s : r->act_scaling) {
    if (absl::Status st = ReadScalingState(&s); !st.ok()) return st;
  }
  if (!Pod(&r->adamw_step)) return Malformed("AdamW step");
  if (pos_ != body_) return Malformed("trailing bytes before the trailer");
  return absl::OkStatus();
}

// ---- MANIFEST ----

absl::Status CheckManifest(const v1::CheckpointManifest& m, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(where, ": invalid MANIFEST: ", why));
  };
  if (m.format_version() != kManifestFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": MANIFEST format_version ", m.format_version(),
                     ", this build reads ", kManifestFormatVersion));
  }
  if (m.step() < 0) return bad(absl::StrCat("step ", m.step()));
  if (m.world_size() < 1) return bad(absl::StrCat("world_size ", m.world_size()));
  if (m.files_size() != m.world_size()) {
    return bad(absl::StrCat(m.files_size(), " files for world_size ", m.world_size()));
  }
  for (int r = 0; r < m.files_size(); ++r) {
    const v1::CheckpointFile& f = m.files(r);
    if (f.rank() != r) return bad(absl::StrCat("files[", r, "].rank is ", f.rank()));
    if (!PlainFileName(f.file())) {
      return bad(absl::StrCat("files[", r, "].file \"", f.file(), "\" is not a plain file name"));
    }
    if (f.bytes() < 0) return bad(absl::StrCat("files[", r, "].bytes ", f.bytes()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EncodeManifest(const v1::CheckpointManifest& m) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  std::string json;
  if (auto st = google::protobuf::util::MessageToJsonString(m, &json, opts); !st.ok()) {
    return absl::InternalError(absl::StrCat("encoding the MANIFEST: ", std::string(st.message())));
  }
  return json;
}

absl::StatusOr<v1::CheckpointManifest> DecodeManifest(const std::string& text,
                                                      const std::string& where) {
  v1::CheckpointManifest m;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = true;  // newer coordinators may add fields
  if (auto st = google::protobuf::util::JsonStringToMessage(text, &m, opts); !st.ok()) {
    return absl::DataLossError(
        absl::StrCat(where, ": invalid MANIFEST: ", std::string(st.message())));
  }
  if (absl::Status s = CheckManifest(m, where); !s.ok()) return s;
  return m;
}

absl::StatusOr<v1::CheckpointManifest> ReadManifestFile(const std::string& step_dir) {
  const std::string where = absl::StrCat("checkpoint ", step_dir);
  std::ifstream in((fs::path(step_dir) / kManifestFileName).string(), std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::is_directory(step_dir, ec)) {
      return absl::NotFoundError(absl::StrCat(where, ": no such directory"));
    }
    return absl::NotFoundError(absl::StrCat(where, ": no MANIFEST (not a committed checkpoint)"));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::CheckpointManifest> m = DecodeManifest(text.str(), where);
  if (!m.ok()) return m.status();
  fs::path norm = fs::path(step_dir).lexically_normal();
  if (!norm.has_filename()) norm = norm.parent_path();  // "step-3/"
  const int64_t k = StepOfDirName(norm.filename().string());
  if (k >= 0 && k != m->step()) {
    return absl::DataLossError(absl::StrCat(where, ": invalid MANIFEST: step ", m->step(),
                                            " in a directory named ", StepDirName(k)));
  }
  return m;
}

// ---- OWNER ----

absl::StatusOr<std::string> EncodeOwner(v1::CheckpointDirOwner o) {
  if (o.format_version() == 0) o.set_format_version(kOwnerFormatVersion);
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  std::string json;
  if (auto st = google::protobuf::util::MessageToJsonString(o, &json, opts); !st.ok()) {
    return absl::InternalError(absl::StrCat("encoding the OWNER record: ", std::string(st.message())));
  }
  return json;
}

absl::StatusOr<v1::CheckpointDirOwner> DecodeOwner(const std::string& text,
                                                   const std::string& where) {
  v1::CheckpointDirOwner o;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = true;
  if (auto st = google::protobuf::util::JsonStringToMessage(text, &o, opts); !st.ok()) {
    return absl::DataLossError(
        absl::StrCat(where, ": invalid OWNER record: ", std::string(st.message())));
  }
  if (o.format_version() != kOwnerFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": OWNER format_version ",
                                                      o.format_version(), ", this build reads ",
                                                      kOwnerFormatVersion));
  }
  if (o.owner().job_id().empty()) {
    return absl::DataLossError(absl::StrCat(where, ": invalid OWNER record: no owner.job_id"));
  }
  return o;
}

absl::StatusOr<std::optional<v1::CheckpointDirOwner>> ReadOwnerFile(const std::string& dir) {
  const fs::path path = fs::path(dir) / kOwnerFileName;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<v1::CheckpointDirOwner>();
  std::ifstream in(path.string(), std::ios::binary);
  if (!in) return absl::InternalError(absl::StrCat("cannot read ", path.string()));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::CheckpointDirOwner> o =
      DecodeOwner(text.str(), absl::StrCat("checkpoint.dir ", dir));
  if (!o.ok()) return o.status();
  return std::optional<v1::CheckpointDirOwner>(std::move(*o));
}

std::string ReadStepJobFile(const std::string& step_dir) {
  std::ifstream in((fs::path(step_dir) / kStepJobFileName).string(), std::ios::binary);
  std::string id;
  if (in) std::getline(in, id);
  return id;
}

}  // namespace fsdp8
