// QuIP# (method quip), worker side: per linear, pad in to a multiple of the codebook dimension
// (zero columns; the Hessian gets zero rows/columns there, made positive definite by damping),
// pad out to an even size when it has no Hadamard construction; IP-RHT with seeds derived from
// (recipe.seed, layer, linear) (kernels/incoherence.h; RFFT where no Hadamard size exists);
// BlockLDLQ with the recipe's codebook (E8P, RVQ, half-integer grid) at the recipe's scale; the
// result is a QuipLinear (methods/quip/quip_linear.h, the "quip" layer format). Within-block
// fine-tuning tunes the sign vectors with 10× the learning rate at 2 bits (QuIP# F.6).
#pragma once

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "methods/method.h"
#include "methods/per_linear.h"

namespace qcal::methods::quip {

// `products`: the job's global phases' products so far (empty before they run).
StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products);

// QuIP#'s rounding of one linear (BlockLDLQ on the incoherence-processed weight) for a quip
// recipe. InvalidArgument for a recipe of another method.
StatusOr<std::shared_ptr<const LinearRounding>> Rounding(const Recipe& recipe);

// The per-linear seed of the random transforms: a hash of (recipe seed, layer, linear, side), and
// for a routed expert's linear (expert >= 0) of its index too, so no two experts share transforms.
uint64_t TransformSeed(uint64_t recipe_seed, int64_t layer, model::LinearKind linear, bool output,
                       int64_t expert = -1);

}  // namespace qcal::methods::quip
