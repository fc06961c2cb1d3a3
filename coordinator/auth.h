// Bearer-token authentication and role checks for the coordinator's gRPC services.
//
// Tokens file: one token per line, "TOKEN ROLE USER" separated by spaces or tabs; blank lines and
// lines starting with '#' are ignored. ROLE is `submitter` (JobService: submits jobs, sees and
// cancels only its own), `admin` (JobService for every job, AdminService) or `worker` (the
// WorkerControl channel of the worker daemons). A TOKEN is at least 16 characters of printable
// ASCII, unique in the table; USER names the caller (Job.owner, logs). The same format is read from
// a mounted Kubernetes secret: when the path is a directory, every file in it whose name does not
// start with '.' (the secret's keys) is read and the tables are merged.
//
// Clients send "authorization: Bearer TOKEN" metadata. Without a token table every caller is an
// anonymous admin (no authentication).
//
// Thread-safety: TokenTable and Authorizer are immutable after construction.
#pragma once

#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8::coord {

enum class Role { kSubmitter, kAdmin, kWorker };
const char* RoleName(Role r);  // "submitter", "admin", "worker"

struct Principal {
  std::string user;  // empty without authentication
  Role role = Role::kAdmin;
};

class TokenTable {
 public:
  // Parses tokens-file text; `source` names the file in errors. INVALID_ARGUMENT naming the line
  // and the rule for a malformed line, a short or duplicate token, or an unknown role.
  static absl::StatusOr<TokenTable> Parse(const std::string& text, const std::string& source);
  // Reads a tokens file or a secret directory (see above). NOT_FOUND / PERMISSION_DENIED when it
  // cannot be read; INVALID_ARGUMENT as Parse, and when no token is found at all.
  static absl::StatusOr<TokenTable> Load(const std::string& path);

  // The principal of `token`, or nullopt. Every entry is compared in constant time.
  std::optional<Principal> Find(const std::string& token) const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string token;
    Principal who;
  };
  std::vector<Entry> entries_;
};

class Authorizer {
 public:
  // nullopt: authentication off.
  explicit Authorizer(std::optional<TokenTable> tokens) : tokens_(std::move(tokens)) {}
  bool enabled() const { return tokens_.has_value(); }

  // Authenticates a call from its metadata and checks its role. UNAUTHENTICATED when the
  // authorization metadata is missing, not "Bearer TOKEN", or the token is unknown;
  // PERMISSION_DENIED (naming the user, role and `what`) when the role is not in `allowed`.
  absl::StatusOr<Principal> Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                  std::initializer_list<Role> allowed,
                                  const std::string& what) const;

 private:
  std::optional<TokenTable> tokens_;
};

// Whether `p` may see and cancel a job owned by `owner`: admins always, submitters their own jobs.
bool MayAccessJob(const Principal& p, const std::string& owner);

}  // namespace fsdp8::coord
