#include "coordinator/auth.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fsdp8::coord {
namespace {

constexpr size_t kMinTokenLength = 16;

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  // Length differences leak only the length; the bytes are compared without early exit.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<std::string> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int e = errno;
    std::string msg = absl::StrCat(path, ": cannot read: ", std::strerror(e));
    if (e == EACCES) return absl::PermissionDeniedError(msg);
    return absl::NotFoundError(msg);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

const char* RoleName(Role r) {
  switch (r) {
    case Role::kSubmitter: return "submitter";
    case Role::kAdmin: return "admin";
    case Role::kWorker: return "worker";
  }
  return "?";
}

absl::StatusOr<TokenTable> TokenTable::Parse(const std::string& text, const std::string& source) {
  TokenTable t;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto bad = [&](const std::string& rule) {
      return absl::InvalidArgumentError(absl::StrCat(source, " line ", line_no, ": ", rule));
    };
    if (f.size() != 3) return bad(absl::StrCat("must be \"TOKEN ROLE USER\" (got ", f.size(), " fields)"));
    if (f[0].size() < kMinTokenLength)
      return bad(absl::StrCat("token must be at least ", kMinTokenLength, " characters (got ",
                              f[0].size(), ")"));
    for (unsigned char c : f[0])
      if (c < 0x21 || c > 0x7e) return bad("token must be printable ASCII");
    Principal p;
    p.user = f[2];
    if (f[1] == "submitter") p.role = Role::kSubmitter;
    else if (f[1] == "admin") p.role = Role::kAdmin;
    else if (f[1] == "worker") p.role = Role::kWorker;
    else return bad(absl::StrCat("role must be submitter, admin or worker (got \"", f[1], "\")"));
    for (const Entry& e : t.entries_)
      if (e.token == f[0]) return bad(absl::StrCat("duplicate token (also given to user ", e.who.user, ")"));
    t.entries_.push_back({f[0], p});
  }
  return t;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::error_code ec;
  TokenTable all;
  std::vector<std::string> files;
  if (std::filesystem::is_directory(path, ec)) {
    // A mounted Kubernetes secret: one file (a symlink into ..data) per key; skip the dot entries.
    for (const auto& e : std::filesystem::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      if (name.empty() || name[0] == '.') continue;
      if (!std::filesystem::is_regular_file(e.path(), ec)) continue;
      files.push_back(e.path().string());
    }
    if (ec) return absl::NotFoundError(absl::StrCat(path, ": cannot list: ", ec.message()));
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  for (const std::string& f : files) {
    auto text = ReadAll(f);
    if (!text.ok()) return text.status();
    auto t = Parse(*text, f);
    if (!t.ok()) return t.status();
    for (Entry& e : t->entries_) {
      for (const Entry& have : all.entries_)
        if (have.token == e.token)
          return absl::InvalidArgumentError(
              absl::StrCat(f, ": duplicate token (also given to user ", have.who.user, ")"));
      all.entries_.push_back(std::move(e));
    }
  }
  if (all.entries_.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no tokens (\"TOKEN ROLE USER\" lines)"));
  return all;
}

std::optional<Principal> TokenTable::Find(const std::string& token) const {
  std::optional<Principal> found;
  for (const Entry& e : entries_)  // no early exit: the time does not depend on which one matched
    if (ConstantTimeEqual(e.token, token)) found = e.who;
  return found;
}

absl::StatusOr<Principal> Authorizer::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    std::initializer_list<Role> allowed, const std::string& what) const {
  if (!tokens_) return Principal{};
  auto it = metadata.find("authorization");
  if (it == metadata.end())
    return absl::UnauthenticatedError("missing \"authorization: Bearer TOKEN\" metadata");
  const std::string value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWithIgnoreCase(value, kBearer))
    return absl::UnauthenticatedError("authorization metadata must be \"Bearer TOKEN\"");
  const std::string token(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
  std::optional<Principal> p = tokens_->Find(token);
  if (!p) return absl::UnauthenticatedError("unknown token");
  for (Role r : allowed)
    if (r == p->role) return *p;
  return absl::PermissionDeniedError(absl::StrCat("user ", p->user, " (role ", RoleName(p->role),
                                                  ") may not call ", what));
}

bool MayAccessJob(const Principal& p, const std::string& owner) {
  return p.role == Role::kAdmin || p.user == owner;
}

}  // namespace fsdp8::coord
