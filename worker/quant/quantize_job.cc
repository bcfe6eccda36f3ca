#include "worker/quant/quantize_job.h"

#include <chrono>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/job_layout.h"
#include "worker/quant/job_steps.h"
#include "worker/runtime/comm.h"

namespace qcal::quant {
namespace {

using Clock = std::chrono::steady_clock;

double NumberOrNan(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_number() ? e[key].get<double>() : std::nan("");
}

}  // namespace

StatusOr<QuantizeJobResult> RunQuantizeJob(const Recipe& recipe, const QuantizeJobOptions& opt_in,
                                           const std::function<void(const JobEvent&)>& on_event) {
  const auto t0 = Clock::now();
  QuantizeJobOptions opt = opt_in;
  if (opt.job_dir.empty()) opt.job_dir = opt.out_dir + ".job";
  if (opt.data_root.empty()) opt.data_root = "../shared";
  auto emit = [&](const std::string& phase, int64_t done, int64_t total, std::string msg = "") {
    if (on_event) on_event(JobEvent{phase, done, total, std::move(msg)});
  };

  // ---- Plan: validate inputs before any work.
  QCAL_ASSIGN_OR_RETURN(JobPlan plan, PlanJob(recipe, opt.model_dir, opt.out_dir, opt.job_dir));
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<JobContext> ctx, OpenJob(recipe, opt));
  const int64_t blocks = plan.num_blocks;
  QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(opt.job_dir + "/journal.jsonl"));
  QCAL_RETURN_IF_ERROR(journal.Append(JobStartEntry(recipe, plan.recipe_hash, opt.model_dir)));
  QuantizeJobResult result;
  result.out_dir = opt.out_dir;
  std::map<int64_t, nlohmann::json>& done = plan.block_done;  // finished layers' entries
  const bool need_e2e = plan.e2e_enabled && !plan.e2e_finished;

  // ---- Calibrate (a world of one: the same code the service runs on every rank).
  const CalibrateNeeds needs = NeedsFor(recipe, plan.all_blocks_finished());
  if (needs.hessians || needs.activations || need_e2e) {
    auto self = runtime::MakeSelfComm();
    QCAL_ASSIGN_OR_RETURN(CalibrateStepResult calib, CalibrateStep(*self, ctx.get(), needs,
                                                                   on_event));
    result.calib_tokens = calib.tokens;
    result.calib_seconds = calib.seconds;
    result.hessians_from_cache = needs.hessians && calib.hessians_from_cache;
    result.activations_from_cache = needs.activations && calib.activations_from_cache;
  }

  // ---- Quantize, block by block; each finished block is one atomic shard + a journal line.
  for (int64_t l = 0; l < blocks; ++l) {
    BlockSummary summary;
    summary.layer = l;
    if (plan.block_finished[l]) {
      summary.resumed = true;
      ++result.blocks_resumed;
    } else {
      QCAL_ASSIGN_OR_RETURN(nlohmann::json entry, QuantizeBlockStep(ctx.get(), l));
      QCAL_RETURN_IF_ERROR(journal.Append(entry));
      done[l] = std::move(entry);
    }
    const nlohmann::json& e = done[l];
    summary.linears = MetricsFromJson(e["metrics"]);
    summary.seconds = e.value("seconds", 0.0);
    summary.mse_before_ft = NumberOrNan(e, "mse_before_ft");
    summary.mse_after_ft = NumberOrNan(e, "mse_after_ft");
    result.blocks.push_back(std::move(summary));
    emit("quantize", l + 1, blocks, absl::StrCat("block ", l));
  }
  const BitsPerWeight bits = AggregateBits(plan.config, done);
  result.code_bits = bits.code_bits;
  result.stored_bits = bits.stored_bits;

  // ---- End-to-end fine-tuning: tune the quantized model (read back from its shards, so a
  // resumed job tunes exactly what an uninterrupted one would) against the float model.
  if (need_e2e) {
    QCAL_ASSIGN_OR_RETURN(nlohmann::json entry, FinetuneE2EStep(ctx.get(), done, on_event));
    QCAL_RETURN_IF_ERROR(journal.Append(entry));
    result.e2e_kl_before = NumberOrNan(entry, "kl_before");
    result.e2e_kl_after = NumberOrNan(entry, "kl_after");
  } else if (plan.e2e_finished) {
    result.e2e_resumed = true;
    result.e2e_kl_before = NumberOrNan(plan.e2e_done, "kl_before");
    result.e2e_kl_after = NumberOrNan(plan.e2e_done, "kl_after");
  }

  // ---- Finalize: shard 0 (unless end-to-end fine-tuning wrote it), index, config.json,
  // tokenizer files, job_done.
  emit("finalize", 0, 1);
  QCAL_RETURN_IF_ERROR(FinalizeJob(recipe, opt.model_dir, opt.out_dir, &journal).status());
  emit("finalize", 1, 1);
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

}  // namespace qcal::quant
