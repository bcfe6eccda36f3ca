#include "methods/rtn/rtn_method.h"

#include "absl/strings/str_cat.h"
#include "methods/rtn/rtn_spec.h"
#include "methods/per_linear.h"

namespace qcal::methods::rtn {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName&) {
  const auto* c = dynamic_cast<const RtnConfig*>(recipe.config.get());
  if (c == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' is not a rtn one"));
  }
  quant::ScalarQuantizeOptions options;
  options.bits = c->bits;
  options.grid = c->scalar;
  options.gptq = false;
  return MakePerLinearMethod(recipe, config, ScalarGridRounding("rtn", options));
}

}  // namespace qcal::methods::rtn
