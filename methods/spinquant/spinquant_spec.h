// SpinQuant (method spinquant; issue 17): QuaRot's pipeline with R1 and the per-block R2 learned
// instead of random Hadamards. A global phase ("rotations") trains them with Cayley SGD on the
// causal-LM loss of the rotated, fake-quantized float model (methods/spinquant/rotation_training.h),
// data-parallel over the ranks and resumable; then every block is rotated with them and quantized
// exactly as QuaRot does (GPTQ or RTN weights, sequential blocks), into QuaRot's checkpoint format
// (R1/R2 fused into the stored weights; R3/R4 online). Torch-free; the worker side is
// spinquant_method.h. Recipe (jobs/README.md "method spinquant"): every quarot key, plus
//
//   method: spinquant
//   training:
//     steps: 100            # Cayley SGD steps (the reference's 100)
//     lr: 1.5               # cosine decay to 0, no warm-up
//     batch: 8              # sequences per step, over all ranks (calibration sequences, in order)
//     grad_clip: 1.0        # global L2 norm; 0: none
//     weight_bits: 16       # fake-quantized weights in training (the recipe's scalar grid):
//                           # default 16 (float) with GPTQ and quantized activations or KV, as
//                           # SpinQuant; else the target bits
//     checkpoint_every: 10  # steps between saved training states (resume)
//     init: best            # the starting R1/R2: QuaRot's random Hadamards (hadamard), the
//                           # identity, or whichever has the lower loss at the start (best)
//     loss: kl              # kl: KL(float model ‖ quantized model) per token (AMD Quark's kl
//                           # losses); ce: the calibration text's cross-entropy (SpinQuant)
//     range_gradient: true  # straight-through gradients also through the dynamic quantizers'
//                           # ranges (LSQ's scale gradient); false: identity only (SpinQuant)
//     validation: 0         # held-out calibration sequences (the last ones, not trained on):
//                           # the start and the rotations at every checkpoint are scored on them
//                           # with the weights at the recipe's bits (RTN on its grid, standing
//                           # in for GPTQ) and the best are kept; 0: none, the last step's
//                           # rotations (SpinQuant)
//     smooth: false         # also train smoothing scales where the rotations stay fixed (AMD
//                           # Quark's O = D·R): per RoPE pair of K before R3 (queries × the
//                           # inverse) and per down_proj input before R4 (up_proj rows ÷);
//                           # fused into the weights (SmoothingSize)
//     smooth_lr: 0.05       # their Adam learning rate (the rotations' cosine schedule)
//
// rotation.r1 and rotation.r2 must be on (they are what is trained).
#pragma once

#include <cstdint>
#include <string>

#include "methods/quarot/quarot_spec.h"

namespace qcal::methods::spinquant {

inline constexpr char kRotationsPhase[] = "rotations";

struct RotationTrainingSpec {
  int64_t steps = 100;
  double lr = 1.5;
  int64_t batch = 8;
  double grad_clip = 1.0;
  int weight_bits = 16;
  int64_t checkpoint_every = 10;
  std::string init = "best";  // hadamard (QuaRot's R1/R2, as SpinQuant) | identity | best
  std::string loss = "kl";        // kl | ce
  bool range_gradient = true;
  int64_t validation = 0;
  bool smooth = false;
  double smooth_lr = 0.05;
};

struct SpinquantConfig final : quarot::QuarotConfig {
  RotationTrainingSpec training;

  const char* method() const override { return "spinquant"; }
  MethodNeeds needs() const override;
  void AddToJson(nlohmann::json* recipe) const override;
};

const MethodSpec& Spec();

}  // namespace qcal::methods::spinquant
