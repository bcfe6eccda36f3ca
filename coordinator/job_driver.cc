// JobManager's driver thread (job_manager.h): plan → launch → wait for the tasks → finalize.
#include "coordinator/job_manager.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "report/report.h"
#include "runner/job_dir.h"
#include "runner/task_plan.h"
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
  rt->run = std::make_unique<JobRun>(rt->job.id(), spec.workers(), recipe, *plan, EvalsOf(spec),
                                     options_.max_attempts, options_.wait_ms);
  const TaskPlan& tasks = rt->run->tasks();
  rt->job.set_blocks_total(tasks.num_blocks);
  rt->job.set_blocks_done(static_cast<int64_t>(tasks.resumed.size()));
  rt->evals = tasks.evals;
  rt->eval_results.assign(tasks.evals.size(), v1::EvalResult());
  for (int64_t l : tasks.resumed) {
    v1::BlockMetrics* b = rt->job.add_blocks();
    b->set_block(l);
    b->set_resumed(true);
    b->set_rank(-1);
    auto it = rt->run->finished().find(l);
    if (it != rt->run->finished().end()) {
      *b->mutable_result() = it->second;
      b->set_seconds(it->second.seconds());
    }
  }
  if (!tasks.resumed.empty()) {
    EmitLocked(*rt, v1::JOB_EVENT_KIND_LOG,
               absl::StrCat("resuming: ", tasks.resumed.size(), " of ", tasks.num_blocks,
                            " blocks were finished by an earlier run"));
  }
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
    ls.log_path = JobPaths(plan->job_dir).workers_log;
    ls.pid_file = JobPaths(plan->job_dir).workers_pid;
    rt->launch = ls;
    if (Status made = MakeWorkerCredentialLocked(*rt); !made.ok()) {
      FailLocked(*rt, std::string(made.message()));
      return;
    }
    if (Status launched = LaunchGroupLocked(*rt); !launched.ok()) {
      FailLocked(*rt, std::string(launched.message()));
      return;
    }
    SetStateLocked(*rt, v1::JOB_STATE_RUNNING, "");
    SetPhaseLocked(*rt, rt->run->scheduler().phase());
    rt->cv.wait(lock, [&] {
      return IsFinalState(rt->job.state()) || !rt->run->scheduler().error().empty() ||
             rt->run->finalize_due() || shutting_down_;
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
  rt->run->FinalizeDone();
  if (!rt->run->done()) {
    SetPhaseLocked(*rt, rt->run->scheduler().phase());  // evaluation by the workers
    rt->cv.wait(lock, [&] {
      return IsFinalState(rt->job.state()) || rt->run->done() || shutting_down_;
    });
    if (IsFinalState(rt->job.state()) || shutting_down_) return;
    // The report finalize wrote had no perplexities yet: write it again with them.
    std::vector<report::EvalRow> rows;
    for (const v1::EvalResult& r : rt->eval_results) {
      if (!r.has_params()) continue;
      auto it = std::find_if(rows.begin(), rows.end(),
                             [&](const report::EvalRow& e) {
                               return e.label == r.params().label();
                             });
      if (it == rows.end()) {
        report::EvalRow row;
        row.label = r.params().label();
        row.ctx = r.params().ctx();
        row.mean_kl = std::nan("");  // the workers' evaluation measures perplexity only
        it = rows.insert(rows.end(), row);
      }
      if (r.params().model() == "float") {
        it->float_perplexity = r.perplexity();
        it->tokens_scored = r.scored();
      } else {
        it->quantized_perplexity = r.perplexity();
      }
    }
    const JobPaths paths(JobDirOf(spec));
    lock.unlock();
    report::ReportInputs inputs = job::ReportInputsOf(paths.dir, spec.out_dir());
    inputs.evals = rows;
    const Status written = report::WriteReport(inputs, paths.report);
    lock.lock();
    if (!written.ok()) {
      QCAL_LOG_WARN("job {}: the report was not rewritten with the perplexities: {}",
                    rt->job.id(), written.ToString());
    }
    if (IsFinalState(rt->job.state()) || shutting_down_) return;
  }
  SetPhaseLocked(*rt, kPhaseDone);
  SetStateLocked(*rt, v1::JOB_STATE_SUCCEEDED, "");
}

}  // namespace qcal::coordinator
