// JobStore: the coordinator's persistent job table, one SQLite database in WAL mode.
//
// Each row holds the job's identifying and summary columns (job_id, request_id, state, reason, step,
// total_steps, create_time, last event seq) plus the whole v1::Job and its submitted spec as
// serialized protobuf blobs. A second table holds each job's newest events (v1::JobEvent blobs by
// job and seq), so that a watch after a coordinator restart still gets the job's history. Writes
// use synchronous=NORMAL, so persisting every step is cheap.
//
// Thread-safety: all methods are safe to call from several threads (one internal mutex, whose use
// clang's -Wthread-safety checks: the connection is ABSL_GUARDED_BY it).
// Errors: INTERNAL with SQLite's message (and the database path) on any SQLite failure.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "fsdp8/v1/jobs.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace fsdp8::coord {

class JobStore {
 public:
  struct Row {
    v1::Job job;
    int64_t last_seq = 0;  // seq of the job's last published event
  };

  // Opens (creating when absent) the database at `path`; ":memory:" keeps it in memory.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Inserts or replaces the job's row and stores its new `event` (its job_id and seq name it; a
  // stored event of that seq is replaced) in one transaction, keeping the job's newest
  // `keep_events` (>= 1) events: older ones are removed every kTrimEvery events, so at most
  // keep_events + kTrimEvery - 1 are stored at a time.
  absl::Status Put(const v1::Job& job, int64_t last_seq, const v1::JobEvent& event,
                   int64_t keep_events);
  // Removes the job's row and its events in one transaction (OK when there are none).
  absl::Status Delete(const std::string& job_id);
  // The job's stored events with after_seq < seq < before_seq, in seq order. DATA_LOSS naming the
  // event for a row that does not parse.
  absl::StatusOr<std::vector<v1::JobEvent>> Events(const std::string& job_id, int64_t after_seq,
                                                   int64_t before_seq);
  static constexpr int64_t kTrimEvery = 64;
  // Every job, oldest first (by create_time, then job_id).
  absl::StatusOr<std::vector<Row>> LoadAll();
  // This database's coordinator identity ("coord-" and 16 hex digits): made once, at random, and
  // kept in the table `meta`, so a coordinator restarted on the same state db has the same one
  // (it names the coordinator in checkpoint directory leases, coordinator/checkpoint_store.h).
  absl::StatusOr<std::string> CoordinatorId();

 private:
  JobStore(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs a statement that returns no rows, `bind` binding its parameters; `what` names it in
  // errors.
  absl::Status Run(const char* sql, const char* what,
                   const std::function<void(sqlite3_stmt*)>& bind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `body` in one transaction, rolled back when it fails.
  absl::Status Transaction(const std::function<absl::Status()>& body)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteJobRow(const v1::Job& job, int64_t last_seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteEvent(const v1::JobEvent& ev, int64_t keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);  // every use of the connection holds mu_
  std::string path_;
};

}  // namespace fsdp8::coord
