// The workers the coordinator knows: who they are (job, rank, host, pid) and whether they are
// alive. Any RPC from a worker counts as a heartbeat; a worker silent for longer than the
// timeout is declared dead by Expire() (its task goes back to the queue). A worker declared dead
// that speaks again is alive again (it was only slow).
//
// Not thread-safe: the JobManager calls it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/clock.h"
#include "proto/qcal.pb.h"

namespace qcal::coordinator {

struct WorkerInfo {
  std::string worker_id;
  std::string job_id;
  int rank = 0;
  int world_size = 0;
  std::string hostname;
  int64_t pid = 0;
  std::string device;
  double registered_at = 0;  // Clock::MonotonicSeconds
  double last_seen = 0;
  bool alive = true;
};

class WorkerPool {
 public:
  // `clock` must outlive the registry. timeout_s > 0.
  WorkerPool(const Clock* clock, double timeout_s) : clock_(clock), timeout_s_(timeout_s) {}

  // InvalidArgument for a rank outside [0, world_size); AlreadyExists when a live worker holds
  // the same (job, rank). A dead worker of that rank is replaced.
  StatusOr<WorkerInfo> Register(const v1::RegisterWorkerRequest& request);
  // Marks the worker seen now (and alive). NotFound for an unknown id.
  StatusOr<WorkerInfo> Touch(const std::string& worker_id);
  // The workers whose silence exceeded the timeout, now marked dead (each reported once).
  std::vector<WorkerInfo> Expire();
  const WorkerInfo* Find(const std::string& worker_id) const;
  int AliveCount(const std::string& job_id) const;
  std::vector<WorkerInfo> OfJob(const std::string& job_id) const;
  // Forgets the workers of a job (once its worker processes are gone).
  void RemoveJob(const std::string& job_id);
  double timeout_s() const { return timeout_s_; }

 private:
  const Clock* clock_;
  double timeout_s_;
  int64_t next_serial_ = 1;
  std::map<std::string, WorkerInfo> workers_;
};

}  // namespace qcal::coordinator
