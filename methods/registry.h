// The registry of quantization methods, torch-free: every method's recipe description
// (MethodSpec), and the recipe parser that knows them all. Used by the coordinator (validation,
// planning, finalize), the CLI and the workers. The worker side of each method (LibTorch) is
// listed by methods/method_factory.h.
//
// The list of methods is one line in methods/CMakeLists.txt (QCAL_METHODS); the build
// generates methods/method_list.inc from it. A method named there has a folder
// methods/<name>/ with <name>_spec.h (namespace qcal::methods::<name>, `const MethodSpec&
// Spec()`) and <name>_method.h (`StatusOr<std::unique_ptr<Method>> Make(...)`).
#pragma once

#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace qcal::methods {

// In registry order ("quip", "rtn", "gptq", "quarot", ...).
const std::vector<const MethodSpec*>& AllSpecs();
// nullptr for an unknown name.
const MethodSpec* FindSpec(const std::string& name);

}  // namespace qcal::methods

namespace qcal {

// Parses YAML text with every registered method. `source` names the file in errors
// ("jobs/x.yaml: key 'bitz' is unknown").
StatusOr<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source);
StatusOr<Recipe> LoadRecipe(const std::string& path);

}  // namespace qcal
