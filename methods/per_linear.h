// The block quantizer of methods that round every linear on its own from its float weights and
// the float model's Hessian (quip, rtn, gptq), with QuIP#'s within-block fine-tuning
// (engine/quant/finetune.h BlockTuner) when the recipe enables it. A method of this kind is its
// LinearRounding, its layer formats and the parts below (PerLinearParts).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/quant/block_task.h"
#include "engine/quant/scalar_quantize.h"
#include "methods/method.h"

namespace qcal::methods {

// Progress inside one linear's rounding: a short note ("BlockLDLQ rows 1024/4096"), from any of
// the rounding's threads, one call at a time. A rounding may call it as often as it likes;
// PerLinearQuantizer forwards at most one note every kLinearProgressEvery to the block's
// progress (so a linear that takes minutes -- a trellis codebook at a 70B shape -- is not
// silent, and a fast one adds nothing).
using LinearProgressFn = std::function<void(const std::string& note)>;
inline constexpr std::chrono::seconds kLinearProgressEvery{10};

class LinearRounding {
 public:
  virtual ~LinearRounding() = default;
  // Rounds one linear of block `layer`: weight [out, in] float, hessian [in, in] fp64 mean
  // (undefined when the method needs none), on the rank's backend `gpu` (null: the CPU);
  // `progress` may be empty. `expert` >= 0: routed expert `expert`'s linear of role `kind`
  // (kGate, kUp or kDown) in a MoE block; -1: the block's dense linear `kind`.
  virtual StatusOr<quant::QuantizedLinear> Round(int64_t layer, model::LinearKind kind,
                                                 int64_t expert,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& hessian,
                                                 kernels::GpuBackend* gpu,
                                                 const LinearProgressFn& progress) const = 0;
};

class PerLinearQuantizer final : public BlockQuantizer {
 public:
  // `finetune`: the recipe's finetune.block stage as FinetuneOptions (Method::FinetuneOptionsFor),
  // used when the recipe enables fine-tuning.
  PerLinearQuantizer(LlamaConfig config, bool finetune, quant::FinetuneOptions options,
                     std::shared_ptr<const LinearRounding> rounding);
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& inputs) const override;
  // The least time between two forwarded notes of a linear's rounding (kLinearProgressEvery;
  // tests shorten it).
  void set_note_interval(std::chrono::milliseconds every) { note_every_ = every; }

 private:
  StatusOr<quant::BlockTaskResult> QuantizeWithFinetune(model::BlockWeights float_weights,
                                                        const BlockInputs& inputs) const;
  const LlamaConfig config_;
  const bool finetune_;
  const quant::FinetuneOptions options_;
  const std::shared_ptr<const LinearRounding> rounding_;
  std::chrono::milliseconds note_every_ = kLinearProgressEvery;
};

// Rounding on a scalar grid (rtn, gptq): quant::QuantizeScalarLinear with `options` (GPTQ with
// the float model's Hessian when options.gptq, else round-to-nearest); `method` names the
// method in errors.
std::shared_ptr<const LinearRounding> ScalarGridRounding(std::string method,
                                                         quant::ScalarQuantizeOptions options);

// Routed expert `expert`'s Hessian of `input` (undefined without Hessians), its in-memory sums
// released once the mean exists (a Mixtral-8x7B block's experts hold 8 × 3.3 GB of down_proj
// sums). An expert whose Hessian is all zero saw no calibration token (the starved-expert rule
// was turned off: calibration.moe_min_tokens 0): FailedPrecondition naming it, never a rounding
// against a zero Hessian.
StatusOr<at::Tensor> ExpertHessian(calib::BlockHessians* hessians, int64_t layer, int64_t expert,
                                   calib::ExpertInput input);

// A per-linear method: `rounding` and, for a method with a layer format of its own, `formats`
// (null: "dense" and "scalar"); the tunable vectors of its layers tuned with
// `tunable_lr_multiplier` × the stage's learning rate.
StatusOr<std::unique_ptr<Method>> MakePerLinearMethod(
    const Recipe& recipe, const LlamaConfig& config, std::shared_ptr<const LinearRounding> rounding,
    std::shared_ptr<const LayerFormats> formats = nullptr, double tunable_lr_multiplier = 1.0);

}  // namespace qcal::methods
