// JobStore: the coordinator's persistent job table, one SQLite database in WAL mode.
//
// Each row holds the job's identifying and summary columns (job_id, request_id, state, reason, step,
// total_steps, create_time, last event seq) plus the whole v1::Job and its submitted spec as
// serialized protobuf blobs. Writes use synchronous=NORMAL, so persisting every step is cheap.
//
// Thread-safety: all methods are safe to call from several threads (one internal mutex).
// Errors: INTERNAL with SQLite's message (and the database path) on any SQLite failure.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp8/v1/jobs.pb.h"

struct sqlite3;

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

  // Inserts or replaces the job's row.
  absl::Status Put(const v1::Job& job, int64_t last_seq);
  // Removes the job's row (OK when there is none).
  absl::Status Delete(const std::string& job_id);
  // Every job, oldest first (by create_time, then job_id).
  absl::StatusOr<std::vector<Row>> LoadAll();

 private:
  JobStore(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  absl::Status Exec(const char* sql);
  absl::Status Error(const char* what);

  std::mutex mu_;
  sqlite3* db_;
  std::string path_;
};

}  // namespace fsdp8::coord
