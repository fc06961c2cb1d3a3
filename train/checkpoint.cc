#include "train/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "kernels/fp8.h"

namespace fsdp8 {
namespace {

constexpr size_t kIoChunk = 1 << 20;
constexpr ShardArray kArrays[3] = {ShardArray::kMaster, ShardArray::kAdamM, ShardArray::kAdamV};

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT: return absl::NotFoundError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT: return absl::ResourceExhaustedError(msg);
    default: return absl::InternalError(msg);
  }
}

// Buffered writer to a file descriptor; the first error sticks and later bytes are dropped.
class Writer {
 public:
  // at_mid_write: called once, between the two halves of the first chunk written to the file.
  Writer(int fd, std::string path, std::function<void()> at_mid_write = nullptr)
      : fd_(fd), path_(std::move(path)), at_mid_write_(std::move(at_mid_write)) {
    buf_.reserve(kIoChunk);
  }
  void Bytes(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0 && status_.ok()) {
      const size_t k = std::min(n, kIoChunk - buf_.size());
      buf_.insert(buf_.end(), c, c + k);
      c += k;
      n -= k;
      if (buf_.size() == kIoChunk) Flush();
    }
  }
  void Flush() {
    size_t off = 0;
    while (off < buf_.size() && status_.ok()) {
      size_t n = buf_.size() - off;
      if (at_mid_write_ && off == 0 && n > 1) n /= 2;
      const ssize_t w = ::write(fd_, buf_.data() + off, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        status_ = ErrnoStatus(errno, absl::StrCat("writing ", path_));
      } else {
        off += static_cast<size_t>(w);
        if (at_mid_write_ && off > 0) std::exchange(at_mid_write_, nullptr)();
      }
    }
    buf_.clear();
  }
  const absl::Status& status() const { return status_; }

 private:
  int fd_;
  std::string path_;
  std::function<void()> at_mid_write_;
  std::vector<char> buf_;
  absl::Status status_;
};

absl::Status FsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path, " to fsync"));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, absl::StrCat("fsync of ", path));
  return absl::OkStatus();
}

std::string Parent(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// mkdir -p; fsyncs the parent of every directory it creates.
absl::Status MakeDirs(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(dir, ": exists and is not a directory"));
  }
  const std::string parent = Parent(dir);
  if (parent != dir) {
    if (absl::Status s = MakeDirs(parent); !s.ok()) return s;
  }
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("creating directory ", dir));
  }
  return FsyncPath(parent, true);
}

// ---- ReplicatedState <-> the rank file's replicated section ----

RankFileReplicated ToRankFile(const ReplicatedState& state) {
  RankFileReplicated r;
  for (const WeightScaling& w : state.weight_scaling) {
    r.weight_scales.push_back({w.name, w.scale, w.scale_inv, w.amax});
  }
  r.act_scaling = state.act_scaling;
  r.adamw_step = state.adamw_step;
  return r;
}

ReplicatedState FromRankFile(int64_t step, RankFileReplicated r) {
  ReplicatedState st;
  st.step = step;
  st.adamw_step = r.adamw_step;
  for (RankFileWeightScale& w : r.weight_scales) {
    WeightScaling ws;
    ws.name = std::move(w.name);
    ws.scale = w.scale;
    ws.scale_inv = w.scale_inv;
    ws.amax = w.amax;
    st.weight_scaling.push_back(std::move(ws));
  }
  st.act_scaling = std::move(r.act_scaling);
  return st;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

bool SameScalingState(const ScalingState& x, const ScalingState& y) {
  bool same = x.name == y.name && x.e5m2 == y.e5m2 && x.initialised == y.initialised &&
              SameBits(x.scale, y.scale) && SameBits(x.scale_inv, y.scale_inv) &&
              x.history.size() == y.history.size();
  for (size_t h = 0; same && h < x.history.size(); ++h) same = SameBits(x.history[h], y.history[h]);
  return same;
}

// Empty when a and b agree bit for bit, else what differs.
std::string CompareReplicated(const ReplicatedState& a, const ReplicatedState& b) {
  if (a.step != b.step) return absl::StrCat("step ", b.step, " vs ", a.step);
  if (a.adamw_step != b.adamw_step) return "AdamW step counter";
  if (a.weight_scaling.size() != b.weight_scaling.size()) return "number of FP8 weight scales";
  for (size_t i = 0; i < a.weight_scaling.size(); ++i) {
    const WeightScaling& x = a.weight_scaling[i];
    const WeightScaling& y = b.weight_scaling[i];
    if (x.name != y.name || !SameBits(x.scale, y.scale) || !SameBits(x.scale_inv, y.scale_inv) ||
        !SameBits(x.amax, y.amax)) {
      return absl::StrCat("FP8 weight scale of ", x.name);
    }
  }
  if (a.act_scaling.size() != b.act_scaling.size()) return "number of activation scaling states";
  for (size_t i = 0; i < a.act_scaling.size(); ++i) {
    if (!SameScalingState(a.act_scaling[i], b.act_scaling[i])) {
      return absl::StrCat("scaling state of ", a.act_scaling[i].name);
    }
  }
  return "";
}

// ---- Writing ----

// Encodes the whole rank file into `enc`; stops early once `w` failed.
void EncodeShardFile(FsdpParams& params, const RankFileHeader& header,
                     const ReplicatedState& state, const Writer& w, RankFileEncoder* enc) {
  const ShardPlan& plan = params.plan();
  enc->Header(header);
  // The moments keep the job's optimizer.state_precision in the file.
  const RankFileArrayDtype moments = params.moment_dtype() == MomentDtype::kBf16
                                         ? RankFileArrayDtype::kBf16
                                         : RankFileArrayDtype::kF32;
  std::vector<float> host;
  std::vector<uint16_t> bits;
  for (size_t u = 0; u < plan.units.size() && w.status().ok(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size() && w.status().ok(); ++b) {
      const BufferPlan& bp = plan.units[u].buffers[b];
      const int64_t n = params.OptimizerNumel(static_cast<int>(u), static_cast<int>(b));
      enc->BufferHeader({static_cast<uint32_t>(u), static_cast<uint32_t>(b),
                         static_cast<uint32_t>(bp.wire), bp.numel, bp.padded_numel, n, moments});
      host.resize(n);
      for (ShardArray a : kArrays) {
        params.DownloadShard(static_cast<int>(u), static_cast<int>(b), a, host.data());
        if (a == ShardArray::kMaster || moments == RankFileArrayDtype::kF32) {
          enc->ShardArray(host.data(), n);
          continue;
        }
        bits.resize(n);  // bf16 values widened by DownloadShard: exact both ways
        for (int64_t i = 0; i < n; ++i) bits[i] = Bf16Bits(host[i]);
        enc->ShardArrayBf16(bits.data(), n);
      }
    }
  }
  enc->Replicated(ToRankFile(state));
  enc->Trailer();
}

// Flushes, fsyncs and closes fd (the file tmp), renames tmp to path and fsyncs dir. On error
// tmp is removed.
// `crash`: the crash points (common/fault_injection.h) of this write.
absl::Status CommitFile(Writer* w, int fd, const std::string& tmp, const std::string& path,
                        const std::string& dir, const std::function<void(const char*)>& crash) {
  w->Flush();
  absl::Status s = w->status();
  if (s.ok()) crash("shard.before_fsync");
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoStatus(errno, absl::StrCat("fsync of ", tmp));
  if (::close(fd) != 0 && s.ok()) s = ErrnoStatus(errno, absl::StrCat("closing ", tmp));
  if (s.ok()) crash("shard.before_rename");
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("renaming ", tmp, " to ", path));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  crash("shard.after_rename");
  return FsyncPath(dir, true);
}

// ---- Reading ----

// A flat buffer of the loading job's plan.
struct BufInfo {
  int unit;
  int buffer;
  const BufferPlan* plan;
};

std::vector<BufInfo> PlanBuffers(const ShardPlan& plan) {
  std::vector<BufInfo> bufs;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
      bufs.push_back({static_cast<int>(u), static_cast<int>(b), &plan.units[u].buffers[b]});
    }
  }
  return bufs;
}

// One tensor of a saved buffer and where it lives in this job's plan (a load across layouts).
struct Remap {
  int64_t src_off = 0, numel = 0;  // in the saved flat buffer
  int unit = 0, buffer = 0;        // this job's
  int64_t dst_off = 0;             // in this job's flat buffer
};

// What every rank file of one checkpoint is checked against while loading into this rank.
struct LoadTarget {
  std::string dir;
  int saved_world_size;
  std::string description;  // this job's, for errors
  uint64_t fingerprint;     // of the saved files' plan: this job's, or `saved`'s
  std::vector<BufInfo> bufs;
  FsdpParams* params;
  // A load across layouts (a tensorwise checkpoint into a job with rowwise / blockwise blocks):
  // the saved plan's buffers, each with its tensors' places in this job's plan. Empty: the
  // files have this job's layout.
  std::vector<BufInfo> saved_bufs;
  std::vector<std::vector<Remap>> remaps;  // per saved buffer
};

absl::StatusOr<RankFileReader> OpenRankFile(const LoadTarget& t, int rank) {
  absl::StatusOr<RankFileReader> r =
      RankFileReader::Open(absl::StrCat(t.dir, "/", CheckpointFileName(rank)));
  if (absl::IsNotFound(r.status())) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", t.dir, ": ", CheckpointFileName(rank),
                                            " is missing (the checkpoint was written by ",
                                            t.saved_world_size, " ranks)"));
  }
  return r;
}

// Pass 1: every file exists and its checksum verifies.
absl::Status VerifyRankFiles(const LoadTarget& t) {
  for (int i = 0; i < t.saved_world_size; ++i) {
    absl::StatusOr<RankFileReader> r = OpenRankFile(t, i);
    if (!r.ok()) return r.status();
    if (absl::Status s = r->Verify(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckRankHeader(const LoadTarget& t, const std::string& path, int rank,
                             const RankFileHeader& h) {
  if (h.rank != rank || h.world_size != t.saved_world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": written by rank ", h.rank, " of ", h.world_size, ", expected rank ", rank,
        " of ", t.saved_world_size));
  }
  const size_t nb = t.saved_bufs.empty() ? t.bufs.size() : t.saved_bufs.size();
  if (h.layout_fingerprint != t.fingerprint || h.num_buffers != nb) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": saved for a different model or precision plan (checkpoint: ", h.description,
        "; this job: ", t.description, ")"));
  }
  return absl::OkStatus();
}

// Reads one buffer of saved rank `rank`'s file: of its shard, the elements this rank's shard
// overlaps (and that are not padding) go into params; the rest is skipped.
absl::Status ReadBufferSlice(const LoadTarget& t, int rank, const BufInfo& bi,
                             RankFileReader* r, std::vector<float>* chunk) {
  RankFileBufferHeader h;
  if (absl::Status s = r->ReadBufferHeader(&h); !s.ok()) return s;
  const BufferPlan& bp = *bi.plan;
  const int64_t shard = h.shard_numel;
  if (static_cast<int>(h.unit) != bi.unit || static_cast<int>(h.buffer) != bi.buffer ||
      h.wire != static_cast<uint32_t>(bp.wire) || h.numel != bp.numel || shard < 0 ||
      h.padded_numel != shard * t.saved_world_size || h.padded_numel < h.numel) {
    return absl::DataLossError(absl::StrCat(
        r->path(), ": buffer ", t.params->plan().units[bi.unit].name, "/", WireDtypeName(bp.wire),
        " layout does not match (numel ", h.numel, ", padded ", h.padded_numel, ", shard ", shard,
        "; expected numel ", bp.numel, ")"));
  }
  // Saved rank i holds flat elements [i * shard, (i + 1) * shard); this rank needs its optimizer
  // piece [index * piece, ...) and only the unpadded ones (< numel).
  const int64_t src_lo = static_cast<int64_t>(rank) * shard;
  const int64_t mine = t.params->OptimizerNumel(bi.unit, bi.buffer);  // this rank's piece
  const int64_t dst_lo = t.params->OptimizerBegin(bi.unit, bi.buffer);
  const int64_t lo = std::max(src_lo, dst_lo);
  const int64_t hi = std::min({src_lo + shard, dst_lo + mine, h.numel});
  const int64_t n = std::max<int64_t>(0, hi - lo);
  chunk->resize(n);
  // The moments are read in the file's dtype and stored in the job's (UploadShardRange rounds
  // f32 moments to bf16 for a BF16 job; bf16 ones widen exactly for an FP32 job).
  for (ShardArray a : kArrays) {
    const RankFileArrayDtype dtype = a == ShardArray::kMaster ? RankFileArrayDtype::kF32 : h.moments;
    if (absl::Status s = r->ReadShardArray(shard, n ? lo - src_lo : 0, n, chunk->data(), dtype);
        !s.ok()) {
      return s;
    }
    if (n) t.params->UploadShardRange(bi.unit, bi.buffer, a, lo - dst_lo, chunk->data(), n);
  }
  return absl::OkStatus();
}

// ReadBufferSlice across layouts: saved buffer `bi` (of the saved plan) holds tensors that this
// job keeps elsewhere (t.remaps); of the saved shard, each tensor's elements that this rank's
// pieces need go to their place in this job's buffers.
absl::Status ReadBufferRemapped(const LoadTarget& t, int rank, size_t index, RankFileReader* r,
                                std::vector<float>* chunk) {
  const BufInfo& bi = t.saved_bufs[index];
  RankFileBufferHeader h;
  if (absl::Status s = r->ReadBufferHeader(&h); !s.ok()) return s;
  const BufferPlan& bp = *bi.plan;
  const int64_t shard = h.shard_numel;
  if (static_cast<int>(h.unit) != bi.unit || static_cast<int>(h.buffer) != bi.buffer ||
      h.wire != static_cast<uint32_t>(bp.wire) || h.numel != bp.numel || shard < 0 ||
      h.padded_numel != shard * t.saved_world_size || h.padded_numel < h.numel) {
    return absl::DataLossError(absl::StrCat(r->path(), ": buffer ", bi.unit, "/",
                                            WireDtypeName(bp.wire), " layout does not match"));
  }
  const int64_t src_lo = static_cast<int64_t>(rank) * shard;
  const int64_t src_hi = std::min(src_lo + shard, h.numel);
  // Of tensor m, the saved flat elements [lo, hi) this rank's piece of its buffer needs.
  auto span = [&](const Remap& m, int64_t* lo, int64_t* hi) {
    const int64_t dst_lo = t.params->OptimizerBegin(m.unit, m.buffer);
    const int64_t mine = t.params->OptimizerNumel(m.unit, m.buffer);
    *lo = std::max({src_lo, m.src_off, m.src_off + dst_lo - m.dst_off});
    *hi = std::min({src_hi, m.src_off + m.numel, m.src_off + dst_lo + mine - m.dst_off});
  };
  int64_t lo_all = src_hi, hi_all = src_lo;
  for (const Remap& m : t.remaps[index]) {
    int64_t lo, hi;
    span(m, &lo, &hi);
    if (hi > lo) {
      lo_all = std::min(lo_all, lo);
      hi_all = std::max(hi_all, hi);
    }
  }
  const int64_t n = std::max<int64_t>(0, hi_all - lo_all);
  chunk->resize(n);
  for (ShardArray a : kArrays) {
    const RankFileArrayDtype dtype = a == ShardArray::kMaster ? RankFileArrayDtype::kF32 : h.moments;
    if (absl::Status s = r->ReadShardArray(shard, n ? lo_all - src_lo : 0, n, chunk->data(), dtype);
        !s.ok()) {
      return s;
    }
    for (const Remap& m : t.remaps[index]) {
      int64_t lo, hi;
      span(m, &lo, &hi);
      if (hi <= lo) continue;
      t.params->UploadShardRange(m.unit, m.buffer, a,
                                 m.dst_off + (lo - m.src_off) -
                                     t.params->OptimizerBegin(m.unit, m.buffer),
                                 chunk->data() + (lo - lo_all), hi - lo);
    }
  }
  return absl::OkStatus();
}

// Pass 2 for saved rank `rank`: header, this rank's slices, the replicated state.
absl::Status ReadRankFile(const LoadTarget& t, int rank, ReplicatedState* state) {
  absl::StatusOr<RankFileReader> r = OpenRankFile(t, rank);
  if (!r.ok()) return r.status();
  RankFileHeader h;
  if (absl::Status s = r->ReadHeader(&h); !s.ok()) return s;
  if (absl::Status s = CheckRankHeader(t, r->path(), rank, h); !s.ok()) return s;
  std::vector<float> chunk;
  if (!t.saved_bufs.empty()) {
    for (size_t i = 0; i < t.saved_bufs.size(); ++i) {
      if (absl::Status s = ReadBufferRemapped(t, rank, i, &*r, &chunk); !s.ok()) return s;
    }
  } else {
    for (const BufInfo& bi : t.bufs) {
      if (absl::Status s = ReadBufferSlice(t, rank, bi, &*r, &chunk); !s.ok()) return s;
    }
  }
  RankFileReplicated rep;
  if (absl::Status s = r->ReadReplicated(&rep); !s.ok()) return s;
  *state = FromRankFile(h.step, std::move(rep));
  return absl::OkStatus();
}

}  // namespace

CheckpointRole CheckpointRoleOf(const Mesh& mesh, int rank) {
  CheckpointRole r;
  const int file = mesh.CheckpointFile(rank);  // the one rule (common/mesh.h)
  r.writes = file >= 0;
  r.file_index = mesh.OptimizerIndex(rank);  // = file where the rank writes
  r.files = mesh.OptimizerShards();
  return r;
}

namespace {

// ", granularity [TENSORWISE,BLOCKWISE,...]" when a block's FP8 linears scale rowwise or
// blockwise (their units lay out apart from tensorwise ones, so such files load only into jobs
// with rowwise / blockwise blocks: ReadShardFiles);
// empty otherwise, so tensorwise descriptions are those of every earlier file.
std::string Granularities(const v1::JobSpec& spec) {
  if (!AnyScaledGranularity(spec)) return "";
  std::string g;
  for (int l = 0; l < spec.model().n_layers(); ++l) {
    absl::StrAppend(&g, l ? "," : "", GranularityName(LayerGranularity(spec, l)));
  }
  return absl::StrCat(", granularity [", g, "]");
}

}  // namespace

std::string SpecDescription(const v1::JobSpec& spec) {
  const v1::ModelConfig& m = spec.model();
  const v1::PrecisionSpec& p = spec.precision();
  std::string linears;
  for (int l = 0; l < m.n_layers(); ++l) {
    absl::StrAppend(&linears, l ? "," : "", v1::Precision_Name(LayerLinearPrecision(spec, l)));
  }
  return absl::StrCat("d_model ", m.d_model(), ", n_layers ", m.n_layers(), ", n_heads ",
                      m.n_heads(), ", n_kv_heads ", m.n_kv_heads(), ", ffn_dim ", m.ffn_dim(),
                      ", vocab_size ", m.vocab_size(), "; embedding ",
                      v1::Precision_Name(p.embedding()), ", lm_head ",
                      v1::Precision_Name(p.lm_head()), ", linears [", linears, "], fp8 format ",
                      v1::Fp8Format_Name(p.fp8().format()), Granularities(spec));
}

absl::Status WriteShardFile(FsdpParams& params, int rank, int world_size,
                            const std::string& description, const ReplicatedState& state,
                            const std::string& dir, v1::CheckpointSaved* out,
                            const FaultInjection* faults) {
  const ShardPlan& plan = params.plan();
  if (params.OptimizerShards() != world_size || params.OptimizerIndex() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: file ", rank, " of ", world_size, " from the optimizer piece ",
        params.OptimizerIndex(), " of ", params.OptimizerShards()));
  }
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  const std::string name = CheckpointFileName(rank);
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", tmp));
  const std::function<void(const char*)> crash = [faults, &path](const char* point) {
    if (faults != nullptr) faults->CrashPoint(point, path);
  };
  crash("shard.before_write");
  Writer w(fd, tmp, [&crash] { crash("shard.mid_write"); });
  RankFileEncoder enc([&w](const void* p, size_t n) { w.Bytes(p, n); });
  RankFileHeader header;
  header.rank = rank;
  header.world_size = world_size;
  header.step = state.step;
  header.layout_fingerprint = LayoutFingerprint(plan);
  header.description = description;
  for (const UnitPlan& u : plan.units) header.num_buffers += static_cast<uint32_t>(u.buffers.size());
  EncodeShardFile(params, header, state, w, &enc);
  if (absl::Status s = CommitFile(&w, fd, tmp, path, dir, crash); !s.ok()) return s;
  out->set_step(state.step);
  out->set_rank(rank);
  out->set_file(name);
  out->set_bytes(enc.bytes());
  out->set_crc32(enc.crc32());
  return absl::OkStatus();
}

namespace {

// The specs whose layouts a job with rowwise / blockwise blocks loads across (the same model with
// other granularities): every block tensorwise, every block rowwise, every block blockwise, and
// the job's own plan with rowwise and blockwise swapped (per layer too). Rowwise blocks lay out in
// BF16 buffers, blockwise ones in blockwise FP8 wire buffers, tensorwise ones in FP8 buffers.
std::vector<v1::JobSpec> CrossLayoutSpecs(const v1::JobSpec& job) {
  std::vector<v1::JobSpec> out;
  for (v1::Fp8Granularity g : {v1::FP8_GRANULARITY_TENSORWISE, v1::FP8_GRANULARITY_ROWWISE,
                               v1::FP8_GRANULARITY_BLOCKWISE}) {
    v1::JobSpec s = job;
    s.mutable_precision()->mutable_fp8()->set_granularity(g);
    for (v1::LayerPrecision& lp : *s.mutable_precision()->mutable_overrides()) {
      lp.clear_granularity();
    }
    out.push_back(std::move(s));
  }
  auto swap = [](v1::Fp8Granularity g) {
    return g == v1::FP8_GRANULARITY_ROWWISE    ? v1::FP8_GRANULARITY_BLOCKWISE
           : g == v1::FP8_GRANULARITY_BLOCKWISE ? v1::FP8_GRANULARITY_ROWWISE
                                                : g;
  };
  v1::JobSpec s = job;
  v1::Fp8Recipe* r = s.mutable_precision()->mutable_fp8();
  r->set_granularity(swap(r->granularity()));
  for (v1::LayerPrecision& lp : *s.mutable_precision()->mutable_overrides()) {
    lp.set_granularity(swap(lp.granularity()));
  }
  out.push_back(std::move(s));
  return out;
}

// When rank file 0 of t.dir was written under the plan of one of CrossLayoutSpecs(job) (its
// layout fingerprint says so) and not under the job's own, sets t up to load it across layouts
// (LoadTarget::saved_bufs, remaps: tensors by name; *saved holds that plan); otherwise leaves t
// as it is.
absl::Status PrepareCrossLayoutLoad(const v1::JobSpec& job, std::optional<ShardPlan>* saved,
                                    LoadTarget* t) {
  absl::StatusOr<RankFileReader> r = OpenRankFile(*t, 0);
  if (!r.ok()) return r.status();
  RankFileHeader h;
  if (absl::Status s = r->ReadHeader(&h); !s.ok()) return s;
  if (h.layout_fingerprint == t->fingerprint) return absl::OkStatus();  // the job's own layout
  std::optional<ShardPlan> plan;
  for (const v1::JobSpec& other : CrossLayoutSpecs(job)) {
    absl::StatusOr<ShardPlan> p = MakeShardPlan(other, t->saved_world_size);
    if (!p.ok()) return p.status();
    if (h.layout_fingerprint == LayoutFingerprint(*p)) {
      plan = std::move(*p);
      break;
    }
  }
  if (!plan.has_value()) return absl::OkStatus();
  *saved = std::move(*plan);
  t->fingerprint = h.layout_fingerprint;
  t->saved_bufs = PlanBuffers(**saved);
  for (const BufInfo& bi : t->saved_bufs) {
    std::vector<Remap>& rm = t->remaps.emplace_back();
    for (size_t i = 0; i < bi.plan->tensors.size(); ++i) {
      const TensorRef ref = t->params->Ref(bi.plan->tensors[i].name);
      rm.push_back({bi.plan->offsets[i], bi.plan->tensors[i].numel, ref.unit, ref.buffer,
                    ref.offset});
    }
  }
  return absl::OkStatus();
}

// The entries of `saved` named as those of `job`, in job's order; FAILED_PRECONDITION naming
// the first one missing. For a load across layouts (the checkpoint's tensorwise blocks hold
// scaling state that rowwise / blockwise blocks have none of); the identity otherwise.
template <typename T>
absl::Status SelectByName(const std::vector<T>& job, std::vector<T>* saved,
                          const std::string& file, const char* what) {
  if (job.size() == saved->size()) return absl::OkStatus();
  std::vector<T> out;
  for (const T& j : job) {
    auto it = std::find_if(saved->begin(), saved->end(),
                           [&](const T& s) { return s.name == j.name; });
    if (it == saved->end()) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": no ", what, " ", j.name, " in the checkpoint"));
    }
    out.push_back(*it);
  }
  *saved = std::move(out);
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadShardFiles(const std::string& dir, int saved_world_size,
                            const std::string& description, FsdpParams* params,
                            ReplicatedState* state, const v1::JobSpec* job_spec) {
  if (saved_world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, ": saved world size ", saved_world_size));
  }
  LoadTarget t{dir, saved_world_size, description, LayoutFingerprint(params->plan()),
               PlanBuffers(params->plan()), params, {}, {}};
  // Files of the job's plan with every block tensorwise, into a job with rowwise / blockwise
  // blocks: map their tensors by name.
  std::optional<ShardPlan> tensorwise;
  if (job_spec != nullptr && AnyScaledGranularity(*job_spec)) {
    if (absl::Status s = PrepareCrossLayoutLoad(*job_spec, &tensorwise, &t); !s.ok()) return s;
  }
  // Pass 1 leaves params untouched on failure.
  if (absl::Status s = VerifyRankFiles(t); !s.ok()) return s;
  for (const BufInfo& bi : t.bufs) {
    for (ShardArray a : kArrays) params->ZeroShard(bi.unit, bi.buffer, a);
  }
  for (int i = 0; i < saved_world_size; ++i) {
    ReplicatedState st;
    if (absl::Status s = ReadRankFile(t, i, &st); !s.ok()) return s;
    if (i == 0) {
      *state = std::move(st);
    } else if (std::string d = CompareReplicated(*state, st); !d.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, "/", CheckpointFileName(i), ": replicated state differs from ",
          CheckpointFileName(0), " (", d, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status SaveShard(Trainer& trainer, int64_t step, const std::string& dir,
                       v1::CheckpointSaved* out, const FaultInjection* faults) {
  if (step != trainer.CompletedSteps()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, "/", CheckpointFileName(trainer.rank()), ": asked to save the state "
        "after step ", step, ", but this rank has completed ", trainer.CompletedSteps(), " steps"));
  }
  // Every rank (a writer or not): the updates a step deferred are collective.
  if (absl::Status s = trainer.ApplyPendingUpdates(); !s.ok()) return s;
  const CheckpointRole role = CheckpointRoleOf(trainer.mesh(), trainer.rank());
  if (!role.writes) {  // another replica writes this shard index's file
    out->set_step(step);
    out->set_rank(trainer.rank());
    out->clear_file();
    return absl::OkStatus();
  }
  ReplicatedState st;
  st.step = step;
  st.adamw_step = step + trainer.adamw_offset();
  st.weight_scaling = trainer.params().weight_scaling();
  st.act_scaling = trainer.scaling().states();
  absl::Status s = WriteShardFile(trainer.params(), role.file_index, role.files,
                                  SpecDescription(trainer.spec()), st, dir, out, faults);
  if (s.ok()) out->set_rank(trainer.rank());
  return s;
}

absl::Status LoadShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                        int64_t start_step) {
  ReplicatedState st;
  if (absl::Status s = ReadShardFiles(dir, saved_world_size, SpecDescription(trainer->spec()),
                                      &trainer->params(), &st, &trainer->spec());
      !s.ok()) {
    return s;
  }
  const std::string file0 = absl::StrCat(dir, "/", CheckpointFileName(0));
  if (AnyScaledGranularity(trainer->spec())) {  // a tensorwise checkpoint has more state
    if (absl::Status s = SelectByName(trainer->params().weight_scaling(), &st.weight_scaling,
                                      file0, "FP8 weight scale");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = SelectByName(trainer->scaling().states(), &st.act_scaling, file0,
                                      "activation scaling tensor");
        !s.ok()) {
      return s;
    }
  }
  if (st.step != start_step) {
    return absl::FailedPreconditionError(absl::StrCat(file0, ": holds the state after step ",
                                                      st.step, ", the job starts at step ",
                                                      start_step));
  }
  if (st.adamw_step < st.step) {
    return absl::DataLossError(absl::StrCat(file0, ": AdamW step counter ", st.adamw_step,
                                            " < step ", st.step));
  }
  if (st.weight_scaling.size() != trainer->params().weight_scaling().size()) {
    return absl::FailedPreconditionError(absl::StrCat(file0, ": ", st.weight_scaling.size(),
                                                      " FP8 weight scales, this model has ",
                                                      trainer->params().weight_scaling().size()));
  }
  for (size_t i = 0; i < st.weight_scaling.size(); ++i) {
    if (st.weight_scaling[i].name != trainer->params().weight_scaling()[i].name) {
      return absl::FailedPreconditionError(absl::StrCat(file0, ": FP8 weight ", i, " is ",
                                                        st.weight_scaling[i].name, ", expected ",
                                                        trainer->params().weight_scaling()[i].name));
    }
  }
  if (absl::Status s = trainer->scaling().Restore(st.act_scaling); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(file0, ": ", s.message()));
  }
  trainer->params().RestoreWeightScaling(st.weight_scaling);
  // C08: the next step's FP8 weights come from the loaded masters, amax recomputed from them.
  if (absl::Status s = trainer->RecastWeights(); !s.ok()) return s;
  trainer->MarkResumed(start_step);
  trainer->SetAdamWOffset(st.adamw_step - st.step);
  return absl::OkStatus();
}

absl::Status LoadInitialShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                               bool optimizer_state, bool fp8_state) {
  ReplicatedState st;
  if (absl::Status s = ReadShardFiles(dir, saved_world_size, SpecDescription(trainer->spec()),
                                      &trainer->params(), &st, &trainer->spec());
      !s.ok()) {
    return s;
  }
  FsdpParams& params = trainer->params();
  if (fp8_state && AnyScaledGranularity(trainer->spec())) {
    const std::string file0 = absl::StrCat(dir, "/", CheckpointFileName(0));
    if (absl::Status s = SelectByName(params.weight_scaling(), &st.weight_scaling, file0,
                                      "FP8 weight scale");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = SelectByName(trainer->scaling().states(), &st.act_scaling, file0,
                                      "activation scaling tensor");
        !s.ok()) {
      return s;
    }
  }
  if (optimizer_state) {
    trainer->SetAdamWOffset(st.adamw_step);
  } else {
    for (size_t u = 0; u < params.plan().units.size(); ++u) {
      for (size_t b = 0; b < params.plan().units[u].buffers.size(); ++b) {
        params.ZeroShard(static_cast<int>(u), static_cast<int>(b), ShardArray::kAdamM);
        params.ZeroShard(static_cast<int>(u), static_cast<int>(b), ShardArray::kAdamV);
      }
    }
  }
  if (fp8_state) {
    const std::string file0 = absl::StrCat(dir, "/", CheckpointFileName(0));
    if (st.weight_scaling.size() != params.weight_scaling().size()) {
      return absl::FailedPreconditionError(absl::StrCat(file0, ": ", st.weight_scaling.size(),
                                                        " FP8 weight scales, this model has ",
                                                        params.weight_scaling().size()));
    }
    if (absl::Status s = trainer->scaling().Restore(st.act_scaling); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(file0, ": ", s.message()));
    }
    params.RestoreWeightScaling(st.weight_scaling);
  }
  return trainer->RecastWeights();
}

}  // namespace fsdp8
