// Every linear slot of a decoder block, for the block-wide transforms that wrap or replace
// linears whatever the block's kind (rotations, activation quantizers: engine/qsim, methods/quarot).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "engine/model/llama.h"

namespace qcal::model {

// Visits every linear slot a block has, dense ones first (kAllLinears order; a Mixtral MoE
// block's absent MLP skipped), then each routed expert's gate, up and down: `role` is the dense
// linear it corresponds to (ExpertLinearKind for an expert's), `expert` the routed expert or -1.
void ForEachLinearSlot(
    BlockWeights& weights,
    const std::function<void(LinearKind role, int64_t expert, std::unique_ptr<Linear>& slot)>& fn);

}  // namespace qcal::model
