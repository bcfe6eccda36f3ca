#include "methods/rtn/rtn_method.h"

#include "absl/strings/str_cat.h"
#include "methods/rtn/rtn_spec.h"

namespace qcal::methods::rtn {

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config) {
  const auto* c = dynamic_cast<const RtnConfig*>(recipe.config.get());
  if (c == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' is not a rtn one"));
  }
  quant::ScalarQuantizeOptions options;
  options.bits = c->bits;
  options.grid = c->scalar;
  options.gptq = false;
  return std::unique_ptr<Method>(std::make_unique<ScalarGridMethod>(recipe, config, options));
}

}  // namespace qcal::methods::rtn
