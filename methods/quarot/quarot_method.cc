#include "methods/quarot/quarot_method.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "methods/quarot/checkpoint.h"
#include "methods/quarot/quarot_model.h"
#include "methods/quarot/quarot_spec.h"
#include "engine/qsim/fp8_kv.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::quarot {

Status QuarotParts::PrepareBlock(int64_t layer, model::BlockWeights* weights) const {
  return Annotate(PrepareBlockWeights(*weights, config_, recipe_, plan_, layer),
                  absl::StrCat("block ", layer));
}

StatusOr<at::Tensor> QuarotParts::PrepareEmbeddingRows(const at::Tensor& rows) const {
  return qsim::RotateEmbeddingRows(rows, plan_);
}

at::Tensor QuarotParts::PrepareFinalNorm(const at::Tensor& final_norm) const {
  return qsim::FusedFinalNorm(final_norm, plan_);
}

StatusOr<at::Tensor> QuarotParts::PrepareHeadRows(const at::Tensor& rows,
                                     const at::Tensor& final_norm) const {
  return qsim::RotateHeadRows(rows, final_norm, plan_);
}

StatusOr<quant::BlockTaskResult> QuarotParts::QuantizeBlock(model::BlockWeights float_weights,
                                               const BlockInputs& in) const {
  model::DecoderBlock block(config_, std::move(float_weights));
  QCAL_RETURN_IF_ERROR(qsim::InstallOnlineRotations(block, plan_));
  QCAL_ASSIGN_OR_RETURN(quant::BlockTaskResult result,
                        QuantizeRotatedBlock(block, *in.rope, recipe_, plan_, in.layer, in.x,
                                             in.batch, in.propagate, in.gpu, in.progress));
  result.weights = std::move(block.mutable_weights());
  return result;
}

Status QuarotParts::AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                          SafetensorsWriter* writer) const {
  return AppendQuarotBlockTensors(config_, layer, weights, writer);
}

StatusOr<model::BlockWeights> QuarotParts::LoadBlock(CheckpointReader& ckpt, int64_t layer) const {
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadQuarotBlockWeights(ckpt, config_, layer));
  QCAL_RETURN_IF_ERROR(CheckQuarotBlock(ckpt.dir(), layer, w, recipe_, plan_));
  return w;
}

Status QuarotParts::Install(model::DecoderBlock* block, int64_t layer) const {
  return InstallQuantizedInference(*block, config_, layer, recipe_, plan_);
}

StatusOr<ServedForward> QuarotParts::Served() const {
  // R1 and R2 are fused into the stored weights (and R1 into the embedding and head): a plain
  // forward reproduces them. The rest runs at inference time.
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe_));
  ServedForward served;
  if (plan_.r3) served.online.push_back({"the online Hadamard R3 on queries and keys"});
  if (plan_.r4 && plan_.r4_block > 0) {
    served.online.push_back({"the online Hadamard R4 on the down_proj input", true});
    served.input_hadamards.push_back({model::LinearKind::kDown, plan_.r4_block});
  } else if (plan_.r4) {
    served.online.push_back({"the online Hadamard R4 on the down_proj input (of the whole "
                             "intermediate size; rotation.r4_block makes it block-diagonal)"});
  }
  if (q->activations.enabled()) {
    served.online.push_back({absl::StrCat(q->activations.bits, "-bit activation quantization"),
                             true});
    served.linear_inputs = q->activations;
  }
  if (q->kv_cache.enabled() && q->kv_cache.format == "fp8") {
    ServedForward::Step step{"FP8 (E4M3) KV-cache quantization with static per-tensor scales"};
    step.on_kv_cache = true;
    served.online.push_back(step);
    served.kv_cache = q->kv_cache;
  } else if (q->kv_cache.enabled()) {
    served.online.push_back({absl::StrCat(q->kv_cache.bits, "-bit ", q->kv_cache.format,
                                          " KV-cache quantization",
                                          q->kv_cache.k_sort ? " with K-sort" : "")});
  }
  return served;
}

StatusOr<StaticKvScales> QuarotParts::KvCacheScales(const model::BlockWeights& weights,
                                                    int64_t layer) const {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe_));
  QCAL_ASSIGN_OR_RETURN(const qsim::KvStaticRanges r, StaticKvRanges(weights, *q, layer));
  if (q->kv_cache.format != "fp8") {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": the recipe's KV cache is not FP8"));
  }
  return StaticKvScales{qsim::Fp8StaticScale(r.lo[0], r.hi[0]),
                        qsim::Fp8StaticScale(r.lo[1], r.hi[1])};
}

StatusOr<StaticInputParams> QuarotParts::StaticLinearInputParams(
    const model::BlockWeights& weights, int64_t layer, model::LinearKind kind) const {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe_));
  QCAL_ASSIGN_OR_RETURN(qsim::FixedQuantParams p,
                        StaticInputQuantParams(weights, *q, layer, kind));
  return StaticInputParams{p.scale, p.zero};
}

StatusOr<at::Tensor> QuarotParts::PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                            const at::Tensor& x, const model::Rope& rope,
                                            int64_t batch) const {
  model::DecoderBlock block(config_, std::move(weights));
  return quarot::PropagateFinishedBlock(block, rope, plan_, layer, x, batch);
}

Status CheckRotatable(const Recipe& recipe, const LlamaConfig& config,
                      const qsim::RotationPlan& plan) {
  if (plan.r1 && !config.tensor_prefix.empty()) {
    // The projector of a multimodal checkpoint writes image features into the residual stream
    // R1 rotates, and qcal copies the vision tower and projector unchanged.
    return absl::InvalidArgumentError(absl::StrCat(
        "recipe '", recipe.name, "': R1 rotates the text model's residual stream, but ",
        config.architecture, " is multimodal: its projector writes image features into that "
        "stream and qcal copies the vision weights unchanged; quantize the text model alone "
        "(Llama4ForCausalLM) or set rotation.r1 to false"));
  }
  return Status();
}

Method::Parts MakeQuarotParts(const Recipe& recipe, const LlamaConfig& config,
                              qsim::RotationPlan plan) {
  return PartsOf(std::make_shared<QuarotParts>(recipe, config, std::move(plan)));
}

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName&) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(q->rotation, config));
  QCAL_RETURN_IF_ERROR(CheckRotatable(recipe, config, plan));
  QCAL_LOG_INFO("QuaRot '{}': rotations {}{}", recipe.name, plan.Describe(),
                q->kv_cache.k_sort ? ", K-sort" : "");
  return Method::Create(recipe, config, MakeQuarotParts(recipe, config, std::move(plan)));
}

}  // namespace qcal::methods::quarot
