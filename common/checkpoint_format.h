// The on-disk formats of a sharded checkpoint, encoded and decoded in this one place: the rank
// files (written by every rank, read by the ranks on resume and by the Hugging Face export) and
// the MANIFEST (written by the coordinator last, read by the coordinator and the export).
//
// Directory layout (docs/architecture.md, Checkpoints):
//   <root>/step-<k>/rank-<r>.ckpt   rank r's shard of the state after k optimizer steps
//   <root>/step-<k>/MANIFEST        protobuf JSON of v1::CheckpointManifest; its presence (and
//                                   validity) is what makes step-<k> a committed checkpoint
//   <root>/step-<k>/JOB             the id of the job that prepared step-<k> (one line of text)
//   <root>/OWNER                    protobuf JSON of v1::CheckpointDirOwner: the job the directory
//                                   belongs to, its earlier owners, and the lease of the
//                                   coordinator running the owner job
//   <root>/OWNER.lock               empty; flock'ed while OWNER is read and written and while a
//                                   MANIFEST is committed
//
// ---- Rank file, version 1 -------------------------------------------------------------------
// All integers and floats little-endian; f32 as IEEE-754 bits; no alignment padding anywhere.
// str = u32 byte length + that many bytes (no NUL), at most 1 MiB.
//
//   offset  size  field
//   header
//     0       8   magic "FSDP8CKP"
//     8       4   u32 format version (1)
//    12       4   i32 rank                      of the job that wrote the file
//    16       4   i32 world size                of the job that wrote the file
//    20       8   i64 step                      completed optimizer steps = next step to run
//    28       8   u64 layout fingerprint        LayoutFingerprint() of the shard plan
//    36   4 + n   str description               model dims + precision plan, for error messages
//     .       4   u32 number of flat buffers    B
//   buffers: B times, per FSDP unit and flat buffer in shard-plan order
//             4   u32 unit index
//             4   u32 buffer index within the unit
//             4   u32 wire dtype                (WireDtype's value)
//             4   u32 moment dtype              RankFileArrayDtype of m and v: 0 f32, 1 bf16
//                                               (optimizer.state_precision; files written
//                                               before BF16 moments existed hold 0 here)
//             8   i64 numel                     elements of the flat buffer
//             8   i64 padded numel              = shard numel * world size >= numel
//             8   i64 shard numel               S
//          4 * S  f32[S] FP32 master weights    rank r's slice [r * S, (r + 1) * S) of the flat
//        e * S  m[S] AdamW m                    buffer; elements past numel (padding) are 0.
//        e * S  m[S] AdamW v                    m: f32 (e = 4) or bfloat16 bit patterns, u16
//                                               (e = 2), as the moment dtype says
//   replicated state (identical on every rank)
//             4   u32 W, then W times:          FP8 weight scales
//                   str name, f32 scale, f32 scale_inv, f32 amax
//             4   u32 A, then A times:          activation / grad-output delayed scaling
//                   str name, u8 e5m2 (0/1), u8 initialised (0/1), u16 reserved (0),
//                   f32 scale, f32 scale_inv, u32 H, f32[H] amax history (newest first)
//             8   i64 AdamW step counter        (= step: step k runs AdamW with counter k + 1)
//   trailer (the last 12 bytes)
//             8   magic "FSDP8END"
//             4   u32 CRC-32 of every byte before the trailer
//
// CRC-32 is zlib's crc32 (IEEE 802.3 polynomial, Python's zlib.crc32). The whole file's CRC-32
// (trailer included) is what a rank reports in v1::CheckpointSaved.crc32 and what the MANIFEST
// records per file. Limits on decode: W, A <= 2^24, H <= 2^20.
//
// The layout fingerprint covers the units, buffers, wire dtypes and tensors of the plan but not
// the world size or the alignment, so a file loads into any world size of the same model and
// precision plan (reshard). There is no RNG state or data position: both are functions of
// (seed, step).
//
// ---- MANIFEST, format_version 1 -------------------------------------------------------------
// The protobuf JSON (field names as in proto/fsdp8/v1/checkpoint.proto, indented) of a
// v1::CheckpointManifest; unknown fields are ignored on decode. Valid when: format_version is 1,
// step >= 0, world_size >= 1, exactly world_size files with files[r].rank == r, each file a plain
// name in the step directory (not empty, ".", "..", "MANIFEST", no '/') with bytes >= 0, and,
// read from a directory named step-<k>, step == k.
//
// ---- Errors -----------------------------------------------------------------------------------
// Every message names the file (or `where`). DATA_LOSS: a damaged file (bad magic, truncation,
// a size or CRC-32 that disagrees with the trailer or the MANIFEST, a malformed section, an
// invalid MANIFEST). FAILED_PRECONDITION: a format version this build does not read. NOT_FOUND:
// a missing rank file, step directory or MANIFEST. INTERNAL (or PERMISSION_DENIED) for other I/O
// failures, with the errno text.
//
// Thread-safety: functions touch only their arguments and the named files; an encoder or a
// reader is used by one thread at a time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/scaling.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/checkpoint.pb.h"

namespace fsdp8 {

// ---- Directory layout ----
inline constexpr char kManifestFileName[] = "MANIFEST";
inline constexpr char kStepDirPrefix[] = "step-";
// "rank-<r>.ckpt".
std::string CheckpointFileName(int rank);
// "step-<k>".
std::string StepDirName(int64_t step);
// k for a name "step-<k>" (1 to 18 decimal digits, nothing else); -1 for any other name.
int64_t StepOfDirName(const std::string& name);

// ---- Rank file ----
inline constexpr char kRankFileMagic[8] = {'F', 'S', 'D', 'P', '8', 'C', 'K', 'P'};
inline constexpr char kRankFileEndMagic[8] = {'F', 'S', 'D', 'P', '8', 'E', 'N', 'D'};
inline constexpr uint32_t kRankFileVersion = 1;
inline constexpr int64_t kRankFileTrailerBytes = 12;
// The smallest file that can hold a magic and a trailer.
inline constexpr int64_t kRankFileMinBytes = 8 + kRankFileTrailerBytes;

// FNV-1a 64 of the plan's units (names), buffers (wire dtype, numel) and tensors (name, shape,
// numel, offset in the flat buffer); names are hashed with their NUL as a separator.
uint64_t LayoutFingerprint(const ShardPlan& plan);

// The header section. The version is not a field: the encoder writes kRankFileVersion and the
// reader refuses any other.
struct RankFileHeader {
  int32_t rank = 0;
  int32_t world_size = 0;
  int64_t step = 0;
  uint64_t layout_fingerprint = 0;
  std::string description;
  uint32_t num_buffers = 0;
};

// The element type of a shard array in a rank file: the master weights are always kF32, the
// AdamW moments as the buffer header's `moments` says.
enum class RankFileArrayDtype : uint32_t { kF32 = 0, kBf16 = 1 };

// The header of one flat buffer; three arrays of shard_numel elements follow it (master f32,
// then m and v in `moments`).
struct RankFileBufferHeader {
  uint32_t unit = 0;
  uint32_t buffer = 0;
  uint32_t wire = 0;  // static_cast<uint32_t>(WireDtype)
  int64_t numel = 0;
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;
  RankFileArrayDtype moments = RankFileArrayDtype::kF32;  // m and v (after wire in the file)
};

// One FP8 weight's scale, as stored (the replicated section).
struct RankFileWeightScale {
  std::string name;
  float scale = 1.0f;
  float scale_inv = 1.0f;
  float amax = 0.0f;
};

// The replicated section, after the buffers.
struct RankFileReplicated {
  std::vector<RankFileWeightScale> weight_scales;
  std::vector<ScalingState> act_scaling;
  int64_t adamw_step = 0;
};

// Writes a rank file section by section, in the order of the layout above: Header, then per
// buffer BufferHeader and three ShardArray calls (master, m, v: ShardArrayBf16 for the moments
// when the buffer header says kBf16), then Replicated, then Trailer.
// The bytes go to `sink` in order, in pieces of any size; the encoder keeps the running CRC-32
// and byte count. It does no I/O of its own and cannot fail.
class RankFileEncoder {
 public:
  using Sink = std::function<void(const void* data, size_t n)>;
  explicit RankFileEncoder(Sink sink) : sink_(std::move(sink)) {}

  void Header(const RankFileHeader& h);
  void BufferHeader(const RankFileBufferHeader& b);
  void ShardArray(const float* values, int64_t n);
  // bfloat16 bit patterns (2 bytes each).
  void ShardArrayBf16(const uint16_t* bits, int64_t n);
  void Replicated(const RankFileReplicated& r);
  // The end magic and the CRC-32 of every byte written before it.
  void Trailer();

  // CRC-32 of every byte so far; after Trailer, the whole file's (v1::CheckpointSaved.crc32).
  uint32_t crc32() const { return crc_; }
  int64_t bytes() const { return bytes_; }

 private:
  void Put(const void* p, size_t n);
  template <typename T>
  void Pod(T v) { Put(&v, sizeof(v)); }
  void Str(const std::string& s);

  Sink sink_;
  uint32_t crc_ = 0;
  int64_t bytes_ = 0;
};

// Reads one rank file: Verify checks it as a whole; the Read* calls then decode it from its
// first byte, in the order of the layout above, within the body (the bytes before the trailer).
// A failed Read* leaves the reader unusable (every later call fails too).
class RankFileReader {
 public:
  // NOT_FOUND "<path> is missing" when there is no such file; other open failures by errno.
  static absl::StatusOr<RankFileReader> Open(const std::string& path);

  RankFileReader(RankFileReader&&) = default;
  RankFileReader& operator=(RankFileReader&&) = default;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }

  // Reads the whole file once and checks, in this order: the size against `recorded->bytes`
  // (when given: the MANIFEST's entry), size >= kRankFileMinBytes, the whole file's CRC-32
  // against `recorded->crc32`, the end magic, and the trailer's CRC-32 of the body. DATA_LOSS
  // naming the path and both values otherwise. Then rewinds for the Read* calls.
  absl::Status Verify(const v1::CheckpointFile* recorded = nullptr);

  // DATA_LOSS for a bad magic or a truncated header; FAILED_PRECONDITION for another version.
  absl::Status ReadHeader(RankFileHeader* h);
  // DATA_LOSS also for a moment dtype other than 0 and 1.
  absl::Status ReadBufferHeader(RankFileBufferHeader* b);
  // Reads one shard array of shard_numel elements stored as `dtype`: elements [lo, lo + n) into
  // dst[0, n) as f32 (bf16 widened exactly), skipping the others (n = 0 skips the whole array;
  // dst may then be null). Requires 0 <= lo, 0 <= n, lo + n <= shard_numel.
  absl::Status ReadShardArray(int64_t shard_numel, int64_t lo, int64_t n, float* dst,
                              RankFileArrayDtype dtype = RankFileArrayDtype::kF32);
  // The replicated section; also requires the body to end right after it.
  absl::Status ReadReplicated(RankFileReplicated* r);

 private:
  struct FileCloser {
    void operator()(FILE* f) const;
  };
  RankFileReader(std::unique_ptr<FILE, FileCloser> f, std::string path, int64_t size);

  bool Bytes(void* p, size_t n);
  template <typename T>
  bool Pod(T* v) { return Bytes(v, sizeof(T)); }
  bool Str(std::string* s);
  bool Skip(int64_t n);
  absl::Status ReadScalingState(ScalingState* s);
  absl::Status Malformed(const std::string& what) const;

  std::unique_ptr<FILE, FileCloser> f_;
  std::string path_;
  int64_t size_ = 0;
  int64_t body_ = 0;  // readable bytes: size_ less the trailer
  int64_t pos_ = 0;
  bool ok_ = true;
};

// ---- MANIFEST ----
inline constexpr int kManifestFormatVersion = 1;

// The structural rules above (all but the step directory's name). DATA_LOSS
// "<where>: invalid MANIFEST: <why>", FAILED_PRECONDITION for a format_version other than 1.
absl::Status CheckManifest(const v1::CheckpointManifest& m, const std::string& where);
// The MANIFEST text of `m` (not checked: call CheckManifest first). INTERNAL if protobuf's JSON
// printer fails.
absl::StatusOr<std::string> EncodeManifest(const v1::CheckpointManifest& m);
// Parses and checks MANIFEST text. DATA_LOSS "<where>: invalid MANIFEST: ..." for text that is
// not a CheckpointManifest's JSON; CheckManifest's errors otherwise.
absl::StatusOr<v1::CheckpointManifest> DecodeManifest(const std::string& text,
                                                      const std::string& where);
// Reads and decodes <step_dir>/MANIFEST; when step_dir is named step-<k>, also requires step k.
// NOT_FOUND "checkpoint <step_dir>: no such directory" / "... no MANIFEST (not a committed
// checkpoint)"; otherwise DecodeManifest's errors with where = "checkpoint <step_dir>".
absl::StatusOr<v1::CheckpointManifest> ReadManifestFile(const std::string& step_dir);

// ---- OWNER, format_version 1 ----------------------------------------------------------------
// The protobuf JSON (field names as in checkpoint.proto, indented) of a v1::CheckpointDirOwner;
// unknown fields are ignored on decode. Valid when format_version is 1 and owner.job_id is set.
inline constexpr char kOwnerFileName[] = "OWNER";
inline constexpr char kOwnerLockFileName[] = "OWNER.lock";
inline constexpr char kStepJobFileName[] = "JOB";
inline constexpr int kOwnerFormatVersion = 1;

// The OWNER text of `o` (format_version set to 1 when 0). INTERNAL if the JSON printer fails.
absl::StatusOr<std::string> EncodeOwner(v1::CheckpointDirOwner o);
// Parses and checks OWNER text: DATA_LOSS "<where>: invalid OWNER record: ..." (not JSON of a
// CheckpointDirOwner, no owner.job_id), FAILED_PRECONDITION for another format_version.
absl::StatusOr<v1::CheckpointDirOwner> DecodeOwner(const std::string& text,
                                                   const std::string& where);
// Reads <dir>/OWNER: nullopt when there is none; DecodeOwner's errors (where = "checkpoint.dir
// <dir>"); INTERNAL for an OWNER that exists but cannot be read.
absl::StatusOr<std::optional<v1::CheckpointDirOwner>> ReadOwnerFile(const std::string& dir);
// The job id in <step_dir>/JOB; empty when there is none (a directory prepared before JOB files
// existed) or it cannot be read.
std::string ReadStepJobFile(const std::string& step_dir);

}  // namespace fsdp8
