#include "train/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/spec.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checkpoint I/O assumes little-endian");

namespace fsdp8 {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', '8', 'C', 'K', 'P'};
constexpr char kEndMagic[8] = {'F', 'S', 'D', 'P', '8', 'E', 'N', 'D'};
constexpr size_t kTrailerBytes = 12;
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

uint32_t Crc(uint32_t crc, const void* p, size_t n) {
  const Bytef* b = static_cast<const Bytef*>(p);
  while (n > 0) {
    const uInt k = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, b, k));
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

// Buffered writer to a file descriptor with a running CRC; the first error sticks.
class Writer {
 public:
  Writer(int fd, std::string path) : fd_(fd), path_(std::move(path)) { buf_.reserve(kIoChunk); }
  void Bytes(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    crc_ = Crc(crc_, p, n);
    bytes_ += n;
    while (n > 0 && status_.ok()) {
      const size_t k = std::min(n, kIoChunk - buf_.size());
      buf_.insert(buf_.end(), c, c + k);
      c += k;
      n -= k;
      if (buf_.size() == kIoChunk) Flush();
    }
  }
  template <typename T>
  void Pod(T v) { Bytes(&v, sizeof(v)); }
  void Str(const std::string& s) {
    Pod<uint32_t>(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  void Flush() {
    size_t off = 0;
    while (off < buf_.size() && status_.ok()) {
      const ssize_t w = ::write(fd_, buf_.data() + off, buf_.size() - off);
      if (w < 0) {
        if (errno == EINTR) continue;
        status_ = ErrnoStatus(errno, absl::StrCat("writing ", path_));
      } else {
        off += static_cast<size_t>(w);
      }
    }
    buf_.clear();
  }
  uint32_t crc() const { return crc_; }
  int64_t bytes() const { return bytes_; }
  const absl::Status& status() const { return status_; }

 private:
  int fd_;
  std::string path_;
  std::vector<char> buf_;
  uint32_t crc_ = 0;
  int64_t bytes_ = 0;
  absl::Status status_;
};

// Sequential reader of a FILE* with bounds on the readable (pre-trailer) region.
class Reader {
 public:
  Reader(FILE* f, std::string name, int64_t limit) : f_(f), name_(std::move(name)), limit_(limit) {}
  bool Bytes(void* p, size_t n) {
    if (!ok_) return false;
    if (pos_ + static_cast<int64_t>(n) > limit_ || std::fread(p, 1, n, f_) != n) {
      ok_ = false;
      return false;
    }
    pos_ += static_cast<int64_t>(n);
    return true;
  }
  template <typename T>
  bool Pod(T* v) { return Bytes(v, sizeof(T)); }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!Pod(&n) || n > (1u << 20)) return ok_ = false;
    s->resize(n);
    return Bytes(s->data(), n);
  }
  bool Skip(int64_t n) {
    if (!ok_) return false;
    if (n < 0 || pos_ + n > limit_ || fseeko(f_, static_cast<off_t>(n), SEEK_CUR) != 0) {
      return ok_ = false;
    }
    pos_ += n;
    return true;
  }
  bool ok() const { return ok_; }
  bool AtEnd() const { return ok_ && pos_ == limit_; }
  absl::Status Malformed(const std::string& what) const {
    return absl::DataLossError(absl::StrCat(name_, ": malformed or truncated at byte ", pos_,
                                            " (", what, ")"));
  }

 private:
  FILE* f_;
  std::string name_;
  int64_t limit_;
  int64_t pos_ = 0;
  bool ok_ = true;
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

// CRC-32 over [0, n) of a file.
absl::Status CrcOfPrefix(FILE* f, const std::string& name, int64_t n, uint32_t* crc) {
  std::vector<char> buf(kIoChunk);
  *crc = 0;
  if (fseeko(f, 0, SEEK_SET) != 0) return ErrnoStatus(errno, absl::StrCat("seeking ", name));
  int64_t left = n;
  while (left > 0) {
    const size_t k = static_cast<size_t>(std::min<int64_t>(left, kIoChunk));
    if (std::fread(buf.data(), 1, k, f) != k) {
      return absl::DataLossError(absl::StrCat(name, ": short read while checksumming"));
    }
    *crc = Crc(*crc, buf.data(), k);
    left -= static_cast<int64_t>(k);
  }
  return absl::OkStatus();
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

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
    const ScalingState& x = a.act_scaling[i];
    const ScalingState& y = b.act_scaling[i];
    bool same = x.name == y.name && x.e5m2 == y.e5m2 && x.initialised == y.initialised &&
                SameBits(x.scale, y.scale) && SameBits(x.scale_inv, y.scale_inv) &&
                x.history.size() == y.history.size();
    for (size_t h = 0; same && h < x.history.size(); ++h) same = SameBits(x.history[h], y.history[h]);
    if (!same) return absl::StrCat("scaling state of ", x.name);
  }
  return "";
}

struct FileCloser {
  void operator()(FILE* f) const { if (f) std::fclose(f); }
};

}  // namespace

std::string CheckpointFileName(int rank) { return absl::StrCat("rank-", rank, ".ckpt"); }

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
                      v1::Fp8Format_Name(p.fp8().format()));
}

absl::Status WriteShardFile(const FsdpParams& params, int rank, int world_size,
                            const std::string& description, const ReplicatedState& state,
                            const std::string& dir, v1::CheckpointSaved* out) {
  const ShardPlan& plan = params.plan();
  if (plan.world_size != world_size || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: rank ", rank, " of ", world_size,
                                                   " with a plan for ", plan.world_size));
  }
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  const std::string name = CheckpointFileName(rank);
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", tmp));
  Writer w(fd, tmp);
  w.Bytes(kMagic, sizeof(kMagic));
  w.Pod<uint32_t>(kCheckpointFormatVersion);
  w.Pod<int32_t>(rank);
  w.Pod<int32_t>(world_size);
  w.Pod<int64_t>(state.step);
  w.Pod<uint64_t>(LayoutFingerprint(plan));
  w.Str(description);
  uint32_t nbuf = 0;
  for (const UnitPlan& u : plan.units) nbuf += static_cast<uint32_t>(u.buffers.size());
  w.Pod<uint32_t>(nbuf);
  std::vector<float> host;
  for (size_t u = 0; u < plan.units.size() && w.status().ok(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size() && w.status().ok(); ++b) {
      const BufferPlan& bp = plan.units[u].buffers[b];
      w.Pod<uint32_t>(static_cast<uint32_t>(u));
      w.Pod<uint32_t>(static_cast<uint32_t>(b));
      w.Pod<uint32_t>(static_cast<uint32_t>(bp.wire));
      w.Pod<uint32_t>(0);
      w.Pod<int64_t>(bp.numel);
      w.Pod<int64_t>(bp.padded_numel);
      w.Pod<int64_t>(bp.shard_numel);
      host.resize(bp.shard_numel);
      for (ShardArray a : kArrays) {
        params.DownloadShard(static_cast<int>(u), static_cast<int>(b), a, host.data());
        w.Bytes(host.data(), host.size() * sizeof(float));
      }
    }
  }
  w.Pod<uint32_t>(static_cast<uint32_t>(state.weight_scaling.size()));
  for (const WeightScaling& s : state.weight_scaling) {
    w.Str(s.name);
    w.Pod<float>(s.scale);
    w.Pod<float>(s.scale_inv);
    w.Pod<float>(s.amax);
  }
  w.Pod<uint32_t>(static_cast<uint32_t>(state.act_scaling.size()));
  for (const ScalingState& s : state.act_scaling) {
    w.Str(s.name);
    w.Pod<uint8_t>(s.e5m2 ? 1 : 0);
    w.Pod<uint8_t>(s.initialised ? 1 : 0);
    w.Pod<uint16_t>(0);
    w.Pod<float>(s.scale);
    w.Pod<float>(s.scale_inv);
    w.Pod<uint32_t>(static_cast<uint32_t>(s.history.size()));
    for (float a : s.history) w.Pod<float>(a);
  }
  w.Pod<int64_t>(state.adamw_step);
  const uint32_t body_crc = w.crc();
  w.Bytes(kEndMagic, sizeof(kEndMagic));
  w.Pod<uint32_t>(body_crc);
  w.Flush();
  absl::Status s = w.status();
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoStatus(errno, absl::StrCat("fsync of ", tmp));
  if (::close(fd) != 0 && s.ok()) s = ErrnoStatus(errno, absl::StrCat("closing ", tmp));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("renaming ", tmp, " to ", path));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  if (absl::Status d = FsyncPath(dir, true); !d.ok()) return d;
  out->set_step(state.step);
  out->set_rank(rank);
  out->set_file(name);
  out->set_bytes(w.bytes());
  out->set_crc32(w.crc());
  return absl::OkStatus();
}

absl::Status ReadShardFiles(const std::string& dir, int saved_world_size,
                            const std::string& description, FsdpParams* params,
                            ReplicatedState* state) {
  const ShardPlan& plan = params->plan();
  if (saved_world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, ": saved world size ", saved_world_size));
  }
  const uint64_t fingerprint = LayoutFingerprint(plan);
  struct BufInfo { int unit, buffer; const BufferPlan* plan; };
  std::vector<BufInfo> bufs;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
      bufs.push_back({static_cast<int>(u), static_cast<int>(b), &plan.units[u].buffers[b]});
    }
  }
  // Pass 1: every file exists and its checksum verifies (params untouched on failure).
  for (int i = 0; i < saved_world_size; ++i) {
    const std::string path = absl::StrCat(dir, "/", CheckpointFileName(i));
    std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) {
      if (errno == ENOENT) {
        return absl::NotFoundError(absl::StrCat("checkpoint ", dir, ": ", CheckpointFileName(i),
                                                " is missing (the checkpoint was written by ",
                                                saved_world_size, " ranks)"));
      }
      return ErrnoStatus(errno, absl::StrCat("opening ", path));
    }
    if (fseeko(f.get(), 0, SEEK_END) != 0) return ErrnoStatus(errno, absl::StrCat("seeking ", path));
    const int64_t size = ftello(f.get());
    if (size < static_cast<int64_t>(sizeof(kMagic) + kTrailerBytes)) {
      return absl::DataLossError(absl::StrCat(path, ": truncated (", size, " bytes)"));
    }
    uint32_t crc = 0;
    if (absl::Status s = CrcOfPrefix(f.get(), path, size - kTrailerBytes, &crc); !s.ok()) return s;
    char end[8];
    uint32_t stored = 0;
    if (std::fread(end, 1, 8, f.get()) != 8 || std::fread(&stored, 4, 1, f.get()) != 1 ||
        std::memcmp(end, kEndMagic, 8) != 0) {
      return absl::DataLossError(absl::StrCat(path, ": no checkpoint trailer (truncated file?)"));
    }
    if (crc != stored) {
      return absl::DataLossError(absl::StrCat(path, ": checksum mismatch (CRC-32 ", crc,
                                              ", trailer says ", stored, "): the file is corrupt"));
    }
  }
  // Pass 2: headers, layouts, this rank's slices, the replicated state.
  const int my_rank = params->rank();
  for (const BufInfo& bi : bufs) {
    for (ShardArray a : kArrays) params->ZeroShard(bi.unit, bi.buffer, a);
  }
  std::vector<float> chunk;
  for (int i = 0; i < saved_world_size; ++i) {
    const std::string path = absl::StrCat(dir, "/", CheckpointFileName(i));
    std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) return ErrnoStatus(errno, absl::StrCat("opening ", path));
    fseeko(f.get(), 0, SEEK_END);
    Reader r(f.get(), path, ftello(f.get()) - static_cast<int64_t>(kTrailerBytes));
    fseeko(f.get(), 0, SEEK_SET);
    char magic[8];
    uint32_t version = 0;
    int32_t file_rank = -1, file_world = -1;
    uint64_t file_fp = 0;
    std::string file_desc;
    uint32_t nbuf = 0;
    ReplicatedState st;
    if (!r.Bytes(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) {
      return absl::DataLossError(absl::StrCat(path, ": not an fsdp8 checkpoint file (bad magic)"));
    }
    if (!r.Pod(&version)) return r.Malformed("version");
    if (version != kCheckpointFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(path, ": format version ", version,
                                                        ", this worker reads version ",
                                                        kCheckpointFormatVersion));
    }
    if (!r.Pod(&file_rank) || !r.Pod(&file_world) || !r.Pod(&st.step) || !r.Pod(&file_fp) ||
        !r.Str(&file_desc) || !r.Pod(&nbuf)) {
      return r.Malformed("header");
    }
    if (file_rank != i || file_world != saved_world_size) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": written by rank ", file_rank, " of ", file_world, ", expected rank ", i, " of ",
          saved_world_size));
    }
    if (file_fp != fingerprint || nbuf != bufs.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": saved for a different model or precision plan (checkpoint: ", file_desc,
          "; this job: ", description, ")"));
    }
    for (const BufInfo& bi : bufs) {
      uint32_t u = 0, b = 0, wire = 0, zero = 0;
      int64_t numel = 0, padded = 0, shard = 0;
      if (!r.Pod(&u) || !r.Pod(&b) || !r.Pod(&wire) || !r.Pod(&zero) || !r.Pod(&numel) ||
          !r.Pod(&padded) || !r.Pod(&shard)) {
        return r.Malformed("buffer header");
      }
      const BufferPlan& bp = *bi.plan;
      if (static_cast<int>(u) != bi.unit || static_cast<int>(b) != bi.buffer ||
          wire != static_cast<uint32_t>(bp.wire) || numel != bp.numel || shard < 0 ||
          padded != shard * saved_world_size || padded < numel) {
        return absl::DataLossError(absl::StrCat(
            path, ": buffer ", plan.units[bi.unit].name, "/", WireDtypeName(bp.wire),
            " layout does not match (numel ", numel, ", padded ", padded, ", shard ", shard,
            "; expected numel ", bp.numel, ")"));
      }
      // Saved rank i holds flat elements [i * shard, (i + 1) * shard); this rank needs
      // [my_rank * bp.shard_numel, ...) and only the unpadded ones (< numel).
      const int64_t src_lo = static_cast<int64_t>(i) * shard;
      const int64_t dst_lo = static_cast<int64_t>(my_rank) * bp.shard_numel;
      const int64_t lo = std::max(src_lo, dst_lo);
      const int64_t hi = std::min({src_lo + shard, dst_lo + bp.shard_numel, numel});
      for (ShardArray a : kArrays) {
        if (hi <= lo) {
          if (!r.Skip(shard * 4)) return r.Malformed("shard data");
          continue;
        }
        if (!r.Skip((lo - src_lo) * 4)) return r.Malformed("shard data");
        chunk.resize(hi - lo);
        if (!r.Bytes(chunk.data(), chunk.size() * 4)) return r.Malformed("shard data");
        params->UploadShardRange(bi.unit, bi.buffer, a, lo - dst_lo, chunk.data(), hi - lo);
        if (!r.Skip((src_lo + shard - hi) * 4)) return r.Malformed("shard data");
      }
    }
    uint32_t nw = 0;
    if (!r.Pod(&nw) || nw > (1u << 24)) return r.Malformed("weight scaling count");
    st.weight_scaling.resize(nw);
    for (WeightScaling& s : st.weight_scaling) {
      if (!r.Str(&s.name) || !r.Pod(&s.scale) || !r.Pod(&s.scale_inv) || !r.Pod(&s.amax)) {
        return r.Malformed("weight scaling");
      }
    }
    uint32_t na = 0;
    if (!r.Pod(&na) || na > (1u << 24)) return r.Malformed("activation scaling count");
    st.act_scaling.resize(na);
    for (ScalingState& s : st.act_scaling) {
      uint8_t e5m2 = 0, init = 0;
      uint16_t pad = 0;
      uint32_t h = 0;
      if (!r.Str(&s.name) || !r.Pod(&e5m2) || !r.Pod(&init) || !r.Pod(&pad) || !r.Pod(&s.scale) ||
          !r.Pod(&s.scale_inv) || !r.Pod(&h) || h > (1u << 20)) {
        return r.Malformed("activation scaling");
      }
      s.e5m2 = e5m2 != 0;
      s.initialised = init != 0;
      for (uint32_t k = 0; k < h; ++k) {
        float a = 0;
        if (!r.Pod(&a)) return r.Malformed("amax history");
        s.history.push_back(a);
      }
    }
    if (!r.Pod(&st.adamw_step)) return r.Malformed("AdamW step");
    if (!r.AtEnd()) {
      return r.Malformed("trailing bytes before the trailer");
    }
    if (i == 0) {
      *state = std::move(st);
    } else if (std::string d = CompareReplicated(*state, st); !d.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": replicated state differs from ", CheckpointFileName(0), " (", d, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status SaveShard(const Trainer& trainer, int64_t step, const std::string& dir,
                       v1::CheckpointSaved* out) {
  if (step != trainer.CompletedSteps()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, "/", CheckpointFileName(trainer.rank()), ": asked to save the state "
        "after step ", step, ", but this rank has completed ", trainer.CompletedSteps(), " steps"));
  }
  ReplicatedState st;
  st.step = step;
  st.adamw_step = step;
  st.weight_scaling = trainer.params().weight_scaling();
  st.act_scaling = trainer.scaling().states();
  return WriteShardFile(trainer.params(), trainer.rank(), trainer.world_size(),
                        SpecDescription(trainer.spec()), st, dir, out);
}

absl::Status LoadShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                        int64_t start_step) {
  ReplicatedState st;
  if (absl::Status s = ReadShardFiles(dir, saved_world_size, SpecDescription(trainer->spec()),
                                      &trainer->params(), &st);
      !s.ok()) {
    return s;
  }
  const std::string file0 = absl::StrCat(dir, "/", CheckpointFileName(0));
  if (st.step != start_step) {
    return absl::FailedPreconditionError(absl::StrCat(file0, ": holds the state after step ",
                                                      st.step, ", the job starts at step ",
                                                      start_step));
  }
  if (st.adamw_step != st.step) {
    return absl::DataLossError(absl::StrCat(file0, ": AdamW step counter ", st.adamw_step,
                                            " != step ", st.step));
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
  return absl::OkStatus();
}

}  // namespace fsdp8
