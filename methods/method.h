// The worker side of a quantization method (LibTorch): the parts it is made of
// (methods/parts.h), so that the job's block tasks, the checkpoint readers and evaluation call
// a method without naming it. Each method makes its Method in methods/<name>/<name>_method.h;
// methods/method_factory.h makes one from a recipe.
//
// A job runs a method like this (runner/job_steps.h):
//   * the global phases (MethodNeeds::global_phases) run after calibration; their products are
//     saved, and every later step makes the method again with them (MakeMethod), so the parts
//     that depend on them (learned rotations, a prefix) have them from construction;
//   * every float block, as it streams in from the source checkpoint, goes through transform()
//     (identity for a method without one); the non-block weights through its row functions;
//   * quantizer() gets the prepared float block and what its MethodNeeds asked for and returns
//     the quantized block and its metrics; sequential() carries a sequential method's
//     calibration inputs from block to block;
//   * block_format() writes the quantized block into its shard and reads it back, and
//     inference() installs what evaluation, generation and export compute with.
//
// Thread-safety: a Method is immutable after creation; its parts' const functions may run
// concurrently on different blocks.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "engine/quant/finetune.h"
#include "methods/layer_format.h"
#include "methods/parts.h"

namespace qcal::methods {

class Method final {
 public:
  struct Parts {
    // Absent: the identity.
    std::shared_ptr<const ModelTransform> transform;
    // One per name in needs().global_phases.
    std::map<std::string, std::shared_ptr<const GlobalPhase>> phases;
    // Required.
    std::shared_ptr<const BlockQuantizer> quantizer;
    // Required when needs().sequential.
    std::shared_ptr<const SequentialForward> sequential;
    // The layer formats its checkpoints hold ("dense", "scalar" and the method's own).
    std::shared_ptr<const LayerFormats> layer_formats;
    // Absent: StandardBlockFormat over layer_formats.
    std::shared_ptr<const BlockFormat> block_format;
    // Absent: a plain forward pass (nothing installed).
    std::shared_ptr<const Inference> inference;
    // Fine-tuning (QuIP# Algorithm 5, for methods whose needs().supports_finetune): the learning
    // rate of the layers' tunable vectors ÷ the stage's (quant::FinetuneOptions).
    double tunable_lr_multiplier = 1.0;
  };

  // A method of `recipe` for a model of `config`, made of `parts`. InvalidArgument when a part
  // its needs() require is missing.
  static StatusOr<std::unique_ptr<Method>> Create(Recipe recipe, LlamaConfig config,
                                                  Parts parts);
  Method(const Method&) = delete;
  Method& operator=(const Method&) = delete;

  const Recipe& recipe() const { return recipe_; }
  const LlamaConfig& config() const { return config_; }
  MethodNeeds needs() const { return recipe_.needs(); }
  // The method's fields of quantization_config ("format", ...): MethodConfig's.
  nlohmann::json QuantizationFields() const;

  const ModelTransform& transform() const { return *parts_.transform; }
  // FailedPrecondition for a phase the method does not have.
  StatusOr<const GlobalPhase*> phase(const std::string& name) const;
  const BlockQuantizer& quantizer() const { return *parts_.quantizer; }
  // Precondition: needs().sequential.
  const SequentialForward& sequential() const { return *parts_.sequential; }
  const LayerFormats& layer_formats() const { return *parts_.layer_formats; }
  const BlockFormat& block_format() const { return *parts_.block_format; }
  const Inference& inference() const { return *parts_.inference; }
  // The fine-tuning settings of a stage of the recipe (finetune.block or finetune.end_to_end).
  quant::FinetuneOptions FinetuneOptionsFor(const FinetuneStage& stage) const;

 private:
  Method(Recipe recipe, LlamaConfig config, Parts parts);
  Recipe recipe_;
  LlamaConfig config_;
  Parts parts_;
};

// Method::Parts with every part `object` plays (one object may implement several part
// interfaces that share its state: QuaRot's transform, quantizer, block format, ...).
template <typename T>
Method::Parts PartsOf(const std::shared_ptr<T>& object) {
  Method::Parts p;
  if constexpr (std::is_base_of_v<ModelTransform, T>) p.transform = object;
  if constexpr (std::is_base_of_v<BlockQuantizer, T>) p.quantizer = object;
  if constexpr (std::is_base_of_v<SequentialForward, T>) p.sequential = object;
  if constexpr (std::is_base_of_v<BlockFormat, T>) p.block_format = object;
  if constexpr (std::is_base_of_v<Inference, T>) p.inference = object;
  return p;
}

// The quantization_config "format" of `recipe` (the name its quantized linears are read with).
std::string QuantizedLayerFormat(const Recipe& recipe);

}  // namespace qcal::methods
