#include "coordinator/job_store.h"

#include <sqlite3.h>

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp8::coord {

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    if (db) sqlite3_close(db);
    return absl::InternalError(absl::StrCat("state db ", path, ": cannot open: ", msg));
  }
  std::unique_ptr<JobStore> store(new JobStore(db, path));
  absl::MutexLock lock(&store->mu_);  // no other thread has the store yet
  sqlite3_busy_timeout(db, 5000);
  if (path != ":memory:") {
    if (auto s = store->Exec("PRAGMA journal_mode=WAL"); !s.ok()) return s;
  }
  if (auto s = store->Exec("PRAGMA synchronous=NORMAL"); !s.ok()) return s;
  if (auto s = store->Exec(
          "CREATE TABLE IF NOT EXISTS jobs ("
          " job_id TEXT PRIMARY KEY,"
          " request_id TEXT NOT NULL,"
          " state INTEGER NOT NULL,"
          " reason TEXT NOT NULL,"
          " step INTEGER NOT NULL,"
          " total_steps INTEGER NOT NULL,"
          " create_time REAL NOT NULL,"
          " last_seq INTEGER NOT NULL,"
          " spec BLOB NOT NULL,"
          " job BLOB NOT NULL)");
      !s.ok())
    return s;
  if (auto s = store->Exec("CREATE INDEX IF NOT EXISTS jobs_request_id ON jobs(request_id)");
      !s.ok())
    return s;
  if (auto s = store->Exec(
          "CREATE TABLE IF NOT EXISTS events ("
          " job_id TEXT NOT NULL,"
          " seq INTEGER NOT NULL,"
          " event BLOB NOT NULL,"
          " PRIMARY KEY (job_id, seq)) WITHOUT ROWID");
      !s.ok())
    return s;
  if (auto s = store->Exec("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)");
      !s.ok())
    return s;
  // Events of jobs no longer in the table (a deletion by an earlier version of this file).
  if (auto s = store->Exec("DELETE FROM events WHERE job_id NOT IN (SELECT job_id FROM jobs)");
      !s.ok())
    return s;
  return store;
}

JobStore::~JobStore() {
  if (db_) sqlite3_close(db_);
}

absl::Status JobStore::Error(const char* what) {
  return absl::InternalError(
      absl::StrCat("state db ", path_, ": ", what, ": ", sqlite3_errmsg(db_)));
}

absl::Status JobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("state db ", path_, ": ", sql, ": ", msg));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<JobStore::Row>> JobStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db_, "SELECT job_id, last_seq, job FROM jobs ORDER BY create_time, job_id",
                         -1, &st, nullptr) != SQLITE_OK)
    return Error("prepare");
  std::vector<Row> rows;
  int rc;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    Row row;
    row.last_seq = sqlite3_column_int64(st, 1);
    const void* data = sqlite3_column_blob(st, 2);
    int n = sqlite3_column_bytes(st, 2);
    if (!row.job.ParseFromArray(data, n)) {
      std::string id = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
      sqlite3_finalize(st);
      return absl::DataLossError(absl::StrCat("state db ", path_, ": job ", id, ": corrupt row"));
    }
    rows.push_back(std::move(row));
  }
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return Error("read jobs");
  return rows;
}

absl::StatusOr<std::string> JobStore::CoordinatorId() {
  absl::MutexLock lock(&mu_);
  std::random_device rd;
  char buf[24];
  snprintf(buf, sizeof(buf), "coord-%08x%08x", rd(), rd());
  const std::string fresh = buf;
  absl::Status s = Run("INSERT OR IGNORE INTO meta (key, value) VALUES ('coordinator_id', ?)",
                       "storing the coordinator id", [&](sqlite3_stmt* st) {
                         sqlite3_bind_text(st, 1, fresh.c_str(), -1, SQLITE_TRANSIENT);
                       });
  if (!s.ok()) return s;
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db_, "SELECT value FROM meta WHERE key = 'coordinator_id'", -1, &st,
                         nullptr) != SQLITE_OK)
    return Error("prepare");
  std::string id;
  if (sqlite3_step(st) == SQLITE_ROW)
    id = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  sqlite3_finalize(st);
  if (id.empty()) return Error("reading the coordinator id");
  return id;
}

absl::Status JobStore::Run(const char* sql, const char* what,
                           const std::function<void(sqlite3_stmt*)>& bind) {
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) return Error("prepare");
  bind(st);
  int rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != SQLITE_DONE) return Error(what);
  return absl::OkStatus();
}

absl::Status JobStore::Transaction(const std::function<absl::Status()>& body) {
  if (auto s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  absl::Status s = body();
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) (void)Exec("ROLLBACK");
  return s;
}

absl::Status JobStore::WriteJobRow(const v1::Job& job, int64_t last_seq) {
  const std::string spec = job.spec().SerializeAsString();
  const std::string blob = job.SerializeAsString();
  return Run("INSERT OR REPLACE INTO jobs (job_id, request_id, state, reason, step, total_steps,"
             " create_time, last_seq, spec, job) VALUES (?,?,?,?,?,?,?,?,?,?)",
             "write job", [&](sqlite3_stmt* st) {
               sqlite3_bind_text(st, 1, job.job_id().c_str(), -1, SQLITE_TRANSIENT);
               sqlite3_bind_text(st, 2, job.request_id().c_str(), -1, SQLITE_TRANSIENT);
               sqlite3_bind_int(st, 3, job.state());
               sqlite3_bind_text(st, 4, job.reason().c_str(), -1, SQLITE_TRANSIENT);
               sqlite3_bind_int64(st, 5, job.step());
               sqlite3_bind_int64(st, 6, job.total_steps());
               sqlite3_bind_double(st, 7, job.create_time());
               sqlite3_bind_int64(st, 8, last_seq);
               sqlite3_bind_blob(st, 9, spec.data(), static_cast<int>(spec.size()),
                                 SQLITE_TRANSIENT);
               sqlite3_bind_blob(st, 10, blob.data(), static_cast<int>(blob.size()),
                                 SQLITE_TRANSIENT);
             });
}

absl::Status JobStore::WriteEvent(const v1::JobEvent& ev, int64_t keep) {
  const std::string blob = ev.SerializeAsString();
  absl::Status s = Run("INSERT OR REPLACE INTO events (job_id, seq, event) VALUES (?,?,?)",
                       "write event", [&](sqlite3_stmt* st) {
                         sqlite3_bind_text(st, 1, ev.job_id().c_str(), -1, SQLITE_TRANSIENT);
                         sqlite3_bind_int64(st, 2, ev.seq());
                         sqlite3_bind_blob(st, 3, blob.data(), static_cast<int>(blob.size()),
                                           SQLITE_TRANSIENT);
                       });
  // Trimmed every kTrimEvery events: at most keep + kTrimEvery - 1 are stored.
  if (!s.ok() || ev.seq() <= keep || ev.seq() % kTrimEvery != 0) return s;
  return Run("DELETE FROM events WHERE job_id = ? AND seq <= ?", "trim events",
             [&](sqlite3_stmt* st) {
               sqlite3_bind_text(st, 1, ev.job_id().c_str(), -1, SQLITE_TRANSIENT);
               sqlite3_bind_int64(st, 2, ev.seq() - keep);
             });
}

absl::Status JobStore::Put(const v1::Job& job, int64_t last_seq, const v1::JobEvent& event,
                           int64_t keep_events) {
  absl::MutexLock lock(&mu_);
  return Transaction([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto s = WriteEvent(event, keep_events); !s.ok()) return s;
    return WriteJobRow(job, last_seq);
  });
}

absl::Status JobStore::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto bind_id = [&](sqlite3_stmt* st) {
    sqlite3_bind_text(st, 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
  };
  return Transaction([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto s = Run("DELETE FROM jobs WHERE job_id = ?", "delete job", bind_id); !s.ok()) return s;
    return Run("DELETE FROM events WHERE job_id = ?", "delete job events", bind_id);
  });
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::Events(const std::string& job_id,
                                                           int64_t after_seq, int64_t before_seq) {
  std::vector<std::pair<int64_t, std::string>> blobs;  // (seq, serialized event)
  {
    absl::MutexLock lock(&mu_);
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_,
                           "SELECT seq, event FROM events WHERE job_id = ? AND seq > ? AND seq < ?"
                           " ORDER BY seq",
                           -1, &st, nullptr) != SQLITE_OK)
      return Error("prepare");
    sqlite3_bind_text(st, 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 2, after_seq);
    sqlite3_bind_int64(st, 3, before_seq);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
      const char* data = static_cast<const char*>(sqlite3_column_blob(st, 1));
      const int n = sqlite3_column_bytes(st, 1);
      blobs.emplace_back(sqlite3_column_int64(st, 0),
                         n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string());
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return Error("read events");
  }
  std::vector<v1::JobEvent> out(blobs.size());
  for (size_t i = 0; i < blobs.size(); ++i) {
    if (!out[i].ParseFromString(blobs[i].second)) {
      return absl::DataLossError(absl::StrCat("state db ", path_, ": job ", job_id, ": event ",
                                              blobs[i].first, ": corrupt row"));
    }
  }
  return out;
}

}  // namespace fsdp8::coord
