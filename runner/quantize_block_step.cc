// QuantizeBlockStep: one block read, prepared, quantized and written as a staged shard
// (runner/job_steps.h).
#include "runner/job_steps.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_layout.h"
#include "common/phase_trace.h"
#include "common/safetensors.h"
#include "engine/model/block_select.h"
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

// BlockInputs for block `layer` of `ctx` (what every block task's quantizer gets besides its
// calibration).
methods::BlockInputs MakeBlockInputs(JobContext* ctx, int64_t layer, const JobEventFn& on_event) {
  methods::BlockInputs in;
  in.layer = layer;
  in.rope = &ctx->source->rope();
  in.batch = ctx->spec.calib_batch();
  in.gpu = ctx->gpu;
  in.device = ctx->torch_device;
  if (on_event) {
    in.progress = [on_event, layer](int64_t done, int64_t total, const std::string& step) {
      step::Emit(on_event, "block", done, total, absl::StrCat("block ", layer, ": ", step));
    };
  }
  return in;
}

// The method's quantizer on the loaded block and its calibration.
StatusOr<quant::BlockTaskResult> QuantizeLoaded(JobContext* ctx, const MethodNeeds& needs,
                                                model::BlockWeights weights,
                                                const methods::BlockInputs& in) {
  QCAL_RETURN_IF_ERROR(methods::CheckBlockInputs(in, needs));
  StatusOr<quant::BlockTaskResult> quantized =
      ctx->method->quantizer().QuantizeBlock(std::move(weights), in);
  if (!quantized.ok() && needs.float_hessians) {
    // A Hessian that is not positive definite even after damping, say, names the file it came
    // from (so a damaged or stale cache can be found and removed).
    return Annotate(quantized.status(),
                    absl::StrCat("block ", in.layer, " (Hessians from ",
                                 calib::HessianPath(JobPaths(ctx->spec.job_dir()).hessians,
                                                    in.layer),
                                 ")"));
  }
  return quantized;
}

// The expert groups of an assembly task, checked: they tile [0, experts) in order, and each
// committed part file still has the checksum its task reported.
StatusOr<std::vector<v1::BlockResult>> CheckedGroups(JobContext* ctx, int64_t layer,
                                                     std::vector<v1::BlockResult> groups) {
  std::sort(groups.begin(), groups.end(), [](const v1::BlockResult& a, const v1::BlockResult& b) {
    return a.part().expert_begin() < b.part().expert_begin();
  });
  int64_t next = 0;
  for (const v1::BlockResult& g : groups) {
    const std::string path = ctx->spec.out_dir() + "/" + g.shard().name();
    if (g.layer() != layer || g.part().expert_begin() != next ||
        g.part().expert_end() <= next ||
        g.shard().name() != PartFileName(layer, g.part().expert_begin(), g.part().expert_end())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", layer, ": the assembly task's expert groups do not cover experts [0, ",
          ctx->config.num_experts, ") in order (at expert ", next, ": ", path, ")"));
    }
    QCAL_ASSIGN_OR_RETURN(std::string sum, FileChecksum(path));
    if (sum != g.shard().checksum()) {
      return absl::DataLossError(absl::StrCat(path, ": checksum ", sum, ", its task reported ",
                                              g.shard().checksum()));
    }
    next = g.part().expert_end();
  }
  if (next != ctx->config.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": the expert groups end at ",
                                                   next, " of ", ctx->config.num_experts,
                                                   " experts"));
  }
  return groups;
}

}  // namespace

StatusOr<v1::BlockResult> QuantizeBlockPartStep(JobContext* ctx, int64_t layer,
                                                const v1::BlockPart& part,
                                                const std::vector<v1::BlockResult>& groups,
                                                const std::string& attempt,
                                                const JobEventFn& on_event) {
  const auto t0 = step::Clock::now();
  const LlamaConfig& c = ctx->config;
  if (layer < 0 || layer >= c.num_hidden_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " does not exist (the model has ", c.num_hidden_layers, ")"));
  }
  const MethodNeeds needs = ctx->recipe.needs();
  if (!needs.expert_parts || !c.IsMoeLayer(layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, ": part ", part.index(), " of a block split over tasks, but ",
        c.IsMoeLayer(layer) ? "recipe '" + ctx->recipe.name + "' quantizes whole blocks"
                            : std::string("the block has no routed experts")));
  }
  const bool group = part.index() > 0;
  if (group && (part.expert_begin() < 0 || part.expert_end() <= part.expert_begin() ||
                part.expert_end() > c.num_experts)) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": experts [",
                                                   part.expert_begin(), ", ", part.expert_end(),
                                                   ") out of range [0, ", c.num_experts, ")"));
  }
  PhaseTrace trace;
  if (!needs.global_phases.empty()) trace.Begin("load phase products");
  QCAL_RETURN_IF_ERROR(BindPhaseProducts(ctx, layer));

  // Only what this part quantizes is read: an expert group's experts, or the block without its
  // experts (the method's transform leaves experts as they are: MethodNeeds::expert_parts).
  trace.Begin("read weights");
  model::BlockSelection select;
  select.dense = !group;
  select.expert_begin = group ? part.expert_begin() : 0;
  select.expert_end = group ? part.expert_end() : 0;
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> model,
                        CheckpointReader::Open(ctx->spec.model_dir()));
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights weights,
                        model::LoadBlockWeightsPart(*model, c, layer, select));
  if (!group) {
    trace.Begin("transform");
    QCAL_RETURN_IF_ERROR(ctx->method->transform().PrepareBlock(layer, &weights));
  }

  trace.Begin("load calibration");
  methods::BlockInputs in = MakeBlockInputs(ctx, layer, on_event);
  in.dense = select.dense;
  in.expert_begin = select.expert_begin;
  in.expert_end = select.expert_end;
  BlockCalibration data;
  QCAL_RETURN_IF_ERROR(LoadBlockCalibration(ctx, layer, needs, &data, &in));

  trace.Begin("quantize");
  StatusOr<quant::BlockTaskResult> quantized = QuantizeLoaded(ctx, needs, std::move(weights), in);
  QCAL_RETURN_IF_ERROR(quantized.status());
  if (quantized->weights.moe == nullptr) {
    return absl::InternalError(absl::StrCat("block ", layer, ": the quantizer lost the experts"));
  }

  v1::BlockResult result;
  result.set_layer(layer);
  if (group) {
    trace.Begin("write");
    SafetensorsWriter writer;
    writer.SetMetadata("format", "pt");
    writer.SetMetadata("qcal_block", std::to_string(layer));
    writer.SetMetadata("qcal_experts",
                       absl::StrCat(part.expert_begin(), "-", part.expert_end()));
    QCAL_RETURN_IF_ERROR(ctx->method->block_format().AppendExpertTensors(
        layer, *quantized->weights.moe, part.expert_begin(), part.expert_end(), &writer));
    QCAL_ASSIGN_OR_RETURN(
        *result.mutable_shard(),
        WriteStagedFile(ctx->spec.out_dir(),
                        PartFileName(layer, part.expert_begin(), part.expert_end()), attempt,
                        writer));
    *result.mutable_part() = part;
    trace.End();
    FillBlockResult(*quantized, trace, &result);
    result.set_seconds(step::Seconds(t0));
    return result;
  }

  // The assembly: the block's shard, its experts' tensors copied from the groups' part files as
  // they store them (streamed: the experts are never in memory here).
  trace.Begin("write");
  QCAL_ASSIGN_OR_RETURN(std::vector<v1::BlockResult> checked,
                        CheckedGroups(ctx, layer, groups));
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<methods::BlockFormat::StoredExperts> stored;
  for (const v1::BlockResult& g : checked) {
    QCAL_ASSIGN_OR_RETURN(files.emplace_back(),
                          SafetensorsFile::Open(ctx->spec.out_dir() + "/" + g.shard().name()));
    stored.push_back({files.back().get(), g.part().expert_begin(), g.part().expert_end()});
  }
  QCAL_ASSIGN_OR_RETURN(
      *result.mutable_shard(),
      WriteAssembledBlockShardStaged(ctx, layer, quantized->weights, stored, attempt));
  trace.End();
  FillBlockResult(*quantized, trace, &result);
  // The block's metrics in the order one task reports them: its other linears, then the
  // experts group by group.
  for (const v1::BlockResult& g : checked) {
    for (const v1::LinearMetrics& m : g.metrics()) *result.add_metrics() = m;
    *result.add_merged_parts() = g.shard();
  }
  result.set_seconds(step::Seconds(t0));
  return result;
}

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
  methods::BlockInputs in = MakeBlockInputs(ctx, layer, on_event);
  BlockCalibration data;
  QCAL_RETURN_IF_ERROR(LoadBlockCalibration(ctx, layer, needs, &data, &in));

  trace.Begin("quantize");
  StatusOr<quant::BlockTaskResult> quantized = QuantizeLoaded(ctx, needs, std::move(weights), in);
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
