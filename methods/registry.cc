#include "methods/registry.h"

// One declaration per registered method (generated from QCAL_METHODS).
#define QCAL_METHOD(name)              \
  namespace qcal::methods::name {      \
  const MethodSpec& Spec();            \
  }
#include "methods/method_list.inc"
#undef QCAL_METHOD

namespace qcal::methods {

const std::vector<const MethodSpec*>& AllSpecs() {
  static const std::vector<const MethodSpec*> specs = {
#define QCAL_METHOD(name) &name::Spec(),
#include "methods/method_list.inc"
#undef QCAL_METHOD
  };
  return specs;
}

const MethodSpec* FindSpec(const std::string& name) {
  for (const MethodSpec* spec : AllSpecs()) {
    if (name == spec->name()) return spec;
  }
  return nullptr;
}

}  // namespace qcal::methods

namespace qcal {

StatusOr<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source) {
  return ParseRecipeWith(yaml_text, source, methods::AllSpecs());
}

StatusOr<Recipe> LoadRecipe(const std::string& path) {
  return LoadRecipeWith(path, methods::AllSpecs());
}

}  // namespace qcal
