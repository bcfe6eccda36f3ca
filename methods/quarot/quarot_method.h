// QuaRot (method quarot), worker side: the rotations are the method's PrepareBlock and its
// non-block row functions (norm fusion, R1, R2, R4's fused half, K-sort), every block task
// quantizes one rotated block on the outputs of the quantized blocks before it
// (quarot_model.h QuantizeRotatedBlock), its shard holds the rounded linears, the calibrated
// static ranges and the K-sort permutation (checkpoint.h), and InstallInference puts back the
// online Hadamards and the activation and KV-cache quantizers.
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"

namespace qcal::methods::quarot {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config);

}  // namespace qcal::methods::quarot
