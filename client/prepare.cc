#include "client/prepare.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/hf_model.h"
#include "common/token_shard.h"

namespace fsdp8 {
namespace {

// out_dir/tokenizer/ holding only token_ids.json: byte-level tokens, no document separators.
absl::Status WriteByteTokenRecord(const std::string& out_dir) {
  const std::filesystem::path dir = std::filesystem::path(out_dir) / kTokenizerRecordDir;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);  // a record of an earlier run with another tokenizer
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir.string(), ": ", ec.message()));
  const std::string path = (dir / kTokenIdsFile).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << "{\"kind\": \"bytes\", \"vocab_size\": 256, \"bos_token_id\": null, "
       "\"eos_token_id\": null, \"pad_token_id\": null}\n";
  f.flush();
  if (!f) return absl::InternalError(absl::StrCat("writing ", path, ": ", std::strerror(errno)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PrepareResult> PrepareTokenShards(const std::vector<std::string>& files,
                                                 const std::string& out_dir,
                                                 double val_fraction) {
  if (files.empty()) return absl::InvalidArgumentError("prepare: no input files");
  if (!(val_fraction >= 0 && val_fraction < 1))
    return absl::InvalidArgumentError(
        absl::StrCat("--val-fraction: must be in [0, 1) (got ", val_fraction, ")"));
  std::vector<uint16_t> tokens;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(f, ": ", std::strerror(errno)));
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return absl::InternalError(absl::StrCat(f, ": read error"));
    tokens.reserve(tokens.size() + bytes.size());
    for (char c : bytes) tokens.push_back(static_cast<unsigned char>(c));
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": ", ec.message()));
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t n_val = static_cast<int64_t>(std::floor(val_fraction * static_cast<double>(total)));
  PrepareResult r;
  r.train_path = (std::filesystem::path(out_dir) / "train.bin").string();
  r.val_path = (std::filesystem::path(out_dir) / "val.bin").string();
  r.train_tokens = total - n_val;
  r.val_tokens = n_val;
  std::vector<uint16_t> val(tokens.begin() + r.train_tokens, tokens.end());
  tokens.resize(r.train_tokens);
  if (auto s = WriteTokenShard(r.train_path, tokens); !s.ok()) return s;
  if (auto s = WriteTokenShard(r.val_path, val); !s.ok()) return s;
  if (auto s = WriteByteTokenRecord(out_dir); !s.ok()) return s;
  return r;
}

}  // namespace fsdp8
