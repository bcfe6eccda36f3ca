// SpinQuant (method spinquant), worker side: QuaRot's method (methods/quarot/quarot_method.h)
// with a global phase "rotations" that trains R1 and the per-block R2 (rotation_phase.h), and
// bound to its products (Method::BindPhaseProducts) before any block is prepared: PrepareBlock
// and the non-block row functions then fuse the learned matrices where QuaRot fuses Hadamards.
// The unbound method refuses to prepare anything (it would silently use the Hadamards); it reads
// checkpoints back as QuaRot does (R1/R2 are fused into the stored weights, R3/R4 online).
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"

namespace qcal::methods::spinquant {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config);

}  // namespace qcal::methods::spinquant
