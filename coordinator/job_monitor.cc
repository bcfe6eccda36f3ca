// JobManager's monitor (job_manager.h): expired heartbeats, exited worker groups, and waiting
// for the drivers.
#include "coordinator/job_manager.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "rpc/job_state.h"

namespace qcal::coordinator {

void JobManager::Tick() {
  Lock lock(mu_);
  for (const WorkerInfo& dead : workers_.Expire()) {
    std::shared_ptr<JobRuntime> rt = FindLocked(dead.job_id);
    if (!rt) continue;
    rt->job.set_workers_alive(workers_.AliveCount(dead.job_id));
    if (IsFinalState(rt->job.state()) || !rt->run) continue;
    const std::string why =
        absl::StrCat("rank ", dead.rank, " (worker ", dead.worker_id, ", pid ", dead.pid, " on ",
                     dead.hostname, ") sent no heartbeat for ",
                     absl::SixDigits(workers_.timeout_s()), " s");
    QCAL_LOG_WARN("job {}: {}", rt->job.id(), why);
    EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING, why);
    WarnRequeuesLocked(*rt, rt->run->scheduler().WorkerLost(dead.worker_id, dead.rank), why);
    ApplySchedulerErrorLocked(*rt);
    if (!IsFinalState(rt->job.state()) && rt->run->scheduler().needs_new_group() && rt->group) {
      // The collective calibration cannot finish without the lost rank: replace the world
      // (the exit is seen below, or on the next tick, and relaunches it).
      EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING,
                 absl::StrCat("rank ", dead.rank, " was lost during calibration, a collective "
                              "step: stopping the worker group (", rt->group->Describe(),
                              ") to start a new one"));
      rt->group->Kill();
    }
  }
  const double now = clock_->MonotonicSeconds();
  for (auto& [id, rt] : jobs_) {
    if (!rt->group) continue;
    std::optional<std::string> exit = rt->group->Poll();
    for (const WorkerGroup::Note& note : rt->group->TakeNotes()) {
      if (note.warning) QCAL_LOG_WARN("job {}: {}", id, note.message);
      EmitLocked(*rt, note.warning ? v1::JOB_EVENT_KIND_WARNING : v1::JOB_EVENT_KIND_LOG,
                 note.message);
    }
    if (exit) {
      if (!IsFinalState(rt->job.state())) {
        GroupDiedLocked(*rt, *exit);  // relaunches, or fails the job
        if (rt->group) continue;      // the new group
      }
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG, absl::StrCat("worker processes exited: ", *exit));
      rt->group.reset();
      workers_.RemoveJob(id);
      rt->job.set_workers_alive(0);
      continue;
    }
    if (!IsFinalState(rt->job.state())) continue;
    if (rt->stop_stage == 0 && now - rt->ended_at >= options_.kill_grace_s) {
      rt->stop_stage = 1;
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("workers still running ", absl::SixDigits(options_.kill_grace_s),
                              " s after the job ended: SIGTERM to ", rt->group->Describe()));
      rt->group->Terminate();
    } else if (rt->stop_stage == 1 && now - rt->ended_at >= 2 * options_.kill_grace_s) {
      rt->stop_stage = 2;
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("workers survived SIGTERM: SIGKILL to ", rt->group->Describe()));
      rt->group->Kill();
    }
  }
}

void JobManager::WaitForDrivers() {
  std::vector<std::shared_ptr<JobRuntime>> all;
  {
    Lock lock(mu_);
    for (auto& [id, rt] : jobs_) all.push_back(rt);
  }
  for (auto& rt : all) {
    {
      Lock lock(mu_);
      rt->cv.wait(lock, [&] { return IsFinalState(rt->job.state()) || shutting_down_; });
    }
    if (rt->driver.joinable()) rt->driver.join();
  }
}

std::vector<WorkerInfo> JobManager::WorkersOf(const std::string& job_id) {
  Lock lock(mu_);
  return workers_.OfJob(job_id);
}

}  // namespace qcal::coordinator
