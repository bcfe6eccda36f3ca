// JobManager's JobService calls (job_manager.h): submit, get, list, cancel, watch.
#include "coordinator/job_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/validation.h"
#include "rpc/job_state.h"

namespace qcal::coordinator {

StatusOr<std::string> JobManager::Submit(v1::JobSpec spec) {
  QCAL_ASSIGN_OR_RETURN(Recipe recipe, ValidateJobSpec(&spec));
  Lock lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the coordinator is shutting down");
  if (!started_) return absl::UnavailableError("the coordinator is not started");
  const std::string job_dir = JobDirOf(spec);
  for (const auto& [id, other] : jobs_) {
    if (IsFinalState(other->job.state())) continue;
    const v1::JobSpec& o = other->job.spec();
    if (o.out_dir() == spec.out_dir() || JobDirOf(o) == job_dir) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", id, " (", JobStateName(other->job.state()), ") already writes ",
          o.out_dir() == spec.out_dir() ? "out_dir '" + spec.out_dir() : "job_dir '" + job_dir,
          "'; cancel it or wait for it to end"));
    }
  }
  auto rt = std::make_shared<JobRuntime>();
  rt->recipe = std::move(recipe);
  rt->workspace = workspaces_();
  v1::Job& job = rt->job;
  job.set_id(store_->NewJobId());
  *job.mutable_spec() = spec;
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_phase(kPhasePlan);
  job.set_created_unix(clock_->UnixSeconds());
  job.set_updated_unix(job.created_unix());
  job.set_eta_seconds(-1);
  QCAL_RETURN_IF_ERROR(store_->Put(job));
  jobs_[job.id()] = rt;
  rt->phase_started_at = clock_->MonotonicSeconds();
  EmitLocked(*rt, v1::JOB_EVENT_KIND_STATE, "QUEUED");
  QCAL_LOG_INFO("job {}: submitted ({} -> {}, {} worker(s))", job.id(), spec.model_dir(),
                spec.out_dir(), spec.workers());
  rt->driver = std::thread([this, rt] { Drive(rt); });
  return job.id();
}

StatusOr<v1::Job> JobManager::Get(const std::string& job_id) {
  Lock lock(mu_);
  std::shared_ptr<JobRuntime> rt = FindLocked(job_id);
  if (!rt) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  return rt->job;
}

std::vector<v1::Job> JobManager::List() {
  Lock lock(mu_);
  std::vector<v1::Job> out;
  out.reserve(jobs_.size());
  for (const v1::Job& job : store_->List()) {
    std::shared_ptr<JobRuntime> rt = FindLocked(job.id());
    out.push_back(rt ? rt->job : job);
  }
  return out;
}

StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id) {
  Lock lock(mu_);
  std::shared_ptr<JobRuntime> rt = FindLocked(job_id);
  if (!rt) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  if (!IsFinalState(rt->job.state())) {
    SetStateLocked(*rt, v1::JOB_STATE_CANCELLED, "");
    monitor_cv_.notify_all();
  }
  return rt->job;
}

Status JobManager::Watch(const std::string& job_id, int64_t after_seq,
                         const std::function<bool(const v1::JobEvent&)>& send,
                         const std::function<bool()>& cancelled) {
  Lock lock(mu_);
  std::shared_ptr<JobRuntime> rt = FindLocked(job_id);
  if (!rt) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  int64_t last = std::max<int64_t>(after_seq, 0);
  std::vector<v1::JobEvent> batch;
  while (true) {
    batch.clear();
    if (!rt->events.empty() && rt->events.back().seq() > last) {
      const int64_t first = rt->events.front().seq();
      for (size_t i = static_cast<size_t>(std::max<int64_t>(0, last + 1 - first));
           i < rt->events.size(); ++i) {
        batch.push_back(rt->events[i]);
      }
    }
    if (batch.empty()) {
      if (IsFinalState(rt->job.state())) return absl::OkStatus();
      if (shutting_down_) return absl::UnavailableError("the coordinator is shutting down");
      rt->cv.wait_for(lock, std::chrono::milliseconds(250));
      if (cancelled && cancelled()) return absl::CancelledError("the watcher went away");
      continue;
    }
    lock.unlock();
    for (const v1::JobEvent& e : batch) {
      if (!send(e)) return absl::CancelledError("the watcher went away");
      last = e.seq();
    }
    lock.lock();
  }
}

}  // namespace qcal::coordinator
