// Job recipes: every parameter of a quantization job, read from a YAML file in jobs/.
//
// A recipe has a few keys every method shares, and the keys of its method:
//
//   name: quip-e8p-2bit           # default: the file's stem
//   method: quip                  # a registered method (methods/registry.h: quip, rtn, gptq, ...)
//   seed: 0                       # the method's random draws, fine-tuning's splits
//   calibration:                  # data for Hessians, activations and fine-tuning
//     files: [data/tinystories/TinyStories-valid.sample30k.txt]   # relative to the data root
//     num_sequences: 64
//     seq_len: 128
//     seed: 0
//   finetune:                     # QuIP# Algorithm 5, for methods that support it
//     enabled: false
//     block: {epochs: 5, lr: 5.0e-5, batch: 8, holdout: 0.1}
//     end_to_end: {enabled: false, epochs: 3, lr: 5.0e-5, batch: 8, holdout: 0.1}
//   ...                           # the method's own keys (bits, codebook, scalar, rotation, ...)
//
// The method's keys are read by its MethodSpec (methods/<name>/<name>_spec.h) into a
// MethodConfig, which also says what the method needs from the job (MethodNeeds) and what goes
// into the checkpoint's quantization_config. The parser (methods/registry.h ParseRecipe) knows
// every registered method, so a key of another method is an error naming the methods it belongs
// to, and unknown keys, bad values and repeated keys are errors naming the file, the key and its
// line (common/recipe_section.h); a typo never silently falls back to a default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/recipe_section.h"
#include "common/status.h"

namespace qcal {

struct CalibrationSpec {
  std::vector<std::string> files;  // relative paths are resolved against the data root
  int64_t num_sequences = 64;
  int64_t seq_len = 128;  // tokens per sequence including BOS; capped at the model's max
  uint64_t seed = 0;
  // The arithmetic of the calibration forward's linears where a GPU rank runs it (the device
  // block forward, kernels/block_forward_cuda.h): "fp32" (default; the CPU's arithmetic up to
  // summation order) or "bf16" (bf16 inputs and weights, fp32 accumulation on tensor cores). A CPU
  // rank computes in fp32 and refuses "bf16". docs/algorithms.md "Calibration precision".
  std::string precision = "fp32";
  // Mixture-of-experts models (docs/algorithms.md "Calibrating routed experts"): calibrate every
  // routed expert on every token while the block's output keeps the real routing; otherwise an
  // expert the router sends fewer than moe_min_tokens calibration tokens (-1: the model's hidden
  // size; 0: never) is calibrated on every token, with a warning naming layer and expert. Dense
  // models ignore both.
  bool moe_route_all = false;
  int64_t moe_min_tokens = -1;
};

struct FinetuneStage {
  bool enabled = false;
  int64_t epochs = 5;
  double lr = 5e-5;
  int64_t batch = 8;
  double holdout = 0.1;  // fraction of calibration sequences held out to pick the best epoch
};

struct FinetuneSpec {
  bool enabled = false;   // QuIP# Algorithm 5 within each block
  FinetuneStage block;    // within-block settings (enabled follows FinetuneSpec::enabled)
  FinetuneStage end_to_end;
};

// What a method needs from the job. The planner (runner/task_plan.h), the job steps
// (runner/job_steps.h) and finalize (runner/job_plan.h) read this instead of the method's
// name.
struct MethodNeeds {
  // The calibration phase collects every block's Hessians on the float model.
  bool float_hessians = false;
  // The calibration phase saves the float model's activations at every block boundary (within-
  // block fine-tuning learns to map a block's float inputs to its float outputs).
  bool float_activations = false;
  // Block l is calibrated on the outputs of the quantized blocks before it: its task reads its
  // inputs from where block l-1's task left them, so blocks run one at a time, in order.
  bool sequential = false;
  // Sequential methods that also need the float model's inputs to each block (its block-wise
  // fine-tuning targets): carried from block task to block task like the calibration inputs,
  // each block's float outputs computed by the method (Method::PropagateFloatBlock).
  bool sequential_float = false;
  // The end-to-end fine-tuning phase after the last block.
  bool end_to_end = false;
  // Method phases before the block tasks, in order (rotation training, a prefix search, ...).
  std::vector<std::string> global_phases;
  // The method transforms the embedding, final norm and head: block 0's task writes shard 0
  // (otherwise finalize copies them from the float model), and the head is untied.
  bool transforms_non_block = false;
  // The method accepts QuIP#'s fine-tuning (finetune.enabled, finetune.end_to_end.enabled).
  bool supports_finetune = false;
  // The method quantizes mixture-of-experts models (hf_config.h ModelFamily): every routed
  // expert's linears rounded like a dense MLP's from the expert's own Hessians, the router kept
  // in float (runner/job_inputs.h CheckJobInputs refuses the others for such a model).
  bool supports_moe = false;
  // A MoE block's routed experts may be quantized in groups by separate tasks (runner/task_plan.h):
  // the block quantizer rounds each expert on its own from the float model's Hessians (nothing it
  // does to one expert depends on another or on the block's other weights), the ModelTransform
  // leaves the experts as they are, and nothing after the rounding tunes the block as a whole
  // (Recipe::needs clears it with within-block fine-tuning).
  bool expert_parts = false;

  // Whether the job reads calibration text at all (Hessians, activations, sequential
  // calibration or end-to-end fine-tuning): its calibration files are checked and fingerprinted
  // and relative ones resolve under the data root. An RTN job reads none.
  bool reads_calibration_text() const {
    return float_hessians || float_activations || end_to_end || sequential;
  }
  // Whether the block tasks read products of a calibration pass over the float model before
  // them (its Hessians, activations, or the global phases' products). A sequential method
  // without them calibrates inside its block tasks instead (JobPlan::has_calibrate_task).
  bool calibrates_float_model() const {
    return float_hessians || float_activations || !global_phases.empty();
  }
};

// A method's parsed recipe section. Immutable; shared by copies of the Recipe.
class MethodConfig {
 public:
  virtual ~MethodConfig() = default;
  virtual const char* method() const = 0;  // its registry name
  virtual MethodNeeds needs() const = 0;
  // The weight bits reported in quantization_config (16: float weights).
  virtual int weight_bits() const = 0;
  // Adds the method's keys to the recipe's JSON form, exactly as its spec reads them back.
  virtual void AddToJson(nlohmann::json* recipe) const = 0;
  // Adds the method's fields to quantization_config (at least "format": the layer format a
  // loader reads: docs/formats.md).
  virtual void AddToQuantizationConfig(nlohmann::json* q) const = 0;
};

struct Recipe {
  std::string name;
  std::string method;  // the registry name of config's method
  uint64_t seed = 0;
  CalibrationSpec calibration;
  FinetuneSpec finetune;
  std::shared_ptr<const MethodConfig> config;  // never null in a parsed recipe

  // The method's config as its concrete type (the caller knows the method).
  template <typename T>
  const T& method_config() const {
    return dynamic_cast<const T&>(*config);
  }
  // The method's needs, with what the common sections add (fine-tuning's activations and
  // end-to-end phase).
  MethodNeeds needs() const;
  int bits() const { return config ? config->weight_bits() : 0; }
  // The JSON form written into the job store and quantization_config; ParseRecipe reads it back
  // as the same recipe.
  nlohmann::json ToJson() const;
};

// Reads one method's keys (implemented in methods/<name>/<name>_spec.cc).
class MethodSpec {
 public:
  virtual ~MethodSpec() = default;
  virtual const char* name() const = 0;
  // The top-level recipe keys the method reads besides the common ones.
  virtual std::vector<std::string> keys() const = 0;
  // Parses the method's keys from the top-level section; `recipe` holds the common keys (name,
  // seed, calibration, finetune) already read. Errors as RecipeSection's.
  virtual StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                              const Recipe& recipe) const = 0;
};

// Parses YAML text with the given methods. `source` names the file in errors. Callers use
// methods/registry.h ParseRecipe, which passes every registered method.
StatusOr<Recipe> ParseRecipeWith(const std::string& yaml_text, const std::string& source,
                                 const std::vector<const MethodSpec*>& methods);
// Reads the file (size-checked) and parses it.
StatusOr<Recipe> LoadRecipeWith(const std::string& path,
                                const std::vector<const MethodSpec*>& methods);

}  // namespace qcal
