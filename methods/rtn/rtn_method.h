// RTN (method rtn), worker side: every linear of a block rounded on its own, round to nearest on the recipe's scalar grid (no Hessian), as a
// quant::ScalarQuantLinear (the "scalar" layer format: engine/quant/scalar_linear.h); QuIP#'s
// within-block fine-tuning when the recipe enables it.
#pragma once

#include <memory>

#include "common/status.h"
#include "methods/method.h"

namespace qcal::methods::rtn {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products);

}  // namespace qcal::methods::rtn
