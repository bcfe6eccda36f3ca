// PrefixQuant (method prefixquant), worker side: QuaRot's rotations as PrepareBlock and the
// non-block row functions, the global phase "prefix" (prefix_search.h), one block task per block
// in order (prefixquant_block.h: weights, step sizes and the grid searches on the outputs of the
// quantized blocks before it, behind the prefix), the block shard with its steps and prefix K/V,
// and InstallInference putting back R3/R4, the static quantizers and the prefix.
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"

namespace qcal::methods::prefixquant {

// `products`: the job's global phases' products so far (empty before they run).
StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products);

}  // namespace qcal::methods::prefixquant
