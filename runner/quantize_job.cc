#include "runner/quantize_job.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/job_inputs.h"
#include "common/job_layout.h"
#include "common/phase_trace.h"
#include "common/task_plan.h"
#include "engine/comm/comm.h"

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

// The job, once its inputs are checked and its job and output directories are locked.
StatusOr<QuantizeJobResult> RunLockedJob(const Recipe& recipe, const QuantizeJobOptions& opt,
                                         JobPlan plan, const JobEventFn& on_event,
                                         PhaseTrace* trace) {
  const auto t0 = Clock::now();
  trace->Begin("open");
  auto emit = [&](const std::string& phase, int64_t done, int64_t total, std::string msg = "") {
    if (on_event) on_event(JobEvent{phase, done, total, std::move(msg)});
  };
  QuantizeJobOptions with_key = opt;
  with_key.inputs_key = plan.inputs.key;  // the steps key their caches by it
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<JobContext> ctx, OpenJob(recipe, with_key));
  const int64_t blocks = plan.num_blocks;
  QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(opt.job_dir + "/journal.jsonl"));
  QCAL_RETURN_IF_ERROR(journal.Append(JobStartEntry(recipe, plan, opt.model_dir, opt.out_dir)));
  QuantizeJobResult result;
  result.out_dir = opt.out_dir;
  std::map<int64_t, nlohmann::json>& done = plan.block_done;  // finished layers' entries
  // The tasks the coordinator would hand its workers for this plan, run here in order.
  const TaskPlan tasks = MakeTaskPlan(recipe, plan);

  // ---- Calibrate (a world of one: the same code the service runs on every rank).
  if (tasks.calibrate) {
    trace->Begin("calibrate");
    const v1::CalibrateParams& params = tasks.calibrate_params;
    auto self = comm::MakeSelfComm();
    QCAL_ASSIGN_OR_RETURN(v1::CalibrateResult calib,
                          CalibrateStep(*self, ctx.get(), params, on_event));
    result.calib_tokens = calib.tokens();
    result.calib_seconds = calib.seconds();
    result.hessians_from_cache = params.hessians() && calib.hessians_from_cache();
    result.activations_from_cache = params.activations() && calib.activations_from_cache();
    result.calibrate_phases.assign(calib.phases().begin(), calib.phases().end());
  }

  // ---- Quantize, block by block; each finished block is committed, then journaled.
  if (!tasks.blocks.empty()) trace->Begin("quantize");
  for (int64_t l = 0; l < blocks; ++l) {
    BlockSummary summary;
    summary.layer = l;
    if (std::find(tasks.blocks.begin(), tasks.blocks.end(), l) == tasks.blocks.end()) {
      summary.resumed = true;
      ++result.blocks_resumed;
    } else {
      QCAL_ASSIGN_OR_RETURN(v1::BlockResult block,
                            QuantizeBlockStep(ctx.get(), l, absl::StrCat("block-", l)));
      summary.phases.assign(block.phases().begin(), block.phases().end());
      QCAL_RETURN_IF_ERROR(CommitFiles(opt.out_dir, FilesOf(block)));
      nlohmann::json entry = BlockDoneEntry(block);
      QCAL_RETURN_IF_ERROR(journal.Append(entry));
      done[l] = std::move(entry);
    }
    const v1::BlockResult block = BlockResultFromEntry(done[l]);
    summary.linears = MetricsOf(block);
    summary.seconds = block.seconds();
    summary.mse_before_ft = block.mse_before_ft();
    summary.mse_after_ft = block.mse_after_ft();
    result.blocks.push_back(std::move(summary));
    emit("quantize", l + 1, blocks, absl::StrCat("block ", l));
  }
  const BitsPerWeight bits = AggregateBits(plan.config, done);
  result.code_bits = bits.code_bits;
  result.stored_bits = bits.stored_bits;

  // ---- End-to-end fine-tuning: tune the quantized model (read back from its shards, so a
  // resumed job tunes exactly what an uninterrupted one would) against the float model.
  if (tasks.finetune_e2e) {
    trace->Begin("finetune");
    std::vector<v1::BlockResult> finished;
    for (const auto& [layer, entry] : done) finished.push_back(BlockResultFromEntry(entry));
    QCAL_ASSIGN_OR_RETURN(v1::FinetuneResult e2e,
                          FinetuneE2EStep(ctx.get(), finished, "e2e", on_event));
    QCAL_RETURN_IF_ERROR(CommitFiles(
        opt.out_dir, std::vector<v1::WrittenFile>(e2e.shards().begin(), e2e.shards().end())));
    QCAL_RETURN_IF_ERROR(journal.Append(E2eDoneEntry(e2e)));
    result.e2e_kl_before = e2e.kl_before();
    result.e2e_kl_after = e2e.kl_after();
    result.finetune_phases.assign(e2e.phases().begin(), e2e.phases().end());
  } else if (plan.e2e_finished) {
    result.e2e_resumed = true;
    result.e2e_kl_before = NumberOrNan(plan.e2e_done, "kl_before");
    result.e2e_kl_after = NumberOrNan(plan.e2e_done, "kl_after");
  }

  // ---- Finalize: shard 0 (unless end-to-end fine-tuning or the method wrote it), index,
  // config.json, tokenizer files, job_done.
  trace->Begin("finalize");
  emit("finalize", 0, 1);
  QCAL_RETURN_IF_ERROR(FinalizeJob(recipe, opt.model_dir, opt.out_dir, &journal).status());
  emit("finalize", 1, 1);
  trace->End();
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

}  // namespace

StatusOr<QuantizeJobResult> RunQuantizeJob(const Recipe& recipe, const QuantizeJobOptions& opt_in,
                                           const JobEventFn& on_event) {
  QuantizeJobOptions opt = opt_in;
  if (opt.job_dir.empty()) opt.job_dir = opt.out_dir + ".job";
  if (opt.data_root.empty()) opt.data_root = "../shared";

  // ---- Inputs: the checks the coordinator makes for a submitted job, before anything exists.
  JobInputs inputs;
  inputs.model_dir = opt.model_dir;
  inputs.out_dir = opt.out_dir;
  inputs.job_dir = opt.job_dir;
  inputs.data_root = opt.data_root;
  inputs.recipe_source = opt.recipe_source;
  QCAL_RETURN_IF_ERROR(CheckJobInputs(recipe, inputs).status());

  // ---- Hold the job directory (one driver: a second run on it is refused, naming this one),
  // plan (creates the directories; fingerprints the inputs), then hold the output directory.
  std::error_code ec;
  const bool out_existed = std::filesystem::exists(opt.out_dir, ec);
  const bool job_existed = std::filesystem::exists(opt.job_dir, ec);
  bool locked = false;
  StatusOr<QuantizeJobResult> result = [&]() -> StatusOr<QuantizeJobResult> {
    QCAL_ASSIGN_OR_RETURN(
        JobDirLock job_lock,
        JobDirLock::Acquire(opt.job_dir, absl::StrCat("qcal quantize --out ", opt.out_dir)));
    locked = true;
    PhaseTrace trace;
    trace.Begin("plan");
    QCAL_ASSIGN_OR_RETURN(JobPlan plan, PlanJob(recipe, opt.model_dir, opt.out_dir, opt.job_dir,
                                                opt.data_root));
    QCAL_ASSIGN_OR_RETURN(OutputDirLock lock, OutputDirLock::Acquire(opt.out_dir));
    QCAL_ASSIGN_OR_RETURN(QuantizeJobResult done,
                          RunLockedJob(recipe, opt, std::move(plan), on_event, &trace));
    trace.End();
    done.phases = trace.phases();
    for (const v1::PhaseTiming& p : done.phases) {
      done.peak_host_bytes = std::max(done.peak_host_bytes, p.peak_host_bytes());
    }
    return done;
  }();
  // A job refused before it produced anything leaves nothing behind: the directories it created
  // are removed. Anything produced (a shard, a cached Hessian) is kept for a resume, whatever
  // failed (a full disk included). A job refused for another holder's lock touches nothing.
  if (!result.ok() && locked && !HoldsFinishedWork(opt.job_dir, opt.out_dir)) {
    if (!job_existed) std::filesystem::remove_all(opt.job_dir, ec);
    if (!out_existed) std::filesystem::remove_all(opt.out_dir, ec);
  }
  return result;
}

}  // namespace qcal::job
