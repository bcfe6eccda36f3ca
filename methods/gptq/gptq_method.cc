#include "methods/gptq/gptq_method.h"

#include "absl/strings/str_cat.h"
#include "methods/gptq/gptq_spec.h"
#include "methods/per_linear.h"

namespace qcal::methods::gptq {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName&) {
  const auto* c = dynamic_cast<const GptqConfig*>(recipe.config.get());
  if (c == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' is not a gptq one"));
  }
  quant::ScalarQuantizeOptions options;
  options.bits = c->bits;
  options.grid = c->scalar;
  options.gptq = true;
  options.damp = c->damp;
  options.refine_sweeps = c->refine_sweeps;
  return MakePerLinearMethod(recipe, config, ScalarGridRounding("gptq", options));
}

}  // namespace qcal::methods::gptq
