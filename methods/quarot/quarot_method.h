// QuaRot (method quarot), worker side: the rotations are the method's PrepareBlock and its
// non-block row functions (norm fusion, R1, R2, R4's fused half, K-sort), every block task
// quantizes one rotated block on the outputs of the quantized blocks before it
// (quarot_model.h QuantizeRotatedBlock), its shard holds the rounded linears, the calibrated
// static ranges and the K-sort permutation (checkpoint.h), and InstallInference puts back the
// online Hadamards and the activation and KV-cache quantizers.
//
// QuarotMethod is public so that methods built on QuaRot's pipeline (spinquant: the same
// checkpoint with learned R1/R2) can derive from it with their own rotation plan.
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::quarot {

class QuarotMethod : public Method {
 public:
  QuarotMethod(Recipe recipe, LlamaConfig config, qsim::RotationPlan plan)
      : Method(std::move(recipe), std::move(config)), plan_(std::move(plan)) {}

  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override;
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override;
  at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const override;
  StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                       const at::Tensor& final_norm) const override;
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& in) const override;
  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override;
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override;
  Status InstallInference(model::DecoderBlock* block, int64_t layer) const override;
  Status CheckPlainForward() const override;
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                              const at::Tensor& x, const model::Rope& rope,
                                              int64_t batch) const override;

 protected:
  const qsim::RotationPlan& plan() const { return plan_; }

 private:
  const qsim::RotationPlan plan_;
};

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config);

}  // namespace qcal::methods::quarot
