#include "common/token_shard.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace fsdp8 {
namespace {

// Host byte order must be little-endian (x86-64, aarch64): the file is read with memcpy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards assume a little-endian host");

// Opens `path`, checks the header and the size; leaves the stream after the header.
absl::StatusOr<int64_t> OpenAndCheck(const std::string& path, std::ifstream* in) {
  in->open(path, std::ios::binary);
  if (!*in) {
    return absl::NotFoundError(
        absl::StrCat("token shard ", path, ": cannot open (", std::strerror(errno), ")"));
  }
  in->seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(in->tellg());
  in->seekg(0, std::ios::beg);
  if (size < kTokenShardHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": file has ", size,
                                                   " bytes, shorter than the 1024-byte header"));
  }
  int32_t header[kTokenShardHeaderInts];
  in->read(reinterpret_cast<char*>(header), sizeof(header));
  if (!*in) {
    return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": cannot read header"));
  }
  if (header[0] != kTokenShardMagic) {
    return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": bad magic ", header[0],
                                                   " (want ", kTokenShardMagic, ")"));
  }
  if (header[1] != kTokenShardVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("token shard ", path, ": unsupported version ", header[1], " (want ",
                     kTokenShardVersion, ": uint16 tokens)"));
  }
  const int64_t count = header[2];
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("token shard ", path, ": negative token count ", count));
  }
  const int64_t want = kTokenShardHeaderBytes + 2 * count;
  if (size != want) {
    return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": header says ", count,
                                                   " tokens (", want, " bytes) but the file has ",
                                                   size, " bytes"));
  }
  return count;
}

}  // namespace

absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": ", tokens.size(),
                                                   " tokens exceed the int32 header count"));
  }
  int32_t header[kTokenShardHeaderInts] = {};
  header[0] = kTokenShardMagic;
  header[1] = kTokenShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  const std::string tmp = absl::StrCat(path, ".tmp.", static_cast<long>(getpid()));
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("token shard ", path, ": cannot create ", tmp, " (", std::strerror(errno), ")"));
  }
  bool ok = std::fwrite(header, sizeof(header), 1, f) == 1;
  if (ok && !tokens.empty()) {
    ok = std::fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), f) == tokens.size();
  }
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

absl::StatusOr<TokenShard> ReadTokenShard(const std::string& path) {
  std::ifstream in;
  absl::StatusOr<int64_t> count = OpenAndCheck(path, &in);
  if (!count.ok()) return count.status();
  TokenShard shard;
  shard.tokens.resize(static_cast<size_t>(*count));
  if (*count > 0) {
    in.read(reinterpret_cast<char*>(shard.tokens.data()), *count * 2);
    if (!in) {
      return absl::InvalidArgumentError(absl::StrCat("token shard ", path, ": cannot read ",
                                                     *count, " tokens"));
    }
  }
  return shard;
}

absl::StatusOr<int64_t> ReadTokenShardHeader(const std::string& path) {
  std::ifstream in;
  return OpenAndCheck(path, &in);
}

uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

int64_t WindowStart(uint64_t seed, int64_t step, int64_t global_index, int64_t num_tokens,
                    int seq_len, uint64_t stream) {
  if (seq_len < 1 || num_tokens < static_cast<int64_t>(seq_len) + 1) return -1;
  const uint64_t windows = static_cast<uint64_t>(num_tokens - seq_len);
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ stream);
  h = SplitMix64(h ^ static_cast<uint64_t>(step));
  h = SplitMix64(h ^ static_cast<uint64_t>(global_index));
  // Lemire's multiply-shift maps h uniformly (to within 2^-64 * W) onto [0, W).
  return static_cast<int64_t>((static_cast<unsigned __int128>(h) * windows) >> 64);
}

}  // namespace fsdp8
