#include "runner/quantize_job.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "runner/job_inputs.h"
#include "common/safe_fs.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/job_plan.h"
#include "common/phase_trace.h"
#include "runner/task_plan.h"
#include "engine/comm/comm.h"
#include "runner/job_run.h"
#include "runner/task_executor.h"
#include "runner/task_results.h"
#include "runner/workspace.h"

namespace qcal::job {
namespace {

using Clock = std::chrono::steady_clock;

double NumberOrNan(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_number() ? e[key].get<double>() : std::nan("");
}

std::vector<quant::LinearMetrics> MetricsOf(const v1::BlockResult& r) {
  std::vector<quant::LinearMetrics> out;
  for (const v1::LinearMetrics& m : r.metrics()) {
    quant::LinearMetrics q;
    q.name = m.name();
    q.proxy_loss = m.proxy_loss();
    q.relative = m.relative();
    q.code_bits = m.code_bits();
    q.stored_bits = m.stored_bits();
    q.seconds = m.seconds();
    out.push_back(q);
  }
  return out;
}

// The in-process executor's one worker (a world of one rank).
constexpr char kWorkerId[] = "in-process";

// The job once its inputs are checked and `workspace` is open (directories locked, plan made,
// journal open): the same run the coordinator drives for its workers (runner/job_run.h), its
// tasks executed here one at a time by the workers' executor (runner/task_executor.h) and
// accepted as the coordinator accepts a worker's result (runner/task_results.h: staged files
// checked, committed, journaled).
StatusOr<QuantizeJobResult> RunPlannedJob(const Recipe& recipe, const v1::JobSpec& spec,
                                          JobPlan plan,
                                          JobWorkspace& workspace, const JobEventFn& on_event,
                                          PhaseTrace* trace) {
  const auto t0 = Clock::now();
  trace->Begin("open");
  auto emit = [&](const std::string& phase, int64_t done, int64_t total, std::string msg = "") {
    if (on_event) on_event(JobEvent{phase, done, total, std::move(msg)});
  };
  RankOptions rank;
  rank.inputs_key = plan.inputs.key;  // the steps key their caches by it
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<JobContext> ctx, OpenJob(recipe, spec, rank));
  const int64_t blocks = plan.num_blocks;
  QuantizeJobResult result;
  result.out_dir = spec.out_dir();
  std::map<int64_t, nlohmann::json>& done = plan.block_done;  // finished layers' entries
  std::map<int64_t, std::vector<v1::PhaseTiming>> block_phases;

  JobRun run(kWorkerId, /*world_size=*/1, recipe, plan, {}, /*max_attempts=*/1, /*wait_ms=*/0);
  auto self = comm::MakeSelfComm();
  std::string traced = "open";
  while (!run.done()) {
    if (run.finalize_due()) {
      // Shard 0 (unless end-to-end fine-tuning or the method wrote it), index, config.json,
      // tokenizer files, job_done.
      trace->Begin("finalize");
      emit("finalize", 0, 1);
      QCAL_RETURN_IF_ERROR(workspace.Finalize(recipe, spec).status());
      emit("finalize", 1, 1);
      run.FinalizeDone();
      continue;
    }
    const std::string phase = run.scheduler().phase();
    v1::Task task = run.Next(kWorkerId, 0);
    if (!run.scheduler().error().empty()) return absl::InternalError(run.scheduler().error());
    if (task.kind() == v1::TASK_KIND_WAIT || task.kind() == v1::TASK_KIND_SHUTDOWN) {
      return absl::InternalError(absl::StrCat("the job's one rank was given no task in phase ",
                                              phase));
    }
    if (traced != phase) {
      trace->Begin(traced = phase);
      if (phase == kPhaseQuantize) {
        emit("quantize", static_cast<int64_t>(run.finished().size()), blocks);  // resumed ones
      }
    }
    QCAL_ASSIGN_OR_RETURN(v1::CompleteTaskRequest outcome,
                          ExecuteTask(*self, ctx.get(), task, on_event));
    QCAL_ASSIGN_OR_RETURN(JobScheduler::TaskInfo info, run.scheduler().Lookup(task.task_id()));
    QCAL_ASSIGN_OR_RETURN(std::vector<v1::WrittenFile> files, ResultFiles(outcome, info));
    if (!files.empty() || !JournalEntries(outcome).empty()) {
      const Acceptance accepted = AcceptResultFiles(workspace, outcome, files);
      QCAL_RETURN_IF_ERROR(accepted.check);
      QCAL_RETURN_IF_ERROR(accepted.commit);
    }
    QCAL_RETURN_IF_ERROR(run.Record(kWorkerId, 0, outcome).status());
    switch (task.kind()) {
      case v1::TASK_KIND_CALIBRATE: {
        const v1::CalibrateParams& params = task.calibrate();
        const v1::CalibrateResult& calib = outcome.calibrate();
        result.calib_tokens = calib.tokens();
        result.calib_seconds = calib.seconds();
        result.hessians_from_cache = params.hessians() && calib.hessians_from_cache();
        result.activations_from_cache = params.activations() && calib.activations_from_cache();
        result.calibrate_phases.assign(calib.phases().begin(), calib.phases().end());
        result.expert_loads.assign(calib.expert_loads().begin(), calib.expert_loads().end());
        break;
      }
      case v1::TASK_KIND_QUANTIZE_BLOCK: {
        const int64_t l = task.block();
        // A split MoE block's phases: its expert groups' and its assembly's, all counted.
        block_phases[l].insert(block_phases[l].end(), outcome.block().phases().begin(),
                               outcome.block().phases().end());
        if (task.has_part() && task.part().index() > 0) {
          emit("quantize", static_cast<int64_t>(run.finished().size()), blocks,
               absl::StrCat("block ", l, " experts [", task.part().expert_begin(), ", ",
                            task.part().expert_end(), ")"));
          break;
        }
        done[l] = BlockDoneEntry(outcome.block());
        emit("quantize", static_cast<int64_t>(run.finished().size()), blocks,
             absl::StrCat("block ", l));
        break;
      }
      case v1::TASK_KIND_FINETUNE_E2E: {
        const v1::FinetuneResult& e2e = outcome.finetune();
        result.e2e_kl_before = e2e.kl_before();
        result.e2e_kl_after = e2e.kl_after();
        result.finetune_phases.assign(e2e.phases().begin(), e2e.phases().end());
        break;
      }
      default:
        break;
    }
  }
  trace->End();

  for (int64_t l = 0; l < blocks; ++l) {
    BlockSummary summary;
    summary.layer = l;
    auto ran = block_phases.find(l);
    if (ran == block_phases.end()) {
      summary.resumed = true;
      ++result.blocks_resumed;
    } else {
      summary.phases = ran->second;
    }
    auto it = run.finished().find(l);
    if (it == run.finished().end()) {
      return absl::InternalError(absl::StrCat("block ", l, " was neither resumed nor quantized"));
    }
    const v1::BlockResult& block = it->second;
    summary.linears = MetricsOf(block);
    summary.seconds = block.seconds();
    summary.mse_before_ft = block.mse_before_ft();
    summary.mse_after_ft = block.mse_after_ft();
    result.blocks.push_back(std::move(summary));
  }
  const BitsPerWeight bits = AggregateBits(plan.config, done);
  result.code_bits = bits.code_bits;
  result.stored_bits = bits.stored_bits;
  if (!run.tasks().finetune_e2e && plan.e2e_finished) {
    result.e2e_resumed = true;
    result.e2e_kl_before = NumberOrNan(plan.e2e_done, "kl_before");
    result.e2e_kl_after = NumberOrNan(plan.e2e_done, "kl_after");
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

}  // namespace

StatusOr<QuantizeJobResult> RunQuantizeJob(const Recipe& recipe, const v1::JobSpec& spec_in,
                                           const JobEventFn& on_event) {
  // The job's record, resolved by the function the coordinator's validation and the workers use
  // (runner/job_inputs.h); where the job writes is made canonical once, here: below it no
  // component may be a link (common/safe_fs.h).
  v1::JobSpec spec = spec_in;
  QCAL_ASSIGN_OR_RETURN(*spec.mutable_out_dir(), CanonicalPath(spec.out_dir()));
  ResolveJobSpec(&spec);
  QCAL_ASSIGN_OR_RETURN(*spec.mutable_job_dir(), CanonicalPath(spec.job_dir()));
  if (spec.workers() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qcal quantize runs a job in one process; the spec asks for ", spec.workers(),
        " workers (qcal run / qcal submit run more)"));
  }

  // ---- Inputs: the checks the coordinator makes for a submitted job, before anything exists.
  QCAL_RETURN_IF_ERROR(CheckJobInputs(recipe, spec).status());

  // ---- The job directory, as the coordinator opens it for a service job: held (one driver: a
  // second run on it is refused, naming this one), planned (creates the directories;
  // fingerprints the inputs), the output directory held, the journal opened.
  std::error_code ec;
  const bool out_existed = std::filesystem::exists(spec.out_dir(), ec);
  const bool job_existed = std::filesystem::exists(spec.job_dir(), ec);
  std::unique_ptr<JobWorkspace> workspace =
      MakeDiskWorkspace(absl::StrCat("qcal quantize --out ", spec.out_dir()));
  StatusOr<QuantizeJobResult> result = [&]() -> StatusOr<QuantizeJobResult> {
    PhaseTrace trace;
    trace.Begin("plan");
    QCAL_ASSIGN_OR_RETURN(JobPlan plan, workspace->Open(recipe, spec));
    QCAL_ASSIGN_OR_RETURN(QuantizeJobResult done,
                          RunPlannedJob(recipe, spec, std::move(plan), *workspace, on_event,
                                        &trace));
    done.phases = trace.phases();
    for (const v1::PhaseTiming& p : done.phases) {
      done.peak_host_bytes = std::max(done.peak_host_bytes, p.peak_host_bytes());
      done.peak_device_bytes = std::max(done.peak_device_bytes, p.peak_device_bytes());
    }
    return done;
  }();
  const bool locked = workspace->HoldsJobDir();
  workspace->Close();
  // A job refused before it produced anything leaves nothing behind: the directories it created
  // are removed. Anything produced (a shard, a cached Hessian) is kept for a resume, whatever
  // failed (a full disk included). A job refused for another holder's lock touches nothing.
  if (!result.ok() && locked && !HoldsFinishedWork(spec.job_dir(), spec.out_dir())) {
    if (!job_existed) std::filesystem::remove_all(spec.job_dir(), ec);
    if (!out_existed) std::filesystem::remove_all(spec.out_dir(), ec);
  }
  return result;
}

}  // namespace qcal::job
