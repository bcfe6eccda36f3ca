// JobManager's JobService calls (job_manager.h): submit, get, list, cancel, watch.
#include "coordinator/job_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/io_util.h"
#include "common/log.h"
#include "common/safe_fs.h"
#include "coordinator/validation.h"
#include "rpc/job_state.h"

namespace qcal::coordinator {
namespace {

bool Overlap(const std::string& a, const std::string& b) {
  return PathIsUnder(a, b) || PathIsUnder(b, a);
}

// How `mine` (this job's out_dir or job_dir) meets `theirs`: "" when apart.
std::string HowTheyMeet(const std::string& mine, const std::string& theirs) {
  if (mine == theirs) return "is";
  if (PathIsUnder(mine, theirs)) return "lies inside";
  if (PathIsUnder(theirs, mine)) return "contains";
  return "";
}

}  // namespace

const Principal& JobManager::LocalAdmin() {
  static const Principal* admin = [] {
    auto* p = new Principal();
    p->name = "admin";
    p->admin = true;
    p->read_roots = {"/"};
    p->write_roots = {"/"};
    return p;
  }();
  return *admin;
}

StatusOr<std::string> JobManager::Submit(v1::JobSpec spec, const Principal& who) {
  QCAL_ASSIGN_OR_RETURN(Recipe recipe, ValidateJobSpec(&spec));
  // The user's roots (identity.h), on the canonical paths validation made.
  const std::string job_dir = JobDirOf(spec);
  QCAL_RETURN_IF_ERROR(CheckUnderRoots(who, "model_dir", spec.model_dir(), false));
  QCAL_RETURN_IF_ERROR(CheckModelFilesUnderRoots(who, spec.model_dir()));
  QCAL_RETURN_IF_ERROR(CheckUnderRoots(who, "out_dir", spec.out_dir(), true));
  QCAL_RETURN_IF_ERROR(CheckUnderRoots(who, "job_dir", job_dir, true));
  for (const std::string& f : CalibrationPaths(recipe, spec)) {
    QCAL_RETURN_IF_ERROR(CheckUnderRoots(who, "calibration file", f, false));
  }
  for (const v1::EvalData& d : spec.eval().data()) {  // made canonical by validation
    QCAL_RETURN_IF_ERROR(CheckUnderRoots(who, "eval data", d.path(), false));
  }
  if (!options_.state_dir.empty()) {
    for (const auto& [field, dir] : {std::pair<const char*, std::string>{"out_dir", spec.out_dir()},
                                     {"job_dir", job_dir}}) {
      if (Overlap(dir, options_.state_dir)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, " '", dir, "' overlaps the coordinator's state directory '",
            options_.state_dir, "'; choose a directory of your own"));
      }
    }
  }
  Lock lock(mu_);
  if (shutting_down_) return absl::UnavailableError("the coordinator is shutting down");
  if (!started_) return absl::UnavailableError("the coordinator is not started");
  for (const auto& [id, other] : jobs_) {
    if (IsFinalState(other->job.state())) continue;
    const v1::JobSpec& o = other->job.spec();
    // Another user's job is named only by its id: its paths are not this caller's to see.
    const bool visible = who.admin || other->job.owner() == who.name;
    for (const auto& [mine_field, mine] :
         {std::pair<const char*, std::string>{"out_dir", spec.out_dir()}, {"job_dir", job_dir}}) {
      for (const auto& [their_field, theirs] :
           {std::pair<const char*, std::string>{"out_dir", o.out_dir()},
            {"job_dir", JobDirOf(o)}}) {
        const std::string how = HowTheyMeet(mine, theirs);
        if (how.empty()) continue;
        return absl::FailedPreconditionError(absl::StrCat(
            mine_field, " '", mine, "' ", how, " the ", their_field,
            visible ? absl::StrCat(" '", theirs, "'") : "", " of job ", id, " (",
            JobStateName(other->job.state()),
            "), which writes there; cancel it or wait for it to end, or choose another ",
            mine_field == std::string("out_dir") ? "--out" : "--job-dir"));
      }
    }
  }
  auto rt = std::make_shared<JobRuntime>();
  rt->recipe = std::move(recipe);
  rt->workspace = workspaces_();
  v1::Job& job = rt->job;
  job.set_id(store_->NewJobId());
  *job.mutable_spec() = spec;
  job.set_owner(who.name);
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_phase(kPhasePlan);
  job.set_created_unix(clock_->UnixSeconds());
  job.set_updated_unix(job.created_unix());
  job.set_eta_seconds(-1);
  QCAL_RETURN_IF_ERROR(store_->Put(job));
  jobs_[job.id()] = rt;
  rt->phase_started_at = clock_->MonotonicSeconds();
  EmitLocked(*rt, v1::JOB_EVENT_KIND_STATE, "QUEUED");
  QCAL_LOG_INFO("job {}: submitted by {} ({} -> {}, {} worker(s))", job.id(), who.name,
                spec.model_dir(), spec.out_dir(), spec.workers());
  rt->driver = std::thread([this, rt] { Drive(rt); });
  return job.id();
}

StatusOr<std::shared_ptr<JobManager::JobRuntime>> JobManager::FindForLocked(
    const std::string& job_id, const Principal& who) {
  std::shared_ptr<JobRuntime> rt = FindLocked(job_id);
  if (!rt || (!who.admin && rt->job.owner() != who.name)) {
    return absl::NotFoundError(absl::StrCat("unknown job '", io::Printable(job_id, 64), "'",
                                            who.admin ? "" : " (among your jobs)"));
  }
  return rt;
}

StatusOr<v1::Job> JobManager::Get(const std::string& job_id, const Principal& who) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<JobRuntime> rt, FindForLocked(job_id, who));
  return rt->job;
}

std::vector<v1::Job> JobManager::List(const Principal& who) {
  Lock lock(mu_);
  std::vector<v1::Job> out;
  out.reserve(jobs_.size());
  for (const v1::Job& job : store_->List()) {
    std::shared_ptr<JobRuntime> rt = FindLocked(job.id());
    const v1::Job& j = rt ? rt->job : job;
    if (who.admin || j.owner() == who.name) out.push_back(j);
  }
  return out;
}

StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id, const Principal& who) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<JobRuntime> rt, FindForLocked(job_id, who));
  if (!IsFinalState(rt->job.state())) {
    SetStateLocked(*rt, v1::JOB_STATE_CANCELLED, "");
    monitor_cv_.notify_all();
  }
  return rt->job;
}

Status JobManager::Watch(const std::string& job_id, const Principal& who, int64_t after_seq,
                         const std::function<bool(const v1::JobEvent&)>& send,
                         const std::function<bool()>& cancelled) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<JobRuntime> rt, FindForLocked(job_id, who));
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
