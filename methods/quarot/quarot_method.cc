#include "methods/quarot/quarot_method.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "methods/quarot/checkpoint.h"
#include "methods/quarot/quarot_model.h"
#include "methods/quarot/quarot_spec.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::quarot {

Status QuarotMethod::PrepareBlock(int64_t layer, model::BlockWeights* weights) const {
  return Annotate(PrepareBlockWeights(*weights, config(), recipe(), plan_, layer),
                  absl::StrCat("block ", layer));
}

StatusOr<at::Tensor> QuarotMethod::PrepareEmbeddingRows(const at::Tensor& rows) const {
  return qsim::RotateEmbeddingRows(rows, plan_);
}

at::Tensor QuarotMethod::PrepareFinalNorm(const at::Tensor& final_norm) const {
  return qsim::FusedFinalNorm(final_norm, plan_);
}

StatusOr<at::Tensor> QuarotMethod::PrepareHeadRows(const at::Tensor& rows,
                                     const at::Tensor& final_norm) const {
  return qsim::RotateHeadRows(rows, final_norm, plan_);
}

StatusOr<quant::BlockTaskResult> QuarotMethod::QuantizeBlock(model::BlockWeights float_weights,
                                               const BlockInputs& in) const {
  if (in.rope == nullptr) return absl::InvalidArgumentError("QuaRot block task: no RoPE tables");
  model::DecoderBlock block(config(), std::move(float_weights));
  QCAL_RETURN_IF_ERROR(qsim::InstallOnlineRotations(block, plan_));
  QCAL_ASSIGN_OR_RETURN(quant::BlockTaskResult result,
                        QuantizeRotatedBlock(block, *in.rope, recipe(), plan_, in.layer, in.x,
                                             in.batch, in.propagate));
  result.weights = std::move(block.mutable_weights());
  return result;
}

Status QuarotMethod::AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                          SafetensorsWriter* writer) const {
  return AppendQuarotBlockTensors(layer, weights, writer);
}

StatusOr<model::BlockWeights> QuarotMethod::LoadBlock(CheckpointReader& ckpt, int64_t layer) const {
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadQuarotBlockWeights(ckpt, config(), layer));
  QCAL_RETURN_IF_ERROR(CheckQuarotBlock(ckpt.dir(), layer, w, recipe(), plan_));
  return w;
}

Status QuarotMethod::InstallInference(model::DecoderBlock* block, int64_t layer) const {
  return InstallQuantizedInference(*block, config(), layer, recipe(), plan_);
}

Status QuarotMethod::CheckPlainForward() const {
  // R1 and R2 are fused into the stored weights (and R1 into the embedding and head): a plain
  // forward reproduces them. The rest runs at inference time.
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe()));
  std::vector<std::string> online;
  if (plan_.r3) online.push_back("the online Hadamard R3 on queries and keys");
  if (plan_.r4) online.push_back("the online Hadamard R4 on the down_proj input");
  if (q->activations.enabled()) {
    online.push_back(absl::StrCat(q->activations.bits, "-bit activation quantization"));
  }
  if (q->kv_cache.enabled()) {
    online.push_back(absl::StrCat(q->kv_cache.bits, "-bit ", q->kv_cache.format,
                                  " KV-cache quantization",
                                  q->kv_cache.k_sort ? " with K-sort" : ""));
  }
  if (online.empty()) return Status();
  return absl::FailedPreconditionError(absl::StrCat(
      "recipe '", recipe().name, "' (method ", recipe().method, ") computes ",
      absl::StrJoin(online, ", "),
      " at inference time, which a plain Llama forward pass (and so this format) cannot "
      "express"));
}

StatusOr<at::Tensor> QuarotMethod::PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                            const at::Tensor& x, const model::Rope& rope,
                                            int64_t batch) const {
  model::DecoderBlock block(config(), std::move(weights));
  return quarot::PropagateFinishedBlock(block, rope, plan_, layer, x, batch);
}

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(q->rotation, config));
  QCAL_LOG_INFO("QuaRot '{}': rotations {}{}", recipe.name, plan.Describe(),
                q->kv_cache.k_sort ? ", K-sort" : "");
  return std::unique_ptr<Method>(std::make_unique<QuarotMethod>(recipe, config, std::move(plan)));
}

}  // namespace qcal::methods::quarot
