#include "coordinator/worker_pool.h"

#include "absl/strings/str_cat.h"

namespace qcal::coordinator {

StatusOr<WorkerInfo> WorkerPool::Register(const v1::RegisterWorkerRequest& r) {
  if (r.world_size() < 1 || r.rank() < 0 || r.rank() >= r.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank(), " is outside a world of ",
                                                   r.world_size()));
  }
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    const WorkerInfo& w = it->second;
    if (w.job_id == r.job_id() && w.rank == r.rank()) {
      if (w.alive) {
        return absl::AlreadyExistsError(absl::StrCat(
            "job ", r.job_id(), " already has a live rank ", r.rank(), " (worker ", w.worker_id,
            ", pid ", w.pid, " on ", w.hostname, ")"));
      }
      workers_.erase(it);
      break;
    }
  }
  WorkerInfo w;
  w.worker_id = absl::StrCat(r.job_id(), "/r", r.rank(), ".", next_serial_++);
  w.job_id = r.job_id();
  w.rank = r.rank();
  w.world_size = r.world_size();
  w.hostname = r.hostname();
  w.pid = r.pid();
  w.device = r.device();
  w.registered_at = w.last_seen = clock_->MonotonicSeconds();
  workers_[w.worker_id] = w;
  return w;
}

StatusOr<WorkerInfo> WorkerPool::Touch(const std::string& worker_id) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker '", worker_id,
                                            "' (register first; the job may have ended)"));
  }
  it->second.last_seen = clock_->MonotonicSeconds();
  it->second.alive = true;
  return it->second;
}

std::vector<WorkerInfo> WorkerPool::Expire() {
  std::vector<WorkerInfo> dead;
  const double now = clock_->MonotonicSeconds();
  for (auto& [id, w] : workers_) {
    if (w.alive && now - w.last_seen > timeout_s_) {
      w.alive = false;
      dead.push_back(w);
    }
  }
  return dead;
}

const WorkerInfo* WorkerPool::Find(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

int WorkerPool::AliveCount(const std::string& job_id) const {
  int n = 0;
  for (const auto& [id, w] : workers_) n += (w.job_id == job_id && w.alive) ? 1 : 0;
  return n;
}

std::vector<WorkerInfo> WorkerPool::OfJob(const std::string& job_id) const {
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    if (w.job_id == job_id) out.push_back(w);
  }
  return out;
}

void WorkerPool::RemoveJob(const std::string& job_id) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    it = it->second.job_id == job_id ? workers_.erase(it) : std::next(it);
  }
}

}  // namespace qcal::coordinator
