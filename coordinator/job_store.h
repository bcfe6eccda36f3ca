// The job store: every job the coordinator accepted, persisted under STATE/jobs/<id>.json (the
// qcal.v1.Job message as protobuf JSON, written atomically on every state, phase or block change)
// so a restarted coordinator still knows every job.
//
// Not thread-safe: the JobManager serializes access under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/state_fs.h"
#include "proto/qcal.pb.h"

namespace qcal::coordinator {

class JobStore {
 public:
  // Creates STATE/jobs if needed and loads every record in it. A record that does not parse is
  // skipped and named in load_warnings() (the coordinator still starts); any other I/O error
  // fails. `fs` must outlive the store.
  static StatusOr<std::unique_ptr<JobStore>> Open(StateFs* fs, const std::string& state_dir);

  // Writes the record, then updates the in-memory copy (so memory never runs ahead of disk).
  Status Put(const v1::Job& job);
  // nullptr when unknown.
  const v1::Job* Find(const std::string& job_id) const;
  // Every job, oldest first.
  std::vector<v1::Job> List() const;
  // A fresh id ("job-000042"), larger than every id ever stored here.
  std::string NewJobId();

  const std::vector<std::string>& load_warnings() const { return load_warnings_; }
  std::string RecordPath(const std::string& job_id) const;

 private:
  JobStore(StateFs* fs, std::string dir) : fs_(fs), dir_(std::move(dir)) {}
  static int64_t IdNumber(const std::string& job_id);  // -1 when not "job-<digits>"

  StateFs* fs_;
  std::string dir_;  // STATE/jobs
  std::map<int64_t, v1::Job> jobs_;  // by id number: creation order
  int64_t last_id_ = 0;
  std::vector<std::string> load_warnings_;
};

}  // namespace qcal::coordinator
