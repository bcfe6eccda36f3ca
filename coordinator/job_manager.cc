// JobManager (job_manager.h): construction, start and shutdown, and the helpers every part
// calls with mu_ held. The driver is in job_driver.cc, the two services' calls in
// job_requests.cc and worker_requests.cc, the monitor in job_monitor.cc.
#include "coordinator/job_manager.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "common/log.h"
#include "rpc/auth.h"
#include "coordinator/validation.h"
#include "rpc/job_state.h"

namespace qcal::coordinator {

JobManager::JobManager(ManagerOptions options, const Clock* clock, Launcher* launcher,
                       WorkspaceFactory workspaces, std::unique_ptr<JobStore> store)
    : options_(std::move(options)),
      clock_(clock),
      launcher_(launcher),
      workspaces_(std::move(workspaces)),
      store_(std::move(store)),
      workers_(clock, options_.heartbeat_timeout_s) {}

JobManager::~JobManager() { Shutdown(); }

Status JobManager::Start() {
  Lock lock(mu_);
  if (started_) return absl::FailedPreconditionError("the job manager is already started");
  started_ = true;
  for (const std::string& w : store_->load_warnings()) QCAL_LOG_WARN("job store: {}", w);
  for (const v1::Job& job : store_->List()) {
    auto rt = std::make_shared<JobRuntime>();
    rt->job = job;
    jobs_[job.id()] = rt;
    if (!IsFinalState(job.state())) {
      // Resume: plan again from the journal (finished blocks are skipped) and launch a new group.
      v1::JobSpec spec = job.spec();
      StatusOr<Recipe> recipe = ValidateJobSpec(&spec);
      if (!recipe.ok()) {
        FailLocked(*rt, absl::StrCat("the coordinator restarted while the job was ",
                                     JobStateName(job.state()), " and cannot resume it: ",
                                     recipe.status().message()));
        continue;
      }
      const std::string was = JobStateName(job.state());
      rt->recipe = std::move(*recipe);
      rt->workspace = workspaces_();
      rt->job.set_state(v1::JOB_STATE_QUEUED);
      rt->job.set_phase(kPhasePlan);
      rt->job.clear_blocks();
      rt->job.set_blocks_done(0);
      rt->job.set_workers_alive(0);
      rt->job.set_eta_seconds(-1);
      rt->phase_started_at = clock_->MonotonicSeconds();
      const std::string msg = absl::StrCat("the coordinator restarted while the job was ", was,
                                           "; resuming it from its journal");
      QCAL_LOG_WARN("job {}: {}", job.id(), msg);
      EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING, msg);
      SaveLocked(*rt);
      rt->driver = std::thread([this, rt] { Drive(rt); });
    } else {
      // The events of a previous life are not kept; a watcher sees the final state.
      EmitLocked(*rt, v1::JOB_EVENT_KIND_STATE, "");
    }
  }
  if (options_.tick_s > 0) {
    monitor_ = std::thread([this] {
      Lock lock(mu_);
      while (!shutting_down_) {
        monitor_cv_.wait_for(lock, std::chrono::duration<double>(options_.tick_s));
        if (shutting_down_) break;
        lock.unlock();
        Tick();
        lock.lock();
      }
    });
  }
  return absl::OkStatus();
}

void JobManager::SetWorkerAddress(const std::string& address) {
  Lock lock(mu_);
  worker_address_ = address;
  for (auto& [id, rt] : jobs_) rt->cv.notify_all();  // resumed jobs wait for it to launch
}

void JobManager::Shutdown() {
  std::vector<std::shared_ptr<JobRuntime>> all;
  {
    Lock lock(mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
    for (auto& [id, rt] : jobs_) {
      if (!IsFinalState(rt->job.state())) {
        // The record stays QUEUED/RUNNING: the next coordinator on this state resumes it.
        EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING,
                   "the coordinator is shutting down; the job resumes from its journal when a "
                   "coordinator starts again on the same state directory");
        SaveLocked(*rt);
      }
      rt->cv.notify_all();
      all.push_back(rt);
    }
  }
  monitor_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  for (auto& rt : all) {
    if (rt->driver.joinable()) rt->driver.join();
  }
  // Stop the worker groups: SIGTERM, then SIGKILL for those that outlive the grace period.
  Lock lock(mu_);
  bool any = false;
  for (auto& rt : all) {
    if (rt->group && !rt->group->Poll()) {
      rt->group->Terminate();
      any = true;
    }
  }
  // Real time, whatever clock_ is: this waits for real processes.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(options_.kill_grace_s));
  while (any && std::chrono::steady_clock::now() < deadline) {
    any = false;
    for (auto& rt : all) any |= rt->group && !rt->group->Poll();
    if (any) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      lock.lock();
    }
  }
  for (auto& rt : all) {
    if (rt->group && !rt->group->Poll()) rt->group->Kill();
    rt->group.reset();  // reaps
  }
}

// ------------------------------------------------------------------------------------------
// Helpers (mu_ held)

std::shared_ptr<JobManager::JobRuntime> JobManager::FindLocked(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

v1::JobEvent& JobManager::EmitLocked(JobRuntime& rt, v1::JobEventKind kind,
                                     const std::string& message) {
  v1::JobEvent e;
  e.set_job_id(rt.job.id());
  e.set_seq(rt.next_seq++);
  e.set_time_unix(clock_->UnixSeconds());
  e.set_kind(kind);
  e.set_state(rt.job.state());
  e.set_phase(rt.job.phase());
  e.set_done(rt.job.blocks_done());
  e.set_total(rt.job.blocks_total());
  e.set_eta_seconds(rt.job.eta_seconds());
  e.set_message(message);
  rt.events.push_back(std::move(e));
  while (rt.events.size() > options_.max_events_per_job) rt.events.pop_front();
  rt.cv.notify_all();
  return rt.events.back();
}

void JobManager::SaveLocked(JobRuntime& rt) {
  rt.job.set_updated_unix(clock_->UnixSeconds());
  Status s = store_->Put(rt.job);
  if (!s.ok()) {
    // The job goes on; the record on disk is stale until the next successful write.
    QCAL_LOG_ERROR("job {}: cannot persist its record: {}", rt.job.id(), std::string(s.message()));
  }
}

void JobManager::SetPhaseLocked(JobRuntime& rt, const std::string& phase) {
  if (rt.job.phase() == phase) return;
  rt.job.set_phase(phase);
  rt.phase_started_at = clock_->MonotonicSeconds();
  if (phase == kPhaseQuantize) rt.quantize_started_at = rt.phase_started_at;
  UpdateEtaLocked(rt);
  EmitLocked(rt, v1::JOB_EVENT_KIND_PHASE, absl::StrCat("phase ", phase));
  SaveLocked(rt);
}

void JobManager::SetStateLocked(JobRuntime& rt, v1::JobState state, const std::string& error) {
  if (IsFinalState(rt.job.state())) return;  // a final state is final
  rt.job.set_state(state);
  if (!error.empty()) rt.job.set_error(error);
  if (IsFinalState(state)) {
    if (rt.workspace) {
      // The output directory is free for the next job, once a commit in flight has finished.
      std::lock_guard<std::mutex> file_lock(rt.files_mu);
      rt.workspace->Close();
    }
    rt.ended_at = clock_->MonotonicSeconds();
    rt.job.set_eta_seconds(state == v1::JOB_STATE_SUCCEEDED ? 0 : -1);
    QCAL_LOG_INFO("job {}: {}{}{}", rt.job.id(), JobStateName(state), error.empty() ? "" : ": ",
                  error);
  }
  EmitLocked(rt, v1::JOB_EVENT_KIND_STATE,
             error.empty() ? JobStateName(state)
                           : absl::StrCat(JobStateName(state), ": ", error));
  SaveLocked(rt);
  rt.cv.notify_all();
}

void JobManager::FailLocked(JobRuntime& rt, const std::string& error) {
  SetStateLocked(rt, v1::JOB_STATE_FAILED, error);
}

void JobManager::ApplySchedulerErrorLocked(JobRuntime& rt) {
  if (rt.run && !rt.run->scheduler().error().empty()) {
    FailLocked(rt, rt.run->scheduler().error());
  }
}

void JobManager::WarnRequeuesLocked(JobRuntime& rt,
                                    const std::vector<JobScheduler::Requeue>& requeues,
                                    const std::string& why) {
  for (const auto& r : requeues) {
    const std::string msg = absl::StrCat(why, ": ", r.what, " returns to the queue (attempt ",
                                         r.next_attempt, ")");
    QCAL_LOG_WARN("job {}: {}", rt.job.id(), msg);
    EmitLocked(rt, v1::JOB_EVENT_KIND_WARNING, msg);
  }
}

void JobManager::UpdateEtaLocked(JobRuntime& rt) {
  double eta = -1;
  if (rt.job.phase() == kPhaseQuantize && rt.blocks_done_this_run > 0) {
    const double elapsed = clock_->MonotonicSeconds() - rt.quantize_started_at;
    const int64_t left = rt.job.blocks_total() - rt.job.blocks_done();
    eta = elapsed / rt.blocks_done_this_run * static_cast<double>(left);
  }
  rt.job.set_eta_seconds(eta);
}

v1::Task JobManager::ShutdownTask(const JobRuntime& rt) const {
  v1::Task t;
  t.set_kind(v1::TASK_KIND_SHUTDOWN);
  t.set_job_id(rt.job.id());
  t.set_reason(rt.job.error().empty()
                   ? absl::StrCat("job ", rt.job.id(), " is ", JobStateName(rt.job.state()))
                   : absl::StrCat("job ", rt.job.id(), " is ", JobStateName(rt.job.state()),
                                  ": ", rt.job.error()));
  return t;
}

StatusOr<std::pair<WorkerInfo, std::shared_ptr<JobManager::JobRuntime>>>
JobManager::WorkerAndJobLocked(const std::string& worker_id) {
  QCAL_ASSIGN_OR_RETURN(WorkerInfo w, workers_.Touch(worker_id));
  std::shared_ptr<JobRuntime> rt = FindLocked(w.job_id);
  if (!rt) return absl::NotFoundError(absl::StrCat("unknown job '", w.job_id, "'"));
  rt->job.set_workers_alive(workers_.AliveCount(w.job_id));
  return std::make_pair(w, rt);
}

Status JobManager::LaunchGroupLocked(JobRuntime& rt) {
  // Workers of an earlier group (a previous coordinator's, or ranks that outlived their
  // launcher) must not compute beside the new ones.
  if (Status s = launcher_->StopLeftovers(rt.launch); !s.ok()) {
    QCAL_LOG_WARN("job {}: {}", rt.job.id(), std::string(s.message()));
  }
  StatusOr<std::unique_ptr<WorkerGroup>> group = launcher_->Launch(rt.launch);
  if (!group.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start the workers: ", group.status().message()));
  }
  rt.group = std::move(*group);
  EmitLocked(rt, v1::JOB_EVENT_KIND_LOG,
             absl::StrCat("started ", rt.launch.workers, " worker rank(s): ",
                          rt.group->Describe()));
  return absl::OkStatus();
}

void JobManager::GroupDiedLocked(JobRuntime& rt, const std::string& how) {
  const std::string log = JobPaths(JobDirOf(rt.job.spec())).workers_log;
  const std::string what =
      absl::StrCat("the worker processes exited before the job finished (", rt.group->Describe(),
                   ": ", how, ")");
  const std::string tail = rt.group->LogTail(20);
  workers_.RemoveJob(rt.job.id());
  rt.job.set_workers_alive(0);
  if (shutting_down_) {  // the group was stopped with the coordinator: the job stays resumable
    rt.group.reset();
    return;
  }
  const bool work_left = rt.run && !rt.run->done();
  if (!work_left || rt.group_restarts >= options_.max_group_restarts) {
    rt.group.reset();
    FailLocked(rt, absl::StrCat(what,
                                rt.group_restarts > 0
                                    ? absl::StrCat(" after ", rt.group_restarts, " relaunch(es)")
                                    : "",
                                "; last lines of ", log, ":\n", tail));
    return;
  }
  ++rt.group_restarts;
  rt.group.reset();
  const std::string msg =
      absl::StrCat(what, "; relaunching the group (", rt.group_restarts, " of ",
                   options_.max_group_restarts, "), the job continues from its journal");
  QCAL_LOG_WARN("job {}: {}", rt.job.id(), msg);
  EmitLocked(rt, v1::JOB_EVENT_KIND_WARNING, msg);
  WarnRequeuesLocked(rt, rt.run->scheduler().GroupLost(what), "the worker group was lost");
  ApplySchedulerErrorLocked(rt);
  if (IsFinalState(rt.job.state())) return;
  if (Status launched = LaunchGroupLocked(rt); !launched.ok()) {
    FailLocked(rt, std::string(launched.message()));
    return;
  }
  if (!rt.run->finalize_due()) SetPhaseLocked(rt, rt.run->scheduler().phase());
}

Status JobManager::MakeWorkerCredentialLocked(JobRuntime& rt) {
  // One credential per job, for every group it launches; a coordinator restart makes a new one
  // (the old group is stopped first).
  if (rt.worker_token.empty()) {
    QCAL_ASSIGN_OR_RETURN(rt.worker_token, rpc::NewRandomToken());
  }
  if (options_.credentials_dir.empty()) return absl::OkStatus();
  QCAL_RETURN_IF_ERROR(MakeDirs(options_.credentials_dir, 0700));
  const std::string path = absl::StrCat(options_.credentials_dir, "/", rt.job.id(), ".token");
  QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(path, O_WRONLY | O_CREAT | O_TRUNC, 0600,
                                                   "cannot write the worker credential"));
  const std::string text = rt.worker_token + "\n";
  const bool ok = ::fchmod(fd, 0600) == 0 &&
                  ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) return io::ErrnoError(error, path, "cannot write the worker credential");
  rt.launch.auth_token_file = path;
  return absl::OkStatus();
}

std::optional<std::string> JobManager::WorkerCredentialJob(const std::string& token) {
  Lock lock(mu_);
  std::optional<std::string> found;
  for (const auto& [id, rt] : jobs_) {
    if (rt->worker_token.empty()) continue;
    if (rpc::ConstantTimeEquals(token, rt->worker_token) && !found) found = id;
  }
  return found;
}

Status JobManager::CheckWorkerOfJob(const std::string& worker_id, const std::string& job_id) {
  Lock lock(mu_);
  StatusOr<WorkerInfo> w = workers_.Touch(worker_id);
  if (w.ok() && w->job_id != job_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "worker ", io::Printable(worker_id, 64), " is not one of job ", job_id,
        "'s workers (this credential opens that job's calls only)"));
  }
  return absl::OkStatus();  // unknown workers: the call itself says so
}

std::string JobManager::WorkerCredentialOf(const std::string& job_id) {
  Lock lock(mu_);
  std::shared_ptr<JobRuntime> rt = FindLocked(job_id);
  return rt ? rt->worker_token : "";
}

}  // namespace qcal::coordinator
