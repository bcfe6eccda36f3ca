// CalibrateStep: Hessians and activations on the float model, then the global phases. (runner/job_steps.h)
#include "runner/job_steps.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/phase_trace.h"
#include "common/safe_fs.h"
#include "engine/calib/calibration.h"
#include "runner/budgets.h"
#include "runner/job_dir.h"
#include "runner/phase_products.h"
#include "runner/step_util.h"

namespace qcal::job {

using step::Emit;

calib::CalibrationDirs CalibrationDirsOf(const std::string& job_dir) {
  const JobPaths paths(job_dir);
  return {paths.hessians, paths.activations, paths.spill};
}

namespace {

// One global phase (see CalibrateStep). Collective. Its curve, when it trained (from the job
// directory when the phase is reused from there).
StatusOr<std::optional<v1::PhaseCurve>> GlobalPhaseStep(comm::Comm& comm, JobContext* ctx,
                                                        const std::string& phase,
                                                        const JobEventFn& on_event) {
  const std::string path = JobPaths(ctx->spec.job_dir()).PhaseProducts(phase);
  int64_t reuse = 0;
  std::optional<v1::PhaseCurve> curve;
  if (comm.rank() == 0) {
    StatusOr<methods::PhaseResult> cached = LoadPhaseResult(path, phase, ctx->calib_key);
    reuse = cached.ok() ? 1 : 0;
    if (cached.ok()) curve = CurveOf(phase, cached->curve);
    if (!cached.ok() && !absl::IsNotFound(cached.status())) {
      QCAL_LOG_WARN("phase {}: {}; running it again", phase,
                    std::string(cached.status().message()));
    }
  }
  QCAL_RETURN_IF_ERROR(comm.Broadcast(&reuse, sizeof(reuse), 0));
  if (reuse) {
    Emit(on_event, "phase", 1, 1, absl::StrCat(phase, " (cached)"));
    return curve;
  }
  Emit(on_event, "phase", 0, 1, phase);
  methods::GlobalPhaseInputs in;
  in.comm = &comm;
  in.source = ctx->source.get();
  in.tokens = &ctx->tokens;
  in.batch = ctx->spec.calib_batch();
  in.bos_id = ctx->bos_id;
  in.max_memory = ctx->max_memory;
  in.state_dir = JobPaths(ctx->spec.job_dir()).phases;
  in.state_key = ctx->calib_key;
  StatusOr<methods::PhaseResult> ran = [&]() -> StatusOr<methods::PhaseResult> {
    QCAL_ASSIGN_OR_RETURN(const methods::GlobalPhase* part, ctx->method->phase(phase));
    return part->Run(in);
  }();
  Status saved = ran.status();
  if (saved.ok() && comm.rank() == 0) {
    saved = MakeDirs(JobPaths(ctx->spec.job_dir()).phases);
    if (saved.ok()) saved = SavePhaseResult(path, *ran, phase, ctx->calib_key);
  }
  int64_t failed = saved.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!saved.ok()) return Annotate(saved, absl::StrCat("phase ", phase));
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat("phase ", phase, " failed on another rank"));
  }
  Emit(on_event, "phase", 1, 1, phase);
  if (comm.rank() == 0) curve = CurveOf(phase, ran->curve);
  return curve;
}

// The Hessian / activation walk of CalibrateStep (below); `parts`: where its time went.
Status CalibrationWalk(comm::Comm& comm, JobContext* ctx, bool hessians, bool activations,
                       const JobEventFn& on_event, v1::CalibrateResult* out,
                       std::vector<std::pair<std::string, double>>* parts) {
  v1::CalibrateResult& result = *out;
  const int64_t flags[2] = {hessians, activations};
  calib::CalibrationOptions options;
  options.batch = ctx->spec.calib_batch();
  options.hessians = flags[0];
  options.activations = flags[1];
  options.keep_hessians = false;  // block tasks read them from the job directory
  options.memory_budget_bytes = ActivationBudget(*ctx);
  options.device_sum = ctx->rank.device_sum;
  options.gpu = ctx->gpu;
  options.precision = calib::ForwardPrecision(ctx->recipe.calibration);
  options.moe_route_all = ctx->recipe.calibration.moe_route_all;
  options.moe_min_tokens = ctx->recipe.calibration.moe_min_tokens;
  if (options.hessians) {
    QCAL_ASSIGN_OR_RETURN(options.shard_hessians, ShardHessians(comm, *ctx));
  }
  const int64_t blocks = ctx->config.num_hidden_layers;
  // One walk produces both products; its progress is reported as "calibrate" (Hessians), and
  // the activations as their own phase ("activations"), as the single-process job always did.
  const std::string walk_phase = options.hessians ? "calibrate" : "activations";
  Emit(on_event, walk_phase, 0, blocks,
       options.shard_hessians
           ? absl::StrCat("Hessian sums sharded over ", comm.size(),
                          " ranks (a block's working set exceeds the memory budget)")
           : "");
  QCAL_ASSIGN_OR_RETURN(
      calib::CalibrationResult calib,
      calib::Calibrate(comm, *ctx->source, ctx->tokens, CalibrationDirsOf(ctx->spec.job_dir()),
                       ctx->calib_key, options,
                       [&](int64_t d, int64_t t) { Emit(on_event, walk_phase, d, t); }));
  if (options.hessians && options.activations) {
    Emit(on_event, "activations", blocks, blocks,
         calib.activations_from_cache ? "cached" : "saved in the calibration pass");
  }
  result.set_tokens(calib.tokens);
  result.set_seconds(calib.seconds);
  result.set_hessians_from_cache(calib.from_cache);
  result.set_activations_from_cache(calib.activations_from_cache);
  if (comm.rank() == 0) {
    for (const auto& [layer, tokens] : calib.expert_tokens) {
      v1::ExpertLoad* load = result.add_expert_loads();
      load->set_layer(layer);
      for (int64_t t : tokens) load->add_routed_tokens(t);
      const int64_t experts = static_cast<int64_t>(tokens.size());
      if (options.moe_route_all) {
        for (int64_t e = 0; e < experts; ++e) load->add_every_token(e);
      } else if (auto it = calib.starved_experts.find(layer); it != calib.starved_experts.end()) {
        for (int64_t e : it->second) load->add_every_token(e);
      }
    }
  }
  *parts = {{"read weights", calib.read_seconds},
            {"forward", calib.forward_seconds},
            {"reduce", calib.reduce_seconds},
            {"save", calib.save_seconds}};
  return Status();
}

}  // namespace

StatusOr<v1::CalibrateResult> CalibrateStep(comm::Comm& comm, JobContext* ctx,
                                            const v1::CalibrateParams& params,
                                            const JobEventFn& on_event) {
  // Every rank takes rank 0's decision, so all walk the same collectives.
  int64_t flags[3] = {params.hessians(), params.activations(), params.phases()};
  QCAL_RETURN_IF_ERROR(comm.Broadcast(flags, sizeof(flags), 0));
  PhaseTrace trace;
  // Sampling reads the data files: a failure on one rank (a file missing on its host) must not
  // leave the others waiting in a collective.
  trace.Begin("tokens");
  const Status sampled = EnsureCalibrationTokens(ctx);
  int64_t failed = sampled.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!sampled.ok()) return sampled;
  if (failed > 0) {
    return absl::AbortedError("another rank could not sample the calibration data");
  }
  v1::CalibrateResult result;
  result.set_tokens(ctx->tokens.numel());
  result.set_rank(comm.rank());
  result.set_ranks(comm.size());
  const std::string walk = flags[0] ? "hessians" : "activations";
  std::vector<std::pair<std::string, double>> walk_parts;
  if (flags[0] || flags[1]) {
    // The walk: forward passes, Hessian sums and their reduction, cache files.
    trace.Begin(walk);
    QCAL_RETURN_IF_ERROR(CalibrationWalk(comm, ctx, flags[0] != 0, flags[1] != 0, on_event,
                                         &result, &walk_parts));
  }
  if (flags[2]) {
    for (const std::string& phase : ctx->recipe.needs().global_phases) {
      trace.Begin(absl::StrCat("phase ", phase));
      QCAL_ASSIGN_OR_RETURN(std::optional<v1::PhaseCurve> curve,
                            GlobalPhaseStep(comm, ctx, phase, on_event));
      if (curve) *result.add_curves() = std::move(*curve);  // rank 0 only
    }
  }
  trace.End();
  trace.AppendTo(result.mutable_phases());
  for (const auto& [part, seconds] : walk_parts) {
    AppendPhasePart(result.mutable_phases(), walk, part, seconds);
  }
  return result;
}

}  // namespace qcal::job
