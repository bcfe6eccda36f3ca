// The worker side of the method registry (LibTorch): a Method for a recipe, and models read back
// from checkpoints through their method. The methods listed are those of methods/registry.h (one
// line in methods/CMakeLists.txt); each provides methods/<name>/<name>_method.h's
// `StatusOr<std::unique_ptr<Method>> Make(const Recipe&, const LlamaConfig&)`.
#pragma once

#include <memory>
#include <string>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "methods/method.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"

namespace qcal::methods {

// The recipe's method for a model of `config`, with the products of the global phases that have
// run (a job's, by phase name: the parts that depend on them, such as learned rotations or a
// prefix, get them here; without them those parts refuse to run). InvalidArgument for settings
// that do not fit the model (QuaRot rotations of an odd size, ...), FailedPrecondition for
// products that do not fit the recipe.
StatusOr<std::unique_ptr<Method>> MakeMethod(const Recipe& recipe, const LlamaConfig& config,
                                             const PhaseProductsByName& products = {});

// A quantized checkpoint's recipe (config.json quantization_config.recipe) and method. `dir`
// names the checkpoint in errors: a quantization_config that is not qcal's, without a recipe,
// or whose recipe does not parse.
StatusOr<Recipe> CheckpointRecipe(const LlamaConfig& config, const std::string& dir);
StatusOr<std::unique_ptr<Method>> CheckpointMethod(const LlamaConfig& config,
                                                   const std::string& dir);

// A float or quantized checkpoint, streamed block by block (quantized blocks ready to run: the
// method's inference pieces installed).
StatusOr<std::unique_ptr<model::ModelSource>> OpenModel(const std::string& dir);

// A float or quantized checkpoint, whole in memory (evaluation and generation of small models,
// tests).
StatusOr<std::unique_ptr<model::LlamaModel>> LoadModel(const std::string& dir);

}  // namespace qcal::methods
