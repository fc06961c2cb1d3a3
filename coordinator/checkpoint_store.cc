#include "coordinator/checkpoint_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <chrono>
#include <memory>
#include <set>
#include <thread>

#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/spec.h"

namespace fsdp8::coord {
namespace fs = std::filesystem;
namespace {

// StagingDir(k) is <root>/.replace-step-<k>.
constexpr char kStagingPrefix[] = ".replace-";

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status FsyncPath(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open", path);
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) return ErrnoError("fsync", path);
  return absl::OkStatus();
}

// Called at each crash point of a write with its name (common/fault_injection.h).
using CrashHook = std::function<void(const char* point)>;

// Writes and fsyncs `path`; `crash` (optional) is called at manifest.before_write (file created,
// empty), manifest.mid_write (half of `data` written) and manifest.before_fsync.
absl::Status WriteFileDurably(const std::string& path, const std::string& data,
                              const CrashHook& crash = nullptr) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("create", path);
  if (crash) crash("manifest.before_write");
  size_t off = 0;
  bool halfway = crash != nullptr;
  while (off < data.size()) {
    // With crash points, the first write stops halfway (manifest.mid_write comes between).
    const size_t left = data.size() - off;
    const size_t want = halfway ? std::max<size_t>(1, left / 2) : left;
    ssize_t n = ::write(fd, data.data() + off, want);
    if (n < 0) {
      if (errno == EINTR) continue;
      int saved = errno;
      ::close(fd);
      errno = saved;
      return ErrnoError("write", path);
    }
    off += static_cast<size_t>(n);
    if (halfway) {
      halfway = false;
      crash("manifest.mid_write");
    }
  }
  if (crash) crash("manifest.before_fsync");
  if (::fsync(fd) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    return ErrnoError("fsync", path);
  }
  if (::close(fd) != 0) return ErrnoError("close", path);
  return absl::OkStatus();
}

// An exclusive flock of <root>/OWNER.lock (root created when missing); closing the descriptor
// releases it.
class DirLock {
 public:
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& root) {
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) return absl::InternalError(absl::StrCat("create ", root, ": ", ec.message()));
    const std::string path = (fs::path(root) / kOwnerLockFileName).string();
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoError("open", path);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      if (saved != EWOULDBLOCK || std::chrono::steady_clock::now() > deadline) {
        ::close(fd);
        if (saved != EWOULDBLOCK) {
          errno = saved;
          return ErrnoError("flock", path);
        }
        return absl::UnavailableError(
            absl::StrCat(path, " stayed locked by another process for 10 s"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::unique_ptr<DirLock>(new DirLock(fd));
  }
  ~DirLock() { ::close(fd_); }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

// Held only by a store with a job id (tools and tests without one leave no lock file behind).
absl::StatusOr<std::unique_ptr<DirLock>> LockIf(bool lock, const std::string& root) {
  if (!lock) return std::unique_ptr<DirLock>();
  return DirLock::Acquire(root);
}

std::string Describe(const v1::CheckpointOwnerEntry& e) {
  return absl::StrCat("job ", e.job_id(), e.user().empty() ? "" : absl::StrCat(" (user ", e.user(), ")"));
}

}  // namespace

int64_t CommittedCheckpoint::bytes() const {
  int64_t n = 0;
  for (const auto& f : manifest.files()) n += f.bytes();
  return n;
}

std::string CheckpointStore::StepDir(int64_t step) const {
  return (fs::path(root_) / StepDirName(step)).string();
}

std::string CheckpointStore::StagingDir(int64_t step) const {
  return (fs::path(root_) / absl::StrCat(kStagingPrefix, StepDirName(step))).string();
}

absl::StatusOr<std::string> CheckpointStore::Prepare(int64_t step) const {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("checkpoint step ", step, " < 0"));
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  std::string dir = StepDir(step);
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kManifestName, ec)) {
    // Committed already: stage the new save beside it.
    dir = StagingDir(step);
    fs::remove_all(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", dir, ": ", ec.message()));
  }
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", dir, ": ", ec.message()));
  fs::remove(fs::path(dir) / absl::StrCat(kManifestName, ".tmp"), ec);
  if (!job_id_.empty()) {
    const std::string marker = (fs::path(dir) / kStepJobFileName).string();
    if (absl::Status s = WriteFileDurably(marker, job_id_ + "\n"); !s.ok()) return s;
  }
  return dir;
}

absl::Status CheckpointStore::Commit(v1::CheckpointManifest m) const {
  if (m.format_version() == 0) m.set_format_version(kFormatVersion);
  const std::string step_dir = StepDir(m.step());
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  if (!job_id_.empty() && m.job_id() != job_id_) {
    return absl::InvalidArgumentError(absl::StrCat("the MANIFEST of ", step_dir, " names job ",
                                                   m.job_id(), ", this store writes for ", job_id_));
  }
  std::error_code ec;
  // Staged when Prepare put the save beside a committed step-<k>. A staging directory left over
  // while step-<k> is uncommitted is stale: the save went into step-<k> itself.
  const bool staged = fs::exists(fs::path(step_dir) / kManifestName, ec) &&
                      fs::is_directory(StagingDir(m.step()), ec);
  const std::string dir = staged ? StagingDir(m.step()) : step_dir;
  if (absl::Status s = CheckManifest(m, step_dir); !s.ok())
    return absl::InvalidArgumentError(s.message());
  absl::StatusOr<std::string> json = EncodeManifest(m);
  if (!json.ok()) return json.status();
  const std::string tmp = (fs::path(dir) / absl::StrCat(kManifestName, ".tmp")).string();
  const std::string final_path = (fs::path(dir) / kManifestName).string();
  // The crash points name the MANIFEST's final path (<root>/step-<k>/MANIFEST, also when staged).
  const std::string named = (fs::path(step_dir) / kManifestName).string();
  const CrashHook crash = [this, &named](const char* point) {
    if (faults_ != nullptr) faults_->CrashPoint(point, named);
  };
  if (absl::Status s = WriteFileDurably(tmp, *json, crash); !s.ok()) return s;
  crash("manifest.before_rename");
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) return ErrnoError("rename to", final_path);
  crash("manifest.after_rename");
  if (absl::Status s = FsyncPath(dir, true); !s.ok()) return s;
  if (!staged) return absl::OkStatus();
  // The staged save is complete and committed in its own directory: swap it in.
  if (::renameat2(AT_FDCWD, dir.c_str(), AT_FDCWD, step_dir.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) return ErrnoError("exchange with", step_dir);
    // No atomic exchange on this filesystem: move the old checkpoint aside (still committed, as
    // step-<k>.old, which retention keeps while step-<k> is not committed), move the new one in,
    // then drop the old. A failed second rename moves the old one back.
    const std::string old = step_dir + ".old";
    fs::remove_all(old, ec);
    if (::rename(step_dir.c_str(), old.c_str()) != 0) return ErrnoError("rename to", old);
    if (::rename(dir.c_str(), step_dir.c_str()) != 0) {
      absl::Status err = ErrnoError("rename to", step_dir);
      (void)::rename(old.c_str(), step_dir.c_str());
      return err;
    }
    if (absl::Status s = FsyncPath(root_, true); !s.ok()) return s;
    fs::remove_all(old, ec);
    return absl::OkStatus();
  }
  if (absl::Status s = FsyncPath(root_, true); !s.ok()) return s;
  fs::remove_all(dir, ec);  // now the old checkpoint's files
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointManifest> CheckpointStore::ReadManifest(const std::string& step_dir) {
  return ReadManifestFile(step_dir);
}

absl::Status CheckpointStore::VerifyFiles(const std::string& step_dir,
                                          const v1::CheckpointManifest& m) {
  // The structure first: never stat a path that escapes step_dir.
  if (absl::Status s = CheckManifest(m, absl::StrCat("checkpoint ", step_dir)); !s.ok()) return s;
  for (const v1::CheckpointFile& f : m.files()) {
    const fs::path p = fs::path(step_dir) / f.file();
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec)
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, " is damaged: rank ",
                                              f.rank(), " file ", f.file(), ": ", ec.message()));
    if (static_cast<int64_t>(size) != f.bytes())
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, " is damaged: rank ",
                                              f.rank(), " file ", f.file(), " has ", size,
                                              " bytes, the MANIFEST records ", f.bytes()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CommittedCheckpoint> CheckpointStore::Open(const std::string& step_dir) {
  auto m = ReadManifest(step_dir);
  if (!m.ok()) return m.status();
  if (absl::Status s = VerifyFiles(step_dir, *m); !s.ok()) return s;
  CommittedCheckpoint c;
  c.step = m->step();
  c.dir = step_dir;
  c.manifest = std::move(*m);
  return c;
}

absl::StatusOr<std::vector<CommittedCheckpoint>> CheckpointStore::List(
    const std::string& job_id) const {
  std::vector<CommittedCheckpoint> out;
  std::error_code ec;
  if (!fs::exists(root_, ec)) return out;
  fs::directory_iterator it(root_, ec);
  if (ec) return absl::InternalError(absl::StrCat("list ", root_, ": ", ec.message()));
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return absl::InternalError(absl::StrCat("list ", root_, ": ", ec.message()));
    const int64_t k = StepOfDirName(it->path().filename().string());
    if (k < 0 || !it->is_directory(ec)) continue;
    auto m = ReadManifest(it->path().string());
    if (!m.ok() || m->step() != k) continue;  // uncommitted
    if (!job_id.empty() && m->job_id() != job_id) continue;
    CommittedCheckpoint c;
    c.step = k;
    c.dir = it->path().string();
    c.manifest = std::move(*m);
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(),
            [](const CommittedCheckpoint& a, const CommittedCheckpoint& b) { return a.step < b.step; });
  return out;
}

absl::StatusOr<std::optional<CommittedCheckpoint>> CheckpointStore::Latest(
    const std::string& job_id) const {
  auto all = List(job_id);
  if (!all.ok()) return all.status();
  if (all->empty()) return std::optional<CommittedCheckpoint>();
  return std::optional<CommittedCheckpoint>(std::move(all->back()));
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::Retain(int keep_last) const {
  if (keep_last < 1)
    return absl::InvalidArgumentError(absl::StrCat("keep_last must be >= 1 (got ", keep_last, ")"));
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  auto all = List(job_id_);
  if (!all.ok()) return all.status();
  std::vector<std::string> removed;
  if (all->empty()) return removed;
  const int64_t newest = all->back().step;
  std::set<int64_t> committed;
  for (const auto& c : *all) committed.insert(c.step);
  std::set<int64_t> doomed;
  const size_t n = all->size();
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < n; ++i) doomed.insert((*all)[i].step);
  std::error_code ec;
  for (fs::directory_iterator it(root_, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // Leftovers of an interrupted replacement (Prepare/Commit of a committed step).
    // Only once step-<k> is committed again: until then either may hold the committed copy.
    int64_t leftover = -1;
    if (name.rfind(kStagingPrefix, 0) == 0) {
      leftover = StepOfDirName(name.substr(sizeof(kStagingPrefix) - 1));
    }
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".old") == 0)
      leftover = StepOfDirName(name.substr(0, name.size() - 4));
    if (leftover >= 0) {
      if (it->is_directory() && committed.count(leftover) && Mine(it->path().string()))
        removed.push_back(it->path().string());
      continue;
    }
    const int64_t k = StepOfDirName(name);
    if (k < 0 || !it->is_directory()) continue;
    const bool stale = !committed.count(k) && k < newest;
    if ((doomed.count(k) || stale) && Mine(it->path().string()))
      removed.push_back(it->path().string());
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", root_, ": ", ec.message()));
  std::sort(removed.begin(), removed.end());
  for (const std::string& d : removed) {
    // The MANIFEST goes first (and durably), so a crash midway leaves an uncommitted directory,
    // never a committed one with missing files.
    const std::string manifest = (fs::path(d) / kManifestName).string();
    if (fs::exists(manifest, ec)) {
      fs::remove(manifest, ec);
      if (ec) return absl::InternalError(absl::StrCat("remove ", manifest, ": ", ec.message()));
      if (absl::Status s = FsyncPath(d, true); !s.ok()) return s;
    }
    fs::remove_all(d, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", d, ": ", ec.message()));
  }
  return removed;
}

absl::Status CheckpointStore::CheckResumeCompatible(const v1::JobSpec& job_in,
                                                    const v1::JobSpec& saved_in,
                                                    const std::string& step_dir,
                                                    const std::string& field) {
  const v1::JobSpec job = WithDefaults(job_in, 0);
  const v1::JobSpec saved = WithDefaults(saved_in, 0);
  using google::protobuf::util::MessageDifferencer;
  auto differ = [&](const google::protobuf::Message& a, const google::protobuf::Message& b,
                    const std::string& section) -> absl::Status {
    if (MessageDifferencer::Equals(a, b)) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": checkpoint ", step_dir, " was written with a different ",
        section, " (checkpoint: {", b.ShortDebugString(), "}, job: {",
        a.ShortDebugString(), "})"));
  };
  if (absl::Status s = differ(job.model(), saved.model(), "model"); !s.ok()) return s;
  return differ(job.precision(), saved.precision(), "precision");
}

absl::Status CheckpointStore::Abandon(int64_t step) const {
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  std::error_code ec;
  if (fs::exists(fs::path(StepDir(step)) / kManifestName, ec)) {
    // The failed save was staged (step-<k> is committed): drop only the staging directory.
    if (!Mine(StagingDir(step))) return absl::OkStatus();
    fs::remove_all(StagingDir(step), ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", StagingDir(step), ": ", ec.message()));
    return absl::OkStatus();
  }
  const std::string dir = StepDir(step);
  if (fs::exists(fs::path(dir) / kManifestName, ec)) return absl::OkStatus();
  if (!job_id_.empty() && fs::exists(dir, ec) && !Mine(dir)) return absl::OkStatus();
  fs::remove_all(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("remove ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

// ---- Ownership ----

absl::StatusOr<std::optional<v1::CheckpointDirOwner>> CheckpointStore::Owner() const {
  return ReadOwnerFile(root_);
}

absl::StatusOr<std::optional<v1::CheckpointOwnerEntry>> CheckpointStore::LegacyOwner(
    const std::string& except) const {
  auto all = List();
  if (!all.ok()) return all.status();
  for (auto it = all->rbegin(); it != all->rend(); ++it) {
    const std::string& job = it->manifest.job_id();
    if (job.empty() || job == except) continue;
    v1::CheckpointOwnerEntry e;
    e.set_job_id(job);
    e.set_since(it->manifest.time());
    return std::optional<v1::CheckpointOwnerEntry>(e);
  }
  return std::optional<v1::CheckpointOwnerEntry>();
}

absl::Status CheckpointStore::WriteOwnerLocked(const v1::CheckpointDirOwner& o) const {
  absl::StatusOr<std::string> text = EncodeOwner(o);
  if (!text.ok()) return text.status();
  const std::string path = (fs::path(root_) / kOwnerFileName).string();
  const std::string tmp = path + ".tmp";
  if (absl::Status s = WriteFileDurably(tmp, *text); !s.ok()) return s;
  if (::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoError("rename to", path);
  return FsyncPath(root_, true);
}

absl::Status CheckpointStore::Claim(const v1::CheckpointOwnerEntry& claimant, bool take_over,
                                    const TakeOverCheck& may_take_over) const {
  auto lock = DirLock::Acquire(root_);
  if (!lock.ok()) return lock.status();
  auto record = ReadOwnerFile(root_);
  if (!record.ok()) return record.status();
  v1::CheckpointDirOwner next;
  if (record->has_value()) {
    next = **record;
  } else {
    auto legacy = LegacyOwner(claimant.job_id());
    if (!legacy.ok()) return legacy.status();
    if (legacy->has_value()) *next.mutable_owner() = **legacy;
  }
  const v1::CheckpointOwnerEntry old = next.owner();
  if (old.job_id() == claimant.job_id()) return absl::OkStatus();
  if (!old.job_id().empty()) {
    if (!take_over) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir: ", root_, " belongs to ", Describe(old),
          "; a checkpoint directory holds one job's checkpoints: choose another checkpoint.dir "
          "(init.from_checkpoint starts from one of its checkpoints), or set "
          "checkpoint.take_over: true once ", old.job_id(), " has ended or was deleted"));
    }
    if (may_take_over) {
      if (absl::Status s = may_take_over(old); !s.ok()) return s;
    }
    v1::CheckpointOwnerEntry* prev = next.add_previous();
    *prev = old;
    prev->set_until(claimant.since());
  }
  *next.mutable_owner() = claimant;
  return WriteOwnerLocked(next);
}

absl::Status CheckpointStore::CheckOwnedLocked() const {
  if (job_id_.empty()) return absl::OkStatus();
  auto record = ReadOwnerFile(root_);
  if (!record.ok()) return record.status();
  if (record->has_value()) {
    const v1::CheckpointOwnerEntry& owner = (*record)->owner();
    if (owner.job_id() == job_id_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint.dir ", root_, " belongs to ", Describe(owner), "; job ", job_id_,
        " no longer writes there"));
  }
  // First use of a directory without OWNER (a job submitted before OWNER records existed).
  auto legacy = LegacyOwner(job_id_);
  if (!legacy.ok()) return legacy.status();
  if (legacy->has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint.dir ", root_, " holds checkpoints of ", Describe(**legacy), "; job ", job_id_,
        " does not write there"));
  }
  v1::CheckpointDirOwner o;
  o.mutable_owner()->set_job_id(job_id_);
  o.mutable_owner()->set_since(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  return WriteOwnerLocked(o);
}

bool CheckpointStore::Mine(const std::string& step_dir) const {
  if (job_id_.empty()) return true;
  std::error_code ec;
  if (fs::exists(fs::path(step_dir) / kManifestName, ec)) {
    auto m = ReadManifest(step_dir);
    if (m.ok()) return m->job_id() == job_id_;
  }
  return ReadStepJobFile(step_dir) == job_id_;
}

}  // namespace fsdp8::coord
