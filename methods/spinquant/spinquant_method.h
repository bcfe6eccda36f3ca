// SpinQuant (method spinquant), worker side: QuaRot's parts (methods/quarot/quarot_method.h)
// with a global phase "rotations" that trains R1 and the per-block R2 (rotation_phase.h). Made
// with that phase's products (MakeMethod), its parts use the learned plan: the transform (with
// the trained smoothing scales first) fuses the learned matrices where QuaRot fuses Hadamards.
// Made without them, its transform refuses to prepare anything (it would silently use the
// Hadamards); it reads checkpoints back as QuaRot does (R1/R2 are fused into the stored weights,
// R3/R4 online).
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"

namespace qcal::methods::spinquant {

// `products`: the job's global phases' products so far (empty before they run).
StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products);

}  // namespace qcal::methods::spinquant
