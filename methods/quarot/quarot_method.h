// QuaRot (method quarot), worker side: the rotations are the method's transform (PrepareBlock and
// its non-block row functions) (norm fusion, R1, R2, R4's fused half, K-sort), every block task
// quantizes one rotated block on the outputs of the quantized blocks before it
// (quarot_model.h QuantizeRotatedBlock), its shard holds the rounded linears, the calibrated
// static ranges and the K-sort permutation (checkpoint.h), and its Inference part puts back the
// online Hadamards and the activation and KV-cache quantizers.
//
// QuarotParts is public so that methods built on QuaRot's pipeline (spinquant: the same
// checkpoint with learned R1/R2) are made of it with their own rotation plan.
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::quarot {

// QuaRot's parts for one rotation plan: the transform, the block quantizer, the sequential
// forward, the block format and the inference pieces are one object (they share the plan).
class QuarotParts final : public ModelTransform,
                          public BlockQuantizer,
                          public SequentialForward,
                          public BlockFormat,
                          public Inference {
 public:
  QuarotParts(Recipe recipe, LlamaConfig config, qsim::RotationPlan plan)
      : recipe_(std::move(recipe)), config_(std::move(config)), plan_(std::move(plan)) {}

  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override;
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override;
  at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const override;
  StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                       const at::Tensor& final_norm) const override;
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& in) const override;
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                              const at::Tensor& x, const model::Rope& rope,
                                              int64_t batch) const override;
  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override;
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override;
  Status Install(model::DecoderBlock* block, int64_t layer) const override;
  StatusOr<ServedForward> Served() const override;
  StatusOr<StaticInputParams> StaticLinearInputParams(const model::BlockWeights& weights,
                                                      int64_t layer,
                                                      model::LinearKind kind) const override;
  StatusOr<StaticKvScales> KvCacheScales(const model::BlockWeights& weights,
                                         int64_t layer) const override;

 private:

  const Recipe recipe_;
  const LlamaConfig config_;
  const qsim::RotationPlan plan_;
};

// What the rotations cannot do with `config` under `plan`: R1 on a multimodal checkpoint (its
// projector writes image features into the residual stream R1 rotates, and the vision weights
// are copied unchanged). InvalidArgument with the reason, naming the recipe.
Status CheckRotatable(const Recipe& recipe, const LlamaConfig& config,
                      const qsim::RotationPlan& plan);

// Method::Parts with every part a QuarotParts of `plan` plays.
Method::Parts MakeQuarotParts(const Recipe& recipe, const LlamaConfig& config,
                              qsim::RotationPlan plan);

// `products`: the job's global phases' products so far (empty before they run).
StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products);

}  // namespace qcal::methods::quarot
