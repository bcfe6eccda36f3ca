// JobManager's WorkerService calls (job_manager.h): register, next task, progress, results
// (CompleteTask in three steps, file work outside the lock), failures, heartbeats.
#include "coordinator/job_manager.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "rpc/job_state.h"
#include "runner/task_results.h"

namespace qcal::coordinator {

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
  if (!rt->run || rt->run->done()) {
    v1::Task t;  // still planning, or finalizing: the job is not over yet
    t.set_kind(v1::TASK_KIND_WAIT);
    t.set_job_id(rt->job.id());
    t.set_retry_after_ms(options_.wait_ms);
    return t;
  }
  const auto before = rt->run->scheduler().running();
  v1::Task task = rt->run->Next(w.worker_id, w.rank);
  auto held = before.find(w.worker_id);
  if (held != before.end()) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_WARNING,
               absl::StrCat("rank ", w.rank, " asked for a new task while holding ", held->second,
                            "; that task returns to the queue"));
  }
  ApplySchedulerErrorLocked(*rt);
  if (IsFinalState(rt->job.state())) return ShutdownTask(*rt);
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

Status JobManager::RejectResultLocked(JobRuntime& rt, const WorkerInfo& w,
                                      const std::string& task_id, const Status& why) {
  const std::string msg = absl::StrCat("invalid result for ", task_id, ": ", why.message());
  StatusOr<std::vector<JobScheduler::Requeue>> requeues =
      rt.run->scheduler().Fail(w.worker_id, w.rank, task_id, msg, /*retryable=*/true);
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
//      journaled (block_done / e2e_done / phase_done), fsynced;
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
    if (IsFinalState(rt->job.state()) || !rt->run) return absl::OkStatus();  // nothing to record

    const StatusOr<JobScheduler::TaskInfo> info = rt->run->scheduler().Lookup(task_id);
    if (!info.ok()) return info.status();
    // A superseded attempt whose work another attempt finished: its files are never committed.
    if (info->done) {
      QCAL_RETURN_IF_ERROR(rt->run->Record(w.worker_id, w.rank, request).status());
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("rank ", w.rank, " also completed ", task_id, " (ignored)"));
      return absl::OkStatus();
    }
    // Check the typed result against the task before accepting it; a bad result counts as a
    // failed attempt (the work returns to the queue).
    StatusOr<std::vector<v1::WrittenFile>> named = job::ResultFiles(request, *info);
    if (!named.ok()) return RejectResultLocked(*rt, w, task_id, named.status());
    files = std::move(*named);
    // A result with neither files nor journal entries (evaluation; calibration without a
    // trained phase) is recorded at once; one with journal entries only (rank 0's calibration
    // with a trained phase: the scheduler retires a duplicate, and a repeated phase_done only
    // repeats a curve) is journaled first.
    if (files.empty() && job::JournalEntries(request).empty()) {
      return RecordCompletionLocked(rt.get(), w, request);
    }
    if (!files.empty()) work = job::WorkKey(*info);
    if (!work.empty() && !rt->committing.insert(work).second) {
      // Another attempt of the same work is committing its (identical) files; its completion
      // retires this attempt too.
      EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
                 absl::StrCat("rank ", w.rank, " also completed ", task_id,
                              " (ignored: another attempt is being committed)"));
      return absl::OkStatus();
    }
  }

  // Accept the attempt: its staged files become the output, then the journal records them.
  job::Acceptance accepted;
  {
    std::lock_guard<std::mutex> file_lock(rt->files_mu);
    accepted = job::AcceptResultFiles(*rt->workspace, request, files);
  }
  Lock lock(mu_);
  if (!accepted.check.ok()) {
    if (!work.empty()) rt->committing.erase(work);
    if (IsFinalState(rt->job.state())) return absl::OkStatus();
    return RejectResultLocked(*rt, w, task_id, accepted.check);
  }
  if (!accepted.commit.ok()) {
    FailLocked(*rt, absl::StrCat("committing ", task_id, ": ", accepted.commit.message()));
    return accepted.commit;
  }
  return RecordCompletionLocked(rt.get(), w, request);
}

Status JobManager::RecordCompletionLocked(JobRuntime* rt, const WorkerInfo& w,
                                          const v1::CompleteTaskRequest& request) {
  const std::string& task_id = request.task_id();
  // The job may have ended while the files were committed: they and their journal entry are
  // kept (a resume counts them); there is nothing more to record.
  if (IsFinalState(rt->job.state())) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(JobScheduler::Completion c, rt->run->Record(w.worker_id, w.rank, request));
  if (c.kind == v1::TASK_KIND_CALIBRATE) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("rank ", w.rank, " finished calibration (",
                            rt->run->scheduler().calibrate_ranks_done(), " of ",
                            rt->job.spec().workers(), ")"));
  } else if (c.kind == v1::TASK_KIND_QUANTIZE_BLOCK && c.part > 0) {
    // One expert group of a split MoE block: the block counts when its assembly is done.
    const v1::BlockPart& part = request.block().part();
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrFormat("block %d experts [%d, %d) done by rank %d in %.2f s", c.block,
                               part.expert_begin(), part.expert_end(), w.rank,
                               request.block().seconds()));
  } else if (c.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
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
  if (c.phase_finished && !rt->run->done() && !rt->run->finalize_due()) {
    SetPhaseLocked(*rt, rt->run->scheduler().phase());
  }
  if (rt->run->done() || rt->run->finalize_due()) {
    rt->cv.notify_all();  // the driver finalizes / finishes
  }
  return absl::OkStatus();
}

Status JobManager::FailTask(const v1::FailTaskRequest& request) {
  Lock lock(mu_);
  QCAL_ASSIGN_OR_RETURN(auto wj, WorkerAndJobLocked(request.worker_id()));
  auto& [w, rt] = wj;
  if (IsFinalState(rt->job.state()) || !rt->run) return absl::OkStatus();
  QCAL_LOG_WARN("job {}: rank {} failed task {}: {}", rt->job.id(), w.rank, request.task_id(),
                request.error());
  QCAL_ASSIGN_OR_RETURN(std::vector<JobScheduler::Requeue> requeues,
                        rt->run->scheduler().Fail(w.worker_id, w.rank, request.task_id(),
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

}  // namespace qcal::coordinator
