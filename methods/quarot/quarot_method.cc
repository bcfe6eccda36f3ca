#include "methods/quarot/quarot_method.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "methods/quarot/checkpoint.h"
#include "methods/quarot/quarot_model.h"
#include "methods/quarot/quarot_spec.h"
#include "worker/qsim/rotate.h"

namespace qcal::methods::quarot {
namespace {

class QuarotMethod final : public Method {
 public:
  QuarotMethod(Recipe recipe, LlamaConfig config, qsim::RotationPlan plan)
      : Method(std::move(recipe), std::move(config)), plan_(std::move(plan)) {}

  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override {
    return Annotate(PrepareBlockWeights(*weights, config(), recipe(), plan_),
                    absl::StrCat("block ", layer));
  }
  Status PrepareNonBlock(model::NonBlockWeights* weights) const override {
    return qsim::RotateNonBlockWeights(*weights, plan_);
  }
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override {
    return qsim::RotateEmbeddingRows(rows, plan_);
  }

  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& in) const override {
    if (in.rope == nullptr) return absl::InvalidArgumentError("QuaRot block task: no RoPE tables");
    model::DecoderBlock block(config(), std::move(float_weights));
    QCAL_RETURN_IF_ERROR(qsim::InstallOnlineRotations(block, plan_));
    QCAL_ASSIGN_OR_RETURN(quant::BlockTaskResult result,
                          QuantizeRotatedBlock(block, *in.rope, recipe(), plan_, in.layer, in.x,
                                               in.batch, in.propagate));
    result.weights = std::move(block.mutable_weights());
    return result;
  }

  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override {
    return AppendQuarotBlockTensors(layer, weights, writer);
  }
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadQuarotBlockWeights(ckpt, config(), layer));
    QCAL_RETURN_IF_ERROR(CheckQuarotBlock(ckpt.dir(), layer, w, recipe(), plan_));
    return w;
  }
  Status InstallInference(model::DecoderBlock* block, int64_t layer) const override {
    return InstallQuantizedInference(*block, config(), layer, recipe(), plan_);
  }
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                              const at::Tensor& x, const model::Rope& rope,
                                              int64_t batch) const override {
    model::DecoderBlock block(config(), std::move(weights));
    return quarot::PropagateFinishedBlock(block, rope, plan_, layer, x, batch);
  }

 private:
  const qsim::RotationPlan plan_;
};

}  // namespace

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(q->rotation, config));
  QCAL_LOG_INFO("QuaRot '{}': rotations {}{}", recipe.name, plan.Describe(),
                q->kv_cache.k_sort ? ", K-sort" : "");
  return std::unique_ptr<Method>(std::make_unique<QuarotMethod>(recipe, config, std::move(plan)));
}

}  // namespace qcal::methods::quarot
