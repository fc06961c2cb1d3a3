#include "common/token_shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdp8 {
namespace {

// Host byte order must be little-endian (x86-64, aarch64): the file is read with memcpy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards assume a little-endian host");

absl::Status Invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": ", what));
}

// Checks a header read from `path` against the file's size.
absl::StatusOr<TokenShardHeader> CheckHeader(const std::string& path, const int32_t* header,
                                             int64_t file_bytes) {
  TokenShardHeader h;
  if (header[0] == kTokenShardMagic) {
    if (header[1] != kTokenShardVersion) {
      return Invalid(path, absl::StrCat("unsupported version ", header[1], " for magic ",
                                        kTokenShardMagic, " (want ", kTokenShardVersion,
                                        ": uint16 tokens)"));
    }
    h.token_bytes = 2;
  } else if (header[0] == kTokenShardMagicU32) {
    if (header[1] != kTokenShardVersionU32) {
      return Invalid(path, absl::StrCat("unsupported version ", header[1], " for magic ",
                                        kTokenShardMagicU32, " (want ", kTokenShardVersionU32,
                                        ": uint32 tokens)"));
    }
    h.token_bytes = 4;
  } else {
    return Invalid(path, absl::StrCat("bad magic ", header[0], " (want ", kTokenShardMagic,
                                      " for uint16 tokens or ", kTokenShardMagicU32,
                                      " for uint32 tokens)"));
  }
  h.num_tokens = header[2];
  if (h.num_tokens < 0) return Invalid(path, absl::StrCat("negative token count ", h.num_tokens));
  const int64_t want = kTokenShardHeaderBytes + h.token_bytes * h.num_tokens;
  if (file_bytes != want) {
    return Invalid(path, absl::StrCat("header says ", h.num_tokens, " tokens of ", h.token_bytes,
                                      " bytes (", want, " bytes) but the file has ", file_bytes,
                                      " bytes"));
  }
  return h;
}

// Opens `path` read-only and checks its header; *fd is open on success (the caller closes it).
absl::StatusOr<TokenShardHeader> OpenAndCheck(const std::string& path, int* fd) {
  *fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (*fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("token shard ", path, ": cannot open (", std::strerror(errno), ")"));
  }
  struct stat st;
  int32_t header[kTokenShardHeaderInts];
  absl::StatusOr<TokenShardHeader> h;
  if (::fstat(*fd, &st) != 0) {
    h = absl::InternalError(absl::StrCat("token shard ", path, ": stat failed (",
                                         std::strerror(errno), ")"));
  } else if (st.st_size < kTokenShardHeaderBytes) {
    h = Invalid(path, absl::StrCat("file has ", st.st_size,
                                   " bytes, shorter than the 1024-byte header"));
  } else if (::pread(*fd, header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
    h = Invalid(path, "cannot read header");
  } else {
    h = CheckHeader(path, header, st.st_size);
  }
  if (!h.ok()) {
    ::close(*fd);
    *fd = -1;
  }
  return h;
}

// Writes the header and n tokens narrowed to token_bytes each to f.
bool WriteTokens(FILE* f, const uint32_t* tokens, int64_t n, int token_bytes) {
  int32_t header[kTokenShardHeaderInts] = {};
  header[0] = token_bytes == 2 ? kTokenShardMagic : kTokenShardMagicU32;
  header[1] = token_bytes == 2 ? kTokenShardVersion : kTokenShardVersionU32;
  header[2] = static_cast<int32_t>(n);
  if (std::fwrite(header, sizeof(header), 1, f) != 1) return false;
  if (token_bytes == 4) {
    return n == 0 || std::fwrite(tokens, 4, static_cast<size_t>(n), f) == static_cast<size_t>(n);
  }
  std::vector<uint16_t> chunk;
  for (int64_t i = 0; i < n; i += 1 << 20) {
    const int64_t m = std::min<int64_t>(1 << 20, n - i);
    chunk.assign(tokens + i, tokens + i + m);
    if (std::fwrite(chunk.data(), 2, static_cast<size_t>(m), f) != static_cast<size_t>(m)) {
      return false;
    }
  }
  return true;
}

}  // namespace

int TokenBytesForVocab(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

absl::Status WriteTokenShard(const std::string& path, const uint32_t* tokens, int64_t n,
                             int token_bytes) {
  if (token_bytes != 2 && token_bytes != 4) {
    return Invalid(path, absl::StrCat("token_bytes must be 2 or 4 (got ", token_bytes, ")"));
  }
  if (n < 0 || n > INT32_MAX) {
    return Invalid(path, absl::StrCat(n, " tokens do not fit the int32 header count"));
  }
  if (token_bytes == 2) {
    for (int64_t i = 0; i < n; ++i) {
      if (tokens[i] > 65535) {
        return Invalid(path, absl::StrCat("token ", tokens[i], " at index ", i,
                                          " does not fit the uint16 format"));
      }
    }
  }
  const std::string tmp = absl::StrCat(path, ".tmp.", static_cast<long>(getpid()));
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("token shard ", path, ": cannot create ", tmp, " (", std::strerror(errno), ")"));
  }
  bool ok = WriteTokens(f, tokens, n, token_bytes);
  ok = (std::fflush(f) == 0) && ok;
  ok = (fsync(fileno(f)) == 0) && ok;
  const int saved = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("token shard ", path, ": write failed (", std::strerror(saved), ")"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("token shard ", path, ": rename failed (", std::strerror(e), ")"));
  }
  return absl::OkStatus();
}

absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens) {
  const std::vector<uint32_t> wide(tokens.begin(), tokens.end());
  return WriteTokenShard(path, wide.data(), static_cast<int64_t>(wide.size()), 2);
}

absl::StatusOr<TokenShardHeader> ReadTokenShardHeader(const std::string& path) {
  int fd = -1;
  absl::StatusOr<TokenShardHeader> h = OpenAndCheck(path, &fd);
  if (fd >= 0) ::close(fd);
  return h;
}

namespace {

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

absl::Status Changed(const std::string& path, const std::string& what) {
  return absl::DataLossError(
      absl::StrCat("token shard ", path, " changed while it was being read: ", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenShardReader>> TokenShardReader::Open(const std::string& path) {
  int fd = -1;
  absl::StatusOr<TokenShardHeader> h = OpenAndCheck(path, &fd);
  if (!h.ok()) return h.status();
  std::unique_ptr<TokenShardReader> r(new TokenShardReader());
  r->path_ = path;
  r->header_ = *h;
  r->fd_ = fd;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat("token shard ", path, ": stat failed (", std::strerror(errno), ")"));
  }
  r->file_bytes_ = st.st_size;
  r->dev_ = st.st_dev;
  r->ino_ = st.st_ino;
  r->mtime_ns_ = MtimeNs(st);
  return r;
}

TokenShardReader::~TokenShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status TokenShardReader::Read(int64_t first, int64_t count, uint32_t* out) const {
  const int tb = header_.token_bytes;
  const int64_t begin = kTokenShardHeaderBytes + tb * first;
  const int64_t bytes = tb * count;
  // uint32 tokens land in `out` as they are; uint16 ones go through a buffer and are widened.
  std::vector<uint16_t> narrow(tb == 2 ? static_cast<size_t>(count) : 0);
  char* dst = tb == 4 ? reinterpret_cast<char*>(out) : reinterpret_cast<char*>(narrow.data());
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, dst + done, static_cast<size_t>(bytes - done), begin + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(absl::StrCat("token shard ", path_, ": read of bytes [", begin,
                                              ", ", begin + bytes, ") failed (",
                                              std::strerror(errno), ")"));
    }
    if (n == 0) {
      struct stat st;
      const int64_t now = ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      return Changed(path_, absl::StrCat("a read of bytes [", begin, ", ", begin + bytes,
                                         ") met its end (", now, " bytes now, ", file_bytes_,
                                         " when opened: truncated)"));
    }
    done += n;
  }
  if (tb == 2) {
    for (int64_t i = 0; i < count; ++i) out[i] = narrow[static_cast<size_t>(i)];
  }
  return absl::OkStatus();
}

absl::Status TokenShardReader::CheckUnchanged() const {
  struct stat open_st;
  if (::fstat(fd_, &open_st) != 0) {
    return absl::InternalError(
        absl::StrCat("token shard ", path_, ": stat failed (", std::strerror(errno), ")"));
  }
  if (open_st.st_size != file_bytes_) {
    return Changed(path_, absl::StrCat("it has ", open_st.st_size, " bytes now, ", file_bytes_,
                                       " when opened (",
                                       open_st.st_size < file_bytes_ ? "truncated" : "extended",
                                       ")"));
  }
  if (MtimeNs(open_st) != mtime_ns_) {
    return Changed(path_, "its modification time changed (rewritten in place)");
  }
  struct stat path_st;
  if (::stat(path_.c_str(), &path_st) != 0) {
    const int e = errno;
    if (e == ENOENT) return Changed(path_, "the path no longer exists (deleted or renamed)");
    return absl::InternalError(
        absl::StrCat("token shard ", path_, ": stat failed (", std::strerror(e), ")"));
  }
  if (path_st.st_dev != dev_ || path_st.st_ino != ino_) {
    return Changed(path_, "the path names another file now (replaced)");
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenShard> ReadTokenShard(const std::string& path) {
  absl::StatusOr<std::unique_ptr<TokenShardReader>> r = TokenShardReader::Open(path);
  if (!r.ok()) return r.status();
  TokenShard shard;
  shard.token_bytes = (*r)->token_bytes();
  shard.tokens.resize(static_cast<size_t>((*r)->num_tokens()));
  if (absl::Status s = (*r)->Read(0, (*r)->num_tokens(), shard.tokens.data()); !s.ok()) return s;
  return shard;
}

uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t WindowHash(uint64_t seed, int64_t step, int64_t global_index, uint64_t stream) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ stream);
  h = SplitMix64(h ^ static_cast<uint64_t>(step));
  return SplitMix64(h ^ static_cast<uint64_t>(global_index));
}

int64_t WindowStart(uint64_t seed, int64_t step, int64_t global_index, int64_t num_tokens,
                    int seq_len, uint64_t stream) {
  if (seq_len < 1 || num_tokens < static_cast<int64_t>(seq_len) + 1) return -1;
  const uint64_t windows = static_cast<uint64_t>(num_tokens - seq_len);
  const uint64_t h = WindowHash(seed, step, global_index, stream);
  // Lemire's multiply-shift maps h uniformly (to within 2^-64 * W) onto [0, W).
  return static_cast<int64_t>((static_cast<unsigned __int128>(h) * windows) >> 64);
}

}  // namespace fsdp8
