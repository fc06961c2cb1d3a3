#include "coordinator/checkpoint_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "absl/strings/str_join.h"
#include "common/checkpoint_format.h"
#include "common/spec.h"
#include "coordinator/log.h"

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

// An exclusive flock of <root>/OWNER.lock; closing the descriptor releases it. root is created
// when missing only with create_root (a claim at submit); otherwise a missing root (storage not
// mounted) is UNAVAILABLE and nothing is created.
class DirLock {
 public:
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& root,
                                                          bool create_root = false) {
    std::error_code ec;
    if (create_root) {
      fs::create_directories(root, ec);
      if (ec) return absl::InternalError(absl::StrCat("create ", root, ": ", ec.message()));
    } else if (!fs::is_directory(root, ec)) {
      return absl::UnavailableError(absl::StrCat(
          "checkpoint.dir ", root, " is not there (", ec ? ec.message() : "not a directory",
          "; storage not mounted?); it is created only when a job claims it"));
    }
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

// The job that wrote a step directory: its MANIFEST's job when committed, else its JOB file
// (empty when neither names one).
std::string StepDirJob(const std::string& step_dir) {
  auto m = ReadManifestFile(step_dir);
  if (m.ok()) return m->job_id();
  return ReadStepJobFile(step_dir);
}

void LogLeftover(const std::string& path, const char* action, const std::string& why) {
  LogEvent("checkpoint_leftover_removed", {{"dir", path}, {"action", action}, {"why", why}});
}

void LogKept(const std::string& path, const std::string& why) {
  LogEvent("checkpoint_leftover_kept", {{"dir", path}, {"why", why}});
}

// "<name>.old" of a step directory name: the step; -1 otherwise.
int64_t StepOfOldName(const std::string& name) {
  if (name.size() <= 4 || name.compare(name.size() - 4, 4, ".old") != 0) return -1;
  return StepOfDirName(name.substr(0, name.size() - 4));
}

std::string HostDescription() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat(host[0] ? host : "?", " pid ", static_cast<int64_t>(::getpid()));
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Whether `lease` is held by a coordinator other than `me` and not expired or released.
// A lease counts as live until skew_s after its expiry (the hosts' clocks may differ).
bool ForeignLive(const v1::CheckpointLease& lease, const std::string& me, double now,
                 double skew_s) {
  return !lease.coordinator().empty() && lease.coordinator() != me &&
         lease.expires() > 0 && lease.expires() + skew_s > now;
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

bool CheckpointStore::IsCommitted(const std::string& step_dir) {
  return Inspect(step_dir).state == ManifestState::kCommitted;
}

CheckpointStore::Inspection CheckpointStore::Inspect(const std::string& step_dir) {
  Inspection out;
  const std::string path = (fs::path(step_dir) / kManifestName).string();
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return out;  // kMissing
    out.state = ManifestState::kUnreadable;
    out.error = ErrnoError("lstat", path);
    return out;
  }
  auto m = ReadManifestFile(step_dir);  // also checks step == k for a directory step-<k>
  if (!m.ok()) {
    out.state = ManifestState::kUnreadable;
    out.error = m.status();
    return out;
  }
  out.state = ManifestState::kCommitted;
  out.manifest = std::move(*m);
  return out;
}

std::string CheckpointStore::StagingDir(int64_t step) const {
  return (fs::path(root_) / absl::StrCat(kStagingPrefix, StepDirName(step))).string();
}

absl::StatusOr<std::string> CheckpointStore::Prepare(int64_t step) const {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("checkpoint step ", step, " < 0"));
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  if (absl::Status s = CheckLeaseLocked(); !s.ok()) return s;
  std::string dir = StepDir(step);
  std::error_code ec;
  // Another job's committed old copy of this step (an interrupted replacement) is never touched.
  const Inspection old = Inspect(dir + ".old");
  if (old.state == ManifestState::kUnreadable) {
    LogKept(dir + ".old", std::string(old.error.message()));
    return absl::AlreadyExistsError(absl::StrCat(
        dir, ".old has a MANIFEST that cannot be read (", old.error.message(), "); job ", job_id_,
        " never writes beside a checkpoint it cannot identify"));
  }
  if (!job_id_.empty() && old.state == ManifestState::kCommitted &&
      old.manifest.job_id() != job_id_) {
    return absl::AlreadyExistsError(absl::StrCat(
        dir, ".old holds the committed checkpoint of job ", old.manifest.job_id(), "; job ",
        job_id_, " never writes into another job's step"));
  }
  const Inspection here = Inspect(dir);
  if (here.state == ManifestState::kUnreadable) {
    LogKept(dir, std::string(here.error.message()));
    return absl::AlreadyExistsError(absl::StrCat(
        dir, " has a MANIFEST that cannot be read (", here.error.message(), "); job ", job_id_,
        " never writes into a step directory it cannot identify"));
  }
  if (here.state == ManifestState::kCommitted) {
    if (!job_id_.empty() && here.manifest.job_id() != job_id_) {
      return absl::AlreadyExistsError(absl::StrCat(
          dir, " holds the committed checkpoint of job ", here.manifest.job_id(), "; job ", job_id_,
          " never writes into another job's step directory"));
    }
    // Committed already by this job: stage the new save beside it.
    dir = StagingDir(step);
    fs::remove_all(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", dir, ": ", ec.message()));
  } else if (!job_id_.empty() && fs::exists(dir, ec) && !Mine(dir)) {
    // Another job's unfinished save; that job no longer writes here (this one owns root).
    fs::remove_all(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", dir, ": ", ec.message()));
    LogLeftover(dir, "removed", "an earlier owner's unfinished save (no valid MANIFEST)");
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
  if (absl::Status s = CheckLeaseLocked(); !s.ok()) return s;
  if (!job_id_.empty() && m.job_id() != job_id_) {
    return absl::InvalidArgumentError(absl::StrCat("the MANIFEST of ", step_dir, " names job ",
                                                   m.job_id(), ", this store writes for ", job_id_));
  }
  std::error_code ec;
  // Staged when Prepare put the save beside a committed step-<k>. A staging directory left over
  // while step-<k> has no MANIFEST is stale: the save went into step-<k> itself.
  const Inspection current = Inspect(step_dir);
  const bool staged =
      current.state != ManifestState::kMissing && fs::is_directory(StagingDir(m.step()), ec);
  if (staged && (current.state != ManifestState::kCommitted ||
                 (!job_id_.empty() && current.manifest.job_id() != job_id_))) {
    // What the exchange would move aside and delete must be this job's committed checkpoint.
    return absl::FailedPreconditionError(absl::StrCat(
        step_dir, " is not a committed checkpoint of job ", job_id_, " (",
        current.state == ManifestState::kCommitted
            ? absl::StrCat("job ", current.manifest.job_id())
            : std::string(current.error.message()),
        "); the staged save in ", StagingDir(m.step()), " is not swapped in"));
  }
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
    const Inspection prior = Inspect(old);
    if (prior.state == ManifestState::kUnreadable ||
        (prior.state == ManifestState::kCommitted && !job_id_.empty() &&
         prior.manifest.job_id() != job_id_)) {
      return absl::FailedPreconditionError(
          absl::StrCat(old, " holds a checkpoint that is not job ", job_id_, "'s; not replaced"));
    }
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
      if (it->is_directory() && committed.count(leftover) && Mine(it->path().string()) &&
          Inspect(it->path().string()).state != ManifestState::kUnreadable)
        removed.push_back(it->path().string());
      continue;
    }
    const int64_t k = StepOfDirName(name);
    if (k < 0 || !it->is_directory()) continue;
    // Stale: an abandoned save (no MANIFEST at all); an unreadable one is never deleted.
    const bool stale = !committed.count(k) && k < newest &&
                       Inspect(it->path().string()).state == ManifestState::kMissing;
    if ((doomed.count(k) || stale) && Mine(it->path().string()))
      removed.push_back(it->path().string());
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", root_, ": ", ec.message()));
  std::sort(removed.begin(), removed.end());
  for (const std::string& d : removed) {
    if (absl::Status s = RemoveStepDir(d); !s.ok()) return s;
  }
  return removed;
}

absl::Status CheckpointStore::RemoveStepDir(const std::string& d) const {
  // The MANIFEST goes first (and durably), so a crash midway leaves an uncommitted directory,
  // never a committed one with missing files.
  std::error_code ec;
  const std::string manifest = (fs::path(d) / kManifestName).string();
  if (fs::exists(manifest, ec)) {
    fs::remove(manifest, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", manifest, ": ", ec.message()));
    if (absl::Status s = FsyncPath(d, true); !s.ok()) return s;
  }
  if (faults_ != nullptr) faults_->CrashPoint("retain.after_manifest_removed", d);
  std::vector<fs::path> entries;
  for (fs::directory_iterator it(d, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    entries.push_back(it->path());
  // JOB last: a half-removed directory still names the job that wrote it.
  std::sort(entries.begin(), entries.end(), [](const fs::path& a, const fs::path& b) {
    const bool ja = a.filename() == kStepJobFileName, jb = b.filename() == kStepJobFileName;
    return ja != jb ? jb : a < b;
  });
  bool first = true;
  for (const fs::path& e : entries) {
    fs::remove_all(e, ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", e.string(), ": ", ec.message()));
    if (first && faults_ != nullptr) faults_->CrashPoint("retain.mid_remove", d);
    first = false;
  }
  fs::remove_all(d, ec);
  if (ec) return absl::InternalError(absl::StrCat("remove ", d, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status CheckpointStore::CheckResumeCompatible(const v1::JobSpec& job,
                                                    const v1::JobSpec& saved_in,
                                                    const std::string& step_dir,
                                                    const std::string& field) {
  // A MANIFEST of an earlier release may hold a field in its old place or lack a default added
  // since: migrated as it is read.
  const v1::JobSpec saved = MigrateStoredSpec(saved_in);
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
  // A job with rowwise / blockwise blocks resumes a checkpoint whose blocks are all tensorwise
  // (train/checkpoint.h maps the tensors across the two layouts) or whose rowwise / blockwise
  // blocks are the same ones (the same layout): the precision plans are then
  // compared without the granularities, and, where the job has no tensorwise FP8 block, without
  // the tensorwise scaling fields (recipe, format, history, margin, fused projections), which
  // describe no state of it. Every other difference still refuses.
  // (Or, where the two lay the same blocks out as rowwise / blockwise, between those recipes.)
  bool same_scaled_blocks = job.model().n_layers() == saved.model().n_layers();
  for (int l = 0; same_scaled_blocks && l < job.model().n_layers(); ++l) {
    same_scaled_blocks = (LayerGranularity(job, l) == v1::FP8_GRANULARITY_TENSORWISE) ==
                         (LayerGranularity(saved, l) == v1::FP8_GRANULARITY_TENSORWISE);
  }
  if (AnyScaledGranularity(job) && (!AnyScaledGranularity(saved) || same_scaled_blocks)) {
    bool tensorwise_fp8 = false;
    for (int l = 0; l < job.model().n_layers(); ++l) {
      tensorwise_fp8 = tensorwise_fp8 ||
                       (LayerLinearPrecision(job, l) == v1::PRECISION_FP8 &&
                        LayerGranularity(job, l) == v1::FP8_GRANULARITY_TENSORWISE);
    }
    auto comparable = [&](const v1::PrecisionSpec& p) {
      v1::PrecisionSpec c = p;
      c.mutable_fp8()->clear_granularity();
      for (v1::LayerPrecision& lp : *c.mutable_overrides()) lp.clear_granularity();
      if (!tensorwise_fp8) {
        v1::Fp8Recipe* r = c.mutable_fp8();
        r->clear_recipe();
        r->clear_format();
        r->clear_amax_history_len();
        r->clear_amax_algorithm();
        r->clear_margin();
        r->clear_fused_projections();
      }
      return c;
    };
    return differ(comparable(job.precision()), comparable(saved.precision()), "precision");
  }
  return differ(job.precision(), saved.precision(), "precision");
}

absl::Status CheckpointStore::Abandon(int64_t step) const {
  auto lock = LockIf(!job_id_.empty(), root_);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  std::error_code ec;
  const ManifestState state = Inspect(StepDir(step)).state;
  if (state != ManifestState::kMissing) {
    // The failed save was staged (step-<k> is committed): drop only the staging directory, and
    // beside an unreadable step-<k> only an unfinished one.
    if (!Mine(StagingDir(step))) return absl::OkStatus();
    if (state == ManifestState::kUnreadable &&
        Inspect(StagingDir(step)).state != ManifestState::kMissing)
      return absl::OkStatus();
    fs::remove_all(StagingDir(step), ec);
    if (ec) return absl::InternalError(absl::StrCat("remove ", StagingDir(step), ": ", ec.message()));
    return absl::OkStatus();
  }
  const std::string dir = StepDir(step);
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
  // A temporary name of this writer alone (host, pid, a counter): where the flock is not honoured
  // (some network filesystems) two writers never share one, and a stale one is never reused.
  static std::atomic<uint64_t> counter{0};
  char host[64] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  const std::string tmp = absl::StrCat(path, ".tmp.", host[0] ? host : "host", ".",
                                       static_cast<int64_t>(::getpid()), ".", counter++);
  if (absl::Status s = WriteFileDurably(tmp, *text); !s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status err = ErrnoError("rename to", path);
    ::unlink(tmp.c_str());
    return err;
  }
  if (absl::Status s = FsyncPath(root_, true); !s.ok()) return s;
  // Read back: another writer's rename in between would leave its record, not this one.
  auto back = ReadOwnerFile(root_);
  if (!back.ok()) return back.status();
  if (!back->has_value() || (*back)->owner().job_id() != o.owner().job_id() ||
      (*back)->lease().coordinator() != o.lease().coordinator() ||
      (*back)->lease().expires() != o.lease().expires()) {
    return absl::AbortedError(absl::StrCat(
        path, " was rewritten by another writer at the same time (it names job ",
        back->has_value() ? (*back)->owner().job_id() : std::string("none"), ", not ",
        o.owner().job_id(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointStore::Claim(const v1::CheckpointOwnerEntry& claimant, bool take_over,
                                    const TakeOverCheck& may_take_over) const {
  ClaimOptions o;
  o.take_over = take_over;
  o.may_take_over = may_take_over;
  return Claim(claimant, o);
}

absl::Status CheckpointStore::Claim(const v1::CheckpointOwnerEntry& claimant,
                                    const ClaimOptions& options) const {
  auto lock = DirLock::Acquire(root_, /*create_root=*/true);
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
  const v1::CheckpointLease& lease = next.lease();
  const double now = WallSeconds();
  const bool same_coordinator = lease.coordinator().empty() || options.coordinator.empty() ||
                                lease.coordinator() == options.coordinator;
  if (old.job_id() == claimant.job_id() && same_coordinator) return absl::OkStatus();
  if (!old.job_id().empty()) {
    if (!options.take_over) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir: ", root_, " belongs to ", Describe(old),
          "; a checkpoint directory holds one job's checkpoints: choose another checkpoint.dir "
          "(init.from_checkpoint starts from one of its checkpoints), or set "
          "checkpoint.take_over: true once ", old.job_id(), " has ended or was deleted"));
    }
    if (ForeignLive(lease, options.coordinator, now, options.clock_skew_s)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.take_over: checkpoint.dir ", root_, " belongs to ", Describe(old),
          ", which runs under another coordinator (", lease.host(), "; its lease was renewed ",
          static_cast<int64_t>(now - lease.renewed()), " s ago and expires in ",
          static_cast<int64_t>(lease.expires() - now) + 1,
          " s); a directory is taken over only once its owner has ended"));
    }
    // Our own job, or one without a live lease elsewhere: the caller's job table decides.
    if (options.may_take_over && (lease.coordinator().empty() || same_coordinator)) {
      if (absl::Status s = options.may_take_over(old); !s.ok()) return s;
    }
    if (options.last_save >= 0) {
      int64_t after = options.saves_after;
      if (options.saves_after_latest) {
        auto latest = Latest();
        if (!latest.ok()) return latest.status();
        if (latest->has_value()) after = std::max(after, (*latest)->step);
      }
      // The final save is never skipped: a job whose last step is another job's would end
      // without its final state.
      const std::vector<std::string> final_hit = CollisionsLocked(
          claimant.job_id(), std::max(after, options.last_save - 1), options.last_save);
      if (!final_hit.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint.take_over: checkpoint.dir ", root_, ": the final step ", options.last_save,
            " (training.steps) is taken: ", absl::StrJoin(final_hit, ", "),
            " holds a checkpoint that is never replaced, so this job's final save would be "
            "skipped and its final state lost; set checkpoint.resume_from: latest (continue "
            "after the newest checkpoint), raise training.steps above ", options.last_save,
            ", or choose another checkpoint.dir"));
      }
      if (options.skipped != nullptr)
        *options.skipped = CollisionsLocked(claimant.job_id(), after, options.last_save);
    }
    v1::CheckpointOwnerEntry* prev = next.add_previous();
    *prev = old;
    prev->set_until(claimant.since());
  }
  *next.mutable_owner() = claimant;
  next.clear_lease();
  if (!options.coordinator.empty()) {
    v1::CheckpointLease* l = next.mutable_lease();
    l->set_coordinator(options.coordinator);
    l->set_host(HostDescription());
    l->set_renewed(now);
    l->set_expires(now + options.lease_s);
  }
  return WriteOwnerLocked(next);
}

std::vector<std::string> CheckpointStore::CollisionsLocked(const std::string& job, int64_t after,
                                                           int64_t last) const {
  std::vector<std::pair<int64_t, std::string>> hit;
  std::error_code ec;
  for (fs::directory_iterator it(root_, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const int64_t k = std::max(StepOfDirName(name), StepOfOldName(name));
    if (k < 0 || k <= after || k > last || !it->is_directory(ec)) continue;
    // One without MANIFEST is a leftover, removed by the save of that step (Prepare); an
    // unreadable one, or another job's old copy, makes Prepare skip the step too.
    const Inspection in = Inspect(it->path().string());
    if (in.state == ManifestState::kMissing) continue;
    if (in.state == ManifestState::kUnreadable) {
      hit.push_back({k, absl::StrCat(name, " (unreadable MANIFEST)")});
      continue;
    }
    const std::string& writer = in.manifest.job_id();
    if (writer == job) continue;
    hit.push_back({k, absl::StrCat(name, " (job ", writer.empty() ? "unknown" : writer, ")")});
  }
  std::sort(hit.begin(), hit.end());
  std::vector<std::string> out;
  for (auto& h : hit) out.push_back(std::move(h.second));
  return out;
}

absl::StatusOr<bool> CheckpointStore::RenewLease(const std::string& job_id,
                                                 const std::string& coordinator,
                                                 double lease_s) const {
  auto lock = DirLock::Acquire(root_);
  if (!lock.ok()) return lock.status();
  return RenewLeaseLocked(job_id, coordinator, lease_s);
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::ResumeAndRemoveLeftovers(
    const std::string& coordinator, double lease_s) const {
  if (job_id_.empty())
    return absl::InvalidArgumentError("ResumeAndRemoveLeftovers needs a store with a job id");
  auto lock = DirLock::Acquire(root_);
  if (!lock.ok()) return lock.status();
  if (lease_s > 0) {
    auto renewed = RenewLeaseLocked(job_id_, coordinator, lease_s);
    if (!renewed.ok()) return renewed.status();
    if (!*renewed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir ", root_, ": job ", job_id_,
          " no longer holds it (another job owns it, another coordinator leases it, or it has "
          "no OWNER record); its leftovers are left to its owner"));
    }
  }
  if (absl::Status s = CheckOwnedLocked(); !s.ok()) return s;
  return RemoveLeftoversLocked();
}

absl::StatusOr<bool> CheckpointStore::RenewLeaseLocked(const std::string& job_id,
                                                       const std::string& coordinator,
                                                       double lease_s) const {
  auto record = ReadOwnerFile(root_);
  if (!record.ok()) return record.status();
  if (!record->has_value()) return false;
  v1::CheckpointDirOwner o = **record;
  if (o.owner().job_id() != job_id) return false;
  if (!o.lease().coordinator().empty() && o.lease().coordinator() != coordinator) return false;
  const double now = WallSeconds();
  v1::CheckpointLease* l = o.mutable_lease();
  l->set_coordinator(coordinator);
  l->set_host(HostDescription());
  l->set_renewed(now);
  l->set_expires(now + lease_s);
  if (absl::Status s = WriteOwnerLocked(o); !s.ok()) return s;
  return true;
}

absl::StatusOr<bool> CheckpointStore::ReleaseLease(const std::string& job_id,
                                                   const std::string& coordinator) const {
  auto lock = DirLock::Acquire(root_);
  if (!lock.ok()) return lock.status();
  auto record = ReadOwnerFile(root_);
  if (!record.ok()) return record.status();
  if (!record->has_value()) return false;
  v1::CheckpointDirOwner o = **record;
  if (o.owner().job_id() != job_id || o.lease().coordinator() != coordinator) return false;
  if (o.lease().expires() == 0) return true;
  o.mutable_lease()->set_expires(0);
  o.mutable_lease()->set_renewed(WallSeconds());
  if (absl::Status s = WriteOwnerLocked(o); !s.ok()) return s;
  return true;
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::RemoveLeftovers() const {
  std::error_code ec;
  if (!fs::exists(root_, ec)) return std::vector<std::string>();
  auto lock = DirLock::Acquire(root_);
  if (!lock.ok()) return lock.status();
  if (job_id_.empty()) {
    // No ownership to check: never while the owner's coordinator may be saving.
    auto record = ReadOwnerFile(root_);
    if (!record.ok()) return record.status();
    if (record->has_value() && (*record)->lease().expires() > WallSeconds()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir ", root_, ": job ", (*record)->owner().job_id(),
          " holds a live lease (coordinator ", (*record)->lease().host(),
          "); its leftovers are removed only by that job's store"));
    }
  } else if (absl::Status s = CheckOwnedLocked(); !s.ok()) {
    return s;
  }
  return RemoveLeftoversLocked();
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::RemoveLeftoversLocked() const {
  std::vector<std::string> done;
  std::error_code ec;
  std::vector<fs::path> olds, staging, steps;
  for (fs::directory_iterator it(root_, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    const std::string name = it->path().filename().string();
    if (name.rfind(kStagingPrefix, 0) == 0 &&
        StepOfDirName(name.substr(sizeof(kStagingPrefix) - 1)) >= 0) {
      staging.push_back(it->path());
    } else if (StepOfOldName(name) >= 0) {
      olds.push_back(it->path());
    } else if (StepOfDirName(name) >= 0) {
      steps.push_back(it->path());
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", root_, ": ", ec.message()));
  auto remove = [&](const fs::path& p, const std::string& why) -> absl::Status {
    if (absl::Status s = RemoveStepDir(p.string()); !s.ok()) return s;
    LogLeftover(p.string(), "removed", why);
    done.push_back(p.string());
    return absl::OkStatus();
  };
  auto unreadable = [](const Inspection& in) {
    return absl::StrCat("MANIFEST unreadable, kept: ", in.error.message());
  };
  // Old copies first (an exchange without renameat2 interrupted): the committed one of a step.
  for (const fs::path& old : olds) {
    const std::string name = old.filename().string();
    const fs::path step = fs::path(root_) / name.substr(0, name.size() - 4);
    const Inspection o = Inspect(old.string());
    const Inspection k = Inspect(step.string());
    if (o.state == ManifestState::kUnreadable) {
      LogKept(old.string(), unreadable(o));
    } else if (o.state == ManifestState::kMissing) {
      if (absl::Status s = remove(old, "no MANIFEST"); !s.ok()) return s;
    } else if (k.state == ManifestState::kCommitted) {
      // Only an old copy of the same job's step: another job's is its only copy of that step.
      if (o.manifest.job_id() == k.manifest.job_id()) {
        if (absl::Status s = remove(old, "an old copy of a step committed again"); !s.ok())
          return s;
      } else {
        LogKept(old.string(), absl::StrCat("the committed checkpoint of job ", o.manifest.job_id(),
                                           " beside ", step.string(), " of job ",
                                           k.manifest.job_id()));
      }
    } else if (k.state == ManifestState::kUnreadable) {
      LogKept(old.string(), absl::StrCat(step.string(), ": ", unreadable(k)));
    } else {
      if (fs::exists(step, ec)) {
        if (absl::Status s = remove(step, "no MANIFEST; its old copy is restored"); !s.ok())
          return s;
      }
      if (::rename(old.c_str(), step.c_str()) != 0) return ErrnoError("rename to", step.string());
      if (absl::Status s = FsyncPath(root_, true); !s.ok()) return s;
      LogLeftover(old.string(), "restored", absl::StrCat("the only committed copy, renamed back to ",
                                                         step.string()));
      done.push_back(old.string());
    }
  }
  for (const fs::path& st : staging) {
    const std::string name = st.filename().string();
    const fs::path step = fs::path(root_) / name.substr(sizeof(kStagingPrefix) - 1);
    const Inspection in = Inspect(st.string());
    if (in.state == ManifestState::kMissing) {
      if (absl::Status s = remove(st, "an unfinished staged save"); !s.ok()) return s;
    } else if (in.state == ManifestState::kUnreadable) {
      LogKept(st.string(), unreadable(in));
    } else if (const Inspection k = Inspect(step.string());
               k.state == ManifestState::kCommitted && k.manifest.job_id() == in.manifest.job_id()) {
      if (absl::Status s = remove(st, "a staged save beside a committed step"); !s.ok()) return s;
    }
  }
  for (const fs::path& step : steps) {
    if (!fs::exists(step, ec)) continue;
    const Inspection in = Inspect(step.string());
    if (in.state == ManifestState::kUnreadable) {
      LogKept(step.string(), unreadable(in));
      continue;
    }
    if (in.state != ManifestState::kMissing) continue;
    if (absl::Status s = remove(step, "no MANIFEST (an interrupted save or retention)"); !s.ok())
      return s;
  }
  return done;
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
  const double now = WallSeconds();
  o.mutable_owner()->set_since(now);
  if (!lease_.coordinator.empty()) {
    // Never an OWNER without the lease of the coordinator that runs the job.
    v1::CheckpointLease* l = o.mutable_lease();
    l->set_coordinator(lease_.coordinator);
    l->set_host(HostDescription());
    l->set_renewed(now);
    l->set_expires(now + lease_.lease_s);
  }
  return WriteOwnerLocked(o);
}

absl::Status CheckpointStore::CheckLeaseLocked() const {
  if (lease_.coordinator.empty() || job_id_.empty()) return absl::OkStatus();
  auto record = ReadOwnerFile(root_);
  if (!record.ok()) return record.status();
  const double now = WallSeconds();
  const v1::CheckpointLease lease =
      record->has_value() ? (*record)->lease() : v1::CheckpointLease();
  if (lease.coordinator() == lease_.coordinator && lease.expires() - now > lease_.margin_s)
    return absl::OkStatus();
  const std::string holder =
      lease.coordinator().empty()
          ? std::string("no coordinator")
          : (lease.coordinator() == lease_.coordinator ? std::string("this coordinator")
                                                       : absl::StrCat("another coordinator (",
                                                                      lease.host(), ")"));
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.dir ", root_, ": the lease of job ", job_id_, " is held by ", holder,
      " and expires in ", static_cast<int64_t>(lease.expires() - now), " s (a save needs more than ",
      static_cast<int64_t>(lease_.margin_s), " s left); not saving while it may lapse"));
}

bool CheckpointStore::Mine(const std::string& step_dir) const {
  return job_id_.empty() || StepDirJob(step_dir) == job_id_;
}

}  // namespace fsdp8::coord
