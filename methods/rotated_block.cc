#include "methods/rotated_block.h"

#include <ATen/ATen.h>

namespace qcal::methods {

Status RotateAndMarkBlock(model::BlockWeights& weights, const LlamaConfig& config,
                          const qsim::RotationPlan& plan, int64_t layer) {
  QCAL_RETURN_IF_ERROR(qsim::RotateBlockWeights(weights, config, plan, layer));
  at::Tensor applied = at::zeros({4}, at::kDouble);
  applied[0] = plan.r1 ? 1.0 : 0.0;
  applied[1] = plan.r2 ? 1.0 : 0.0;
  applied[2] = plan.r3 ? 1.0 : 0.0;
  applied[3] = plan.r4 ? 1.0 : 0.0;
  weights.extra[kRotationsKey] = applied;
  return Status();
}

}  // namespace qcal::methods
