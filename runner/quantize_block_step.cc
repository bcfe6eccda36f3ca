// QuantizeBlockStep: one block read, prepared, quantized and written as a staged shard
// (runner/job_steps.h).
#include "runner/job_steps.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/phase_trace.h"
#include "engine/calib/cache.h"
#include "engine/calib/hessian.h"
#include "runner/job_dir.h"
#include "runner/phase_products.h"
#include "runner/sequential_store.h"
#include "runner/shard_writers.h"
#include "runner/step_util.h"

namespace qcal::job {
namespace {

// What a block task reads besides the float block, as the method's needs ask (the tensors
// methods::BlockInputs points at): the float model's Hessians and block-boundary activations
// from calibration, a sequential method's inputs from the previous block.
struct BlockCalibration {
  calib::BlockHessians hessians;
  at::Tensor ft_inputs, ft_targets;  // float activations into and out of the block
  at::Tensor x, x_float;             // sequential: the block's inputs (and the float model's)
};

// Loads what `needs` asks for into *data and points *in at it. FailedPrecondition naming the
// block when calibration's products are missing (run calibration first).
Status LoadBlockCalibration(JobContext* ctx, int64_t layer, const MethodNeeds& needs,
                            BlockCalibration* data, methods::BlockInputs* in) {
  const JobPaths paths(ctx->spec.job_dir());
  if (needs.float_hessians) {
    // Mapped: each kind's mean is made from the file when its first linear asks for it.
    auto h = calib::LoadBlockHessians(calib::HessianPath(paths.hessians, layer), ctx->calib_key,
                                      /*mapped=*/true);
    if (!h.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no usable Hessians (run calibration first): ", h.status().message()));
    }
    data->hessians = std::move(*h);
    in->hessians = &data->hessians;
  }
  if (needs.float_activations) {
    const std::vector<int64_t> shape = {ctx->recipe.calibration.num_sequences, ctx->seq_len,
                                        ctx->config.hidden_size};
    auto inputs = calib::LoadActivation(calib::ActivationPath(paths.activations, layer),
                                        ctx->calib_key, shape);
    auto targets = inputs.ok()
                       ? calib::LoadActivation(calib::ActivationPath(paths.activations, layer + 1),
                                               ctx->calib_key, shape)
                       : inputs;
    if (!inputs.ok() || !targets.ok()) {
      const Status& s = inputs.ok() ? targets.status() : inputs.status();
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no usable activations (run calibration first): ", s.message()));
    }
    data->ft_inputs = std::move(*inputs);
    data->ft_targets = std::move(*targets);
    in->ft_inputs = &data->ft_inputs;
    in->ft_targets = &data->ft_targets;
  }
  if (needs.sequential) {
    QCAL_ASSIGN_OR_RETURN(data->x, SequentialInputs(ctx, layer));
    in->x = &data->x;
    in->propagate = layer + 1 < ctx->config.num_hidden_layers;
    if (needs.sequential_float) {
      QCAL_ASSIGN_OR_RETURN(data->x_float, SequentialFloatInputs(ctx, layer));
      in->x_float = &data->x_float;
    }
  }
  return absl::OkStatus();
}

// The block's result from the quantizer's: its phases (and where "quantize" went: the linears'
// rounding steps, summed, and the block's fine-tuning), errors, curves and per-linear metrics.
void FillBlockResult(const quant::BlockTaskResult& task, const PhaseTrace& trace,
                     v1::BlockResult* result) {
  trace.AppendTo(result->mutable_phases());
  double transform = 0, factor = 0, round = 0, refine = 0, proxy = 0;
  for (const quant::LinearMetrics& m : task.linears) {
    transform += m.transform_seconds;
    factor += m.factor_seconds;
    round += m.round_seconds;
    refine += m.refine_seconds;
    proxy += m.proxy_seconds;
  }
  for (const auto& [part, seconds] : {std::pair<const char*, double>{"transform", transform},
                                      {"factor", factor},
                                      {"round", round},
                                      {"refine", refine},
                                      {"proxy loss", proxy},
                                      {"fine-tune", task.finetune_seconds}}) {
    AppendPhasePart(result->mutable_phases(), "quantize", part, seconds);
  }
  result->set_mse_before_ft(task.mse_before_ft);
  result->set_mse_after_ft(task.mse_after_ft);
  for (const quant::FinetuneCurve& c : task.ft_curves) {
    v1::FinetuneCurve* curve = result->add_ft_curves();
    curve->mutable_heldout()->Add(c.heldout.begin(), c.heldout.end());
    curve->mutable_train()->Add(c.train.begin(), c.train.end());
  }
  AddMetrics(task.linears, result);
}

}  // namespace

StatusOr<v1::BlockResult> QuantizeBlockStep(JobContext* ctx, int64_t layer,
                                            const std::string& attempt,
                                            const JobEventFn& on_event) {
  const auto t0 = step::Clock::now();
  const int64_t blocks = ctx->config.num_hidden_layers;
  if (layer < 0 || layer >= blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " does not exist (the model has ", blocks, ")"));
  }
  const MethodNeeds needs = ctx->recipe.needs();
  PhaseTrace trace;

  // The method with its global phases' products, before anything is prepared.
  if (!needs.global_phases.empty()) trace.Begin("load phase products");
  QCAL_RETURN_IF_ERROR(BindPhaseProducts(ctx, layer));

  // The float block, streamed in and prepared by the method.
  trace.Begin("read weights");
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights weights, ctx->source->LoadBlockWeights(layer));
  trace.Begin("transform");
  QCAL_RETURN_IF_ERROR(ctx->method->transform().PrepareBlock(layer, &weights));

  trace.Begin("load calibration");
  methods::BlockInputs in;
  in.layer = layer;
  in.rope = &ctx->source->rope();
  in.batch = ctx->spec.calib_batch();
  in.gpu = ctx->gpu;
  in.device = ctx->torch_device;
  if (on_event) {
    in.progress = [&on_event, layer](int64_t done, int64_t total, const std::string& step) {
      step::Emit(on_event, "block", done, total, absl::StrCat("block ", layer, ": ", step));
    };
  }
  BlockCalibration data;
  QCAL_RETURN_IF_ERROR(LoadBlockCalibration(ctx, layer, needs, &data, &in));

  trace.Begin("quantize");
  QCAL_RETURN_IF_ERROR(methods::CheckBlockInputs(in, needs));
  StatusOr<quant::BlockTaskResult> quantized =
      ctx->method->quantizer().QuantizeBlock(std::move(weights), in);
  if (!quantized.ok() && needs.float_hessians) {
    // A Hessian that is not positive definite even after damping, say, names the file it came
    // from (so a damaged or stale cache can be found and removed).
    return Annotate(quantized.status(),
                    absl::StrCat("block ", layer, " (Hessians from ",
                                 calib::HessianPath(JobPaths(ctx->spec.job_dir()).hessians, layer),
                                 ")"));
  }
  QCAL_RETURN_IF_ERROR(quantized.status());

  trace.Begin("write");
  if (in.propagate) QCAL_RETURN_IF_ERROR(SaveSequentialInputs(ctx, layer, data.x, in.x_float));
  if (needs.sequential && layer > 0) DropSequentialInputs(ctx, layer);
  v1::BlockResult result;
  result.set_layer(layer);
  if (needs.transforms_non_block && layer == 0) {
    QCAL_ASSIGN_OR_RETURN(*result.add_also_wrote(),
                          WritePreparedNonBlockShardStaged(ctx, attempt));
  }
  QCAL_ASSIGN_OR_RETURN(*result.mutable_shard(),
                        WriteBlockShardStaged(ctx, layer, quantized->weights, attempt));
  trace.End();
  FillBlockResult(*quantized, trace, &result);
  result.set_seconds(step::Seconds(t0));
  return result;
}

}  // namespace qcal::job
