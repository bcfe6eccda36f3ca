#include "coordinator/job_manager.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/task_plan.h"
#include "coordinator/validation.h"
#include "rpc/job_state.h"

namespace qcal::coordinator {
namespace {

// The evaluation phase's tasks: the float and then the quantized model, for each file.
std::vector<v1::EvalParams> EvalsOf(const v1::JobSpec& spec) {
  std::vector<v1::EvalParams> out;
  for (const v1::EvalData& d : spec.eval().data()) {
    for (const char* model : {"float", "quantized"}) {
      v1::EvalParams p;
      p.set_model(model);
      p.set_label(d.label());
      p.set_path(d.path());
      p.set_ctx(spec.eval().ctx() > 0 ? spec.eval().ctx() : 512);
      p.set_max_tokens(spec.eval().max_tokens() > 0 ? spec.eval().max_tokens() : -1);
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace

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
  if (rt.scheduler && !rt.scheduler->error().empty()) FailLocked(rt, rt.scheduler->error());
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
  const std::string log = JobDirOf(rt.job.spec()) + "/workers.log";
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
  const bool work_left = rt.scheduler && !rt.scheduler->done();
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
  WarnRequeuesLocked(rt, rt.scheduler->GroupLost(what), "the worker group was lost");
  ApplySchedulerErrorLocked(rt);
  if (IsFinalState(rt.job.state())) return;
  if (Status launched = LaunchGroupLocked(rt); !launched.ok()) {
    FailLocked(rt, std::string(launched.message()));
    return;
  }
  if (!rt.scheduler->awaiting_finalize()) SetPhaseLocked(rt, rt.scheduler->phase());
}

// ------------------------------------------------------------------------------------------
// Driver thread: plan → launch → wait for the tasks → finalize.

void JobManager::Drive(const std::shared_ptr<JobRuntime>& rt) {
  try {
    DriveUnsafe(rt);
  } catch (const std::exception& e) {
    Lock lock(mu_);
    FailLocked(*rt, absl::StrCat("internal error: ", e.what()));
  }
}

void JobManager::DriveUnsafe(const std::shared_ptr<JobRuntime>& rt) {
  Lock lock(mu_);
  const v1::JobSpec spec = rt->job.spec();
  const Recipe recipe = rt->recipe;
  JobWorkspace* workspace = rt->workspace.get();
  lock.unlock();
  StatusOr<JobPlan> plan = workspace->Open(recipe, spec);  // reads checkpoints: no lock
  lock.lock();
  if (IsFinalState(rt->job.state())) return;  // cancelled (or shut down) while planning
  if (!plan.ok()) {
    FailLocked(*rt, std::string(plan.status().message()));
    return;
  }
  rt->inputs_key = plan->inputs.key;
  for (const std::string& note : plan->notes) EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG, note);
  const TaskPlan tasks = MakeTaskPlan(recipe, *plan, EvalsOf(spec));
  rt->job.set_blocks_total(tasks.num_blocks);
  rt->job.set_blocks_done(static_cast<int64_t>(tasks.resumed.size()));
  rt->evals = tasks.evals;
  rt->eval_results.assign(tasks.evals.size(), v1::EvalResult());
  for (int64_t l : tasks.resumed) {
    v1::BlockMetrics* b = rt->job.add_blocks();
    b->set_block(l);
    b->set_resumed(true);
    b->set_rank(-1);
    auto it = plan->block_done.find(l);
    if (it != plan->block_done.end()) {
      rt->finished[l] = BlockResultFromEntry(it->second);
      *b->mutable_result() = rt->finished[l];
      b->set_seconds(rt->finished[l].seconds());
    }
  }
  if (!tasks.resumed.empty()) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("resuming: ", tasks.resumed.size(), " of ", tasks.num_blocks,
                            " blocks were finished by an earlier run"));
  }
  rt->scheduler = std::make_unique<JobScheduler>(rt->job.id(), spec.workers(), tasks,
                                                 options_.max_attempts, options_.wait_ms);
  if (tasks.needs_workers()) {
    // A job resumed at start-up gets here before the server listens.
    if (!rt->cv.wait_for(lock, std::chrono::seconds(60), [&] {
          return !worker_address_.empty() || shutting_down_ || IsFinalState(rt->job.state());
        })) {
      FailLocked(*rt, "the coordinator does not know the address its workers should dial");
      return;
    }
    if (IsFinalState(rt->job.state()) || shutting_down_) return;
    LaunchSpec ls;
    ls.job_id = rt->job.id();
    ls.workers = spec.workers();
    ls.threads_per_worker = spec.threads_per_worker();
    ls.device = spec.device();
    ls.coordinator_address = worker_address_;
    ls.auth_token_file = options_.auth_token_file;
    ls.tls_ca_file = options_.worker_tls_ca;
    ls.tls_cert_file = options_.worker_tls_cert;
    ls.tls_key_file = options_.worker_tls_key;
    ls.log_path = plan->job_dir + "/workers.log";
    ls.pid_file = plan->job_dir + "/workers.pid";
    rt->launch = ls;
    if (Status launched = LaunchGroupLocked(*rt); !launched.ok()) {
      FailLocked(*rt, std::string(launched.message()));
      return;
    }
    SetStateLocked(*rt, v1::JOB_STATE_RUNNING, "");
    SetPhaseLocked(*rt, rt->scheduler->phase());
    rt->cv.wait(lock, [&] {
      return IsFinalState(rt->job.state()) || !rt->scheduler->error().empty() ||
             rt->scheduler->awaiting_finalize() || shutting_down_;
    });
    if (IsFinalState(rt->job.state()) || shutting_down_) return;
    ApplySchedulerErrorLocked(*rt);
    if (IsFinalState(rt->job.state())) return;
  } else {
    SetStateLocked(*rt, v1::JOB_STATE_RUNNING, "");
  }

  SetPhaseLocked(*rt, kPhaseFinalize);
  lock.unlock();
  StatusOr<nlohmann::json> summary = workspace->Finalize(recipe, spec);
  lock.lock();
  if (IsFinalState(rt->job.state())) return;
  if (!summary.ok()) {
    FailLocked(*rt, absl::StrCat("finalize: ", summary.status().message()));
    return;
  }
  rt->job.set_result_json(summary->dump());
  rt->scheduler->FinalizeDone();
  if (!rt->scheduler->done()) {
    SetPhaseLocked(*rt, rt->scheduler->phase());  // evaluation by the workers
    rt->cv.wait(lock, [&] {
      return IsFinalState(rt->job.state()) || rt->scheduler->done() || shutting_down_;
    });
    if (IsFinalState(rt->job.state()) || shutting_down_) return;
  }
  SetPhaseLocked(*rt, kPhaseDone);
  SetStateLocked(*rt, v1::JOB_STATE_SUCCEEDED, "");
}

// ------------------------------------------------------------------------------------------
// JobService

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

// ------------------------------------------------------------------------------------------
// WorkerService

StatusOr<v1::RegisterWorkerResponse> JobManager::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  Lock lock(mu_);
  std::shared_ptr<JobRuntime> rt = FindLocked(request.job_id());
  if (!rt) return absl::NotFoundError(absl::StrCat("unknown job '", request.job_id(), "'"));
  if (IsFinalState(rt->job.state())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", request.job_id(), " is ", JobStateName(rt->job.state()), "; no workers needed"));
  }
  if (request.world_size() != rt->job.spec().workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", request.job_id(), " runs ", rt->job.spec().workers(),
        " rank(s) but this worker is in a world of ", request.world_size()));
  }
  QCAL_ASSIGN_OR_RETURN(WorkerInfo w, workers_.Register(request));
  rt->job.set_workers_alive(workers_.AliveCount(w.job_id));
  EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
             absl::StrCat("rank ", w.rank, " registered: ", w.worker_id, ", pid ", w.pid, " on ",
                          w.hostname, w.device.empty() ? "" : ", " + w.device));
  v1::RegisterWorkerResponse response;
  response.set_worker_id(w.worker_id);
  response.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  *response.mutable_spec() = rt->job.spec();
  response.set_inputs_key(rt->inputs_key);
  return response;
}

StatusOr<v1::Task> JobManager::NextTask(const std::string& worker_id) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(worker_id));
  auto& [w, rt] = wj;
  if (IsFinalState(rt->job.state())) return ShutdownTask(*rt);
  if (!rt->scheduler || rt->scheduler->done()) {
    v1::Task t;  // still planning, or finalizing: the job is not over yet
    t.set_kind(v1::TASK_KIND_WAIT);
    t.set_job_id(rt->job.id());
    t.set_retry_after_ms(options_.wait_ms);
    return t;
  }
  const auto before = rt->scheduler->running();
  v1::Task task = rt->scheduler->Next(w.worker_id, w.rank);
  auto held = before.find(w.worker_id);
  if (held != before.end()) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING,
               absl::StrCat("rank ", w.rank, " asked for a new task while holding ", held->second,
                            "; that task returns to the queue"));
  }
  ApplySchedulerErrorLocked(*rt);
  if (IsFinalState(rt->job.state())) return ShutdownTask(*rt);
  if (task.kind() == v1::TASK_KIND_FINETUNE_E2E) {
    for (const auto& [layer, result] : rt->finished) *task.add_finished_blocks() = result;
  }
  if (task.kind() == v1::TASK_KIND_QUANTIZE_BLOCK && task.attempt() > 1) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("block ", task.block(), " attempt ", task.attempt(), " -> rank ",
                            w.rank));
  }
  return task;
}

StatusOr<bool> JobManager::ReportProgress(const v1::ReportProgressRequest& request) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(request.worker_id()));
  auto& [w, rt] = wj;
  const bool stop = IsFinalState(rt->job.state()) && rt->job.state() != v1::JOB_STATE_SUCCEEDED;
  if (IsFinalState(rt->job.state())) return stop;
  v1::JobEvent& e = EmitLocked(
      *rt, v1::JOB_EVENT_KIND_PROGRESS,
      request.message().empty() ? absl::StrCat("rank ", w.rank, ": ", request.phase())
                                : absl::StrCat("rank ", w.rank, ": ", request.message()));
  if (!request.phase().empty()) e.set_phase(request.phase());
  e.set_done(request.done());
  e.set_total(request.total());
  // ETA within a phase reported in steps (calibration): rate so far times what is left.
  if (request.total() > 0 && request.done() > 0 && rt->job.phase() == kPhaseCalibrate) {
    const double elapsed = clock_->MonotonicSeconds() - rt->phase_started_at;
    e.set_eta_seconds(elapsed / request.done() * (request.total() - request.done()));
  }
  return stop;
}

namespace {

// The work a task stands for, whatever its attempt: two attempts of one block share it.
std::string WorkKey(const JobScheduler::TaskInfo& info) {
  return absl::StrCat(static_cast<int>(info.kind), ":", info.index);
}

// A worker's result checked against its task's kind and index (no I/O); the staged files it
// names, when it has any.
Status CheckResultShape(const v1::CompleteTaskRequest& request, const JobScheduler::TaskInfo& info,
                        std::vector<v1::WrittenFile>* files) {
  switch (info.kind) {
    case v1::TASK_KIND_CALIBRATE:
      if (!request.has_calibrate()) return absl::InvalidArgumentError("no calibration result");
      return absl::OkStatus();
    case v1::TASK_KIND_QUANTIZE_BLOCK:
      if (!request.has_block()) return absl::InvalidArgumentError("no block result");
      if (request.block().layer() != info.index) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the result is for block ", request.block().layer(), ", not ", info.index));
      }
      *files = FilesOf(request.block());
      return absl::OkStatus();
    case v1::TASK_KIND_FINETUNE_E2E:
      if (!request.has_finetune()) return absl::InvalidArgumentError("no fine-tuning result");
      files->assign(request.finetune().shards().begin(), request.finetune().shards().end());
      return absl::OkStatus();
    case v1::TASK_KIND_EVALUATE:
      if (!request.has_eval()) return absl::InvalidArgumentError("no evaluation result");
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError("unknown task kind");
  }
}

}  // namespace

Status JobManager::RejectResultLocked(JobRuntime& rt, const WorkerInfo& w,
                                      const std::string& task_id, const Status& why) {
  const std::string msg = absl::StrCat("invalid result for ", task_id, ": ", why.message());
  StatusOr<std::vector<JobScheduler::Requeue>> requeues =
      rt.scheduler->Fail(w.worker_id, w.rank, task_id, msg, /*retryable=*/true);
  if (requeues.ok()) {
    WarnRequeuesLocked(rt, *requeues, absl::StrCat("rank ", w.rank, " returned an ", msg));
  }
  ApplySchedulerErrorLocked(rt);
  return absl::InvalidArgumentError(msg);
}

// In three steps, so that no file work happens under the manager's lock:
//   1. (locked) the worker, the task and the result's shape; the one attempt that may commit
//      this work is chosen (JobRuntime::committing);
//   2. (unlocked; the job's files_mu) its staged files checked, renamed into the output and
//      journaled (block_done / e2e_done), fsynced;
//   3. (locked) the scheduler and the job's record updated.
// A shard is in place and journaled before the scheduler counts it, so the driver, which
// finalizes once the scheduler has every block, never sees a block it cannot read.
Status JobManager::CompleteTask(const v1::CompleteTaskRequest& request) {
  const std::string& task_id = request.task_id();
  WorkerInfo w;
  std::shared_ptr<JobRuntime> rt;
  std::vector<v1::WrittenFile> files;
  std::string work;
  {
    Lock lock(mu_);
    QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(request.worker_id()));
    w = wj.first;
    rt = wj.second;
    if (IsFinalState(rt->job.state()) || !rt->scheduler) return absl::OkStatus();  // nothing to record

    const StatusOr<JobScheduler::TaskInfo> info = rt->scheduler->Lookup(task_id);
    if (!info.ok()) return info.status();
    // A superseded attempt whose work another attempt finished: its files are never committed.
    if (info->done) {
      QCAL_RETURN_IF_ERROR(rt->scheduler->Complete(w.worker_id, w.rank, task_id).status());
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("rank ", w.rank, " also completed ", task_id, " (ignored)"));
      return absl::OkStatus();
    }
    // Check the typed result against the task before accepting it; a bad result counts as a
    // failed attempt (the work returns to the queue).
    const Status shape = CheckResultShape(request, *info, &files);
    if (!shape.ok()) return RejectResultLocked(*rt, w, task_id, shape);
    // A result without files (calibration, evaluation) is recorded at once.
    if (files.empty()) return RecordCompletionLocked(rt.get(), w, request);
    work = WorkKey(*info);
    if (!rt->committing.insert(work).second) {
      // Another attempt of the same work is committing its (identical) files; its completion
      // retires this attempt too.
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("rank ", w.rank, " also completed ", task_id,
                              " (ignored: another attempt is being committed)"));
      return absl::OkStatus();
    }
  }

  // Accept the attempt: its staged files become the output, then the journal records them.
  Status valid, committed, appended;
  {
    std::lock_guard<std::mutex> file_lock(rt->files_mu);
    valid = request.has_block() ? rt->workspace->CheckBlock(request.block())
                                : rt->workspace->CheckFiles(files);
    if (valid.ok()) committed = rt->workspace->Commit(files);
    if (valid.ok() && committed.ok()) {
      appended = rt->workspace->Append(request.has_block() ? BlockDoneEntry(request.block())
                                                           : E2eDoneEntry(request.finetune()));
    }
  }
  Lock lock(mu_);
  if (!valid.ok()) {
    rt->committing.erase(work);
    if (IsFinalState(rt->job.state())) return absl::OkStatus();
    return RejectResultLocked(*rt, w, task_id, valid);
  }
  if (!committed.ok()) {
    FailLocked(*rt, absl::StrCat("committing ", task_id, ": ", committed.message()));
    return committed;
  }
  if (!appended.ok()) {
    FailLocked(*rt, absl::StrCat("journal: ", appended.message()));
    return appended;
  }
  return RecordCompletionLocked(rt.get(), w, request);
}

Status JobManager::RecordCompletionLocked(JobRuntime* rt, const WorkerInfo& w,
                                          const v1::CompleteTaskRequest& request) {
  const std::string& task_id = request.task_id();
  // The job may have ended while the files were committed: they and their journal entry are
  // kept (a resume counts them); there is nothing more to record.
  if (IsFinalState(rt->job.state())) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(JobScheduler::Completion c,
                        rt->scheduler->Complete(w.worker_id, w.rank, task_id));
  if (c.kind == v1::TASK_KIND_CALIBRATE) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("rank ", w.rank, " finished calibration (",
                            rt->scheduler->calibrate_ranks_done(), " of ",
                            rt->job.spec().workers(), ")"));
  } else if (c.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    rt->finished[c.block] = request.block();
    v1::BlockMetrics* b = rt->job.add_blocks();
    b->set_block(c.block);
    b->set_seconds(request.block().seconds());
    *b->mutable_result() = request.block();
    b->set_rank(w.rank);
    rt->job.set_blocks_done(rt->job.blocks_done() + 1);
    ++rt->blocks_done_this_run;
    UpdateEtaLocked(*rt);
    v1::JobEvent& e = EmitLocked(
        *rt, v1::JOB_EVENT_KIND_BLOCK_DONE,
        absl::StrFormat("block %d done by rank %d in %.2f s", c.block, w.rank, b->seconds()));
    *e.mutable_block() = *b;
    SaveLocked(*rt);
  } else if (c.kind == v1::TASK_KIND_FINETUNE_E2E) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("end-to-end fine-tuning done by rank ", w.rank));
  } else if (c.kind == v1::TASK_KIND_EVALUATE) {
    const v1::EvalResult& r = request.eval();
    rt->eval_results[c.eval] = r;
    rt->job.clear_evals();
    for (const v1::EvalResult& done : rt->eval_results) {
      if (done.has_params()) *rt->job.add_evals() = done;
    }
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrFormat("perplexity of the %s model on %s: %.4f (%d tokens, rank %d)",
                               r.params().model(), r.params().label(), r.perplexity(),
                               r.scored(), w.rank));
    SaveLocked(*rt);
  }
  if (c.phase_finished && !rt->scheduler->done() && !rt->scheduler->awaiting_finalize()) {
    SetPhaseLocked(*rt, rt->scheduler->phase());
  }
  if (rt->scheduler->done() || rt->scheduler->awaiting_finalize()) {
    rt->cv.notify_all();  // the driver finalizes / finishes
  }
  return absl::OkStatus();
}

Status JobManager::FailTask(const v1::FailTaskRequest& request) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(request.worker_id()));
  auto& [w, rt] = wj;
  if (IsFinalState(rt->job.state()) || !rt->scheduler) return absl::OkStatus();
  QCAL_LOG_WARN("job {}: rank {} failed task {}: {}", rt->job.id(), w.rank, request.task_id(),
                request.error());
  QCAL_ASSIGN_OR_RETURN(std::vector<JobScheduler::Requeue> requeues,
                        rt->scheduler->Fail(w.worker_id, w.rank, request.task_id(),
                                            request.error(), request.retryable()));
  WarnRequeuesLocked(*rt, requeues,
                     absl::StrCat("rank ", w.rank, " failed ", request.task_id(), " (",
                                  request.error(), ")"));
  ApplySchedulerErrorLocked(*rt);
  return absl::OkStatus();
}

StatusOr<bool> JobManager::Heartbeat(const std::string& worker_id) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(worker_id));
  const v1::JobState state = wj.second->job.state();
  return IsFinalState(state) && state != v1::JOB_STATE_SUCCEEDED;
}

// ------------------------------------------------------------------------------------------
// Monitor

void JobManager::Tick() {
  Lock lock(mu_);
  for (const WorkerInfo& dead : workers_.Expire()) {
    std::shared_ptr<JobRuntime> rt = FindLocked(dead.job_id);
    if (!rt) continue;
    rt->job.set_workers_alive(workers_.AliveCount(dead.job_id));
    if (IsFinalState(rt->job.state()) || !rt->scheduler) continue;
    const std::string why =
        absl::StrCat("rank ", dead.rank, " (worker ", dead.worker_id, ", pid ", dead.pid, " on ",
                     dead.hostname, ") sent no heartbeat for ",
                     absl::SixDigits(workers_.timeout_s()), " s");
    QCAL_LOG_WARN("job {}: {}", rt->job.id(), why);
    EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING, why);
    WarnRequeuesLocked(*rt, rt->scheduler->WorkerLost(dead.worker_id, dead.rank), why);
    ApplySchedulerErrorLocked(*rt);
    if (!IsFinalState(rt->job.state()) && rt->scheduler->needs_new_group() && rt->group) {
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
