// Learned rotations (SpinQuant; issue 17): R1 [hidden, hidden] and one R2 [head_dim, head_dim] per
// block, initialised as the plan's Hadamard rotations and trained with Cayley SGD (cayley.h) on
// the causal-LM loss of the rotated, fake-quantized float model, its weights frozen
// (../shared/reference/prefixquant-spinquant-notes.md (f)):
//   * the norms are fused into the weights; every forward re-rotates the fused weights with the
//     current T1 / T2 (q/k/v/gate/up: W·T1ᵀ; o/down: T1·W; v rows per head T2·W_v^h; o columns
//     per head ·T2ᵀ) and the embedding (E·T1ᵀ) and head (H·diag(norm)·T1ᵀ); R3 (per-head
//     Hadamard on q and k after RoPE) and R4 (Hadamard on the down_proj input, its inverse fused)
//     stay fixed;
//   * fake quantization with straight-through gradients (identity backward, no gradient to the
//     scales): weights RTN per output channel, symmetric, at weight_bits (16: float, as before
//     GPTQ); the four linear inputs per token, asymmetric; K (after RoPE and R3) and V per token
//     and head, asymmetric;
//   * each step takes `batch` calibration sequences in order (wrapping around), clips the global
//     gradient norm to grad_clip, and moves T1 and every T2 by one Cayley step with lr·½(1 +
//     cos(π·t/steps)).
// The model is held in memory (the 260K test models; a block-streamed version is the next step).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "worker/model/llama.h"
#include "worker/qsim/cayley.h"
#include "worker/qsim/rotate.h"

namespace qcal::qsim {

struct RotationTrainingOptions {
  int64_t steps = 100;
  double lr = 1.5;
  int64_t batch = 8;
  double grad_clip = 1.0;  // global L2 norm of the gradients; <= 0: none
  int weight_bits = 16;    // 16: float weights (the GPTQ pipeline trains W16AxKVx)
  int act_bits = 4;        // 16: float
  int kv_bits = 4;         // 16: float
  uint64_t seed = 0;       // the QR re-orthonormalisation steps
  CayleyOptions cayley;
};

struct RotationTrainingResult {
  at::Tensor t1;              // [hidden, hidden] float64
  at::Tensor t2;              // [layers, head_dim, head_dim] float64
  std::vector<double> losses; // one per step (the loss the step's gradient was taken at)
};

// The mean next-token cross-entropy of `tokens` [b, s] under the rotated, fake-quantized model
// with rotations t1 / t2 (differentiable in both). `model` is the float model as loaded.
StatusOr<at::Tensor> RotatedQuantizedLoss(const model::LlamaModel& model, const RotationPlan& plan,
                                          const at::Tensor& t1, const at::Tensor& t2,
                                          const at::Tensor& tokens,
                                          const RotationTrainingOptions& options);

// Trains the rotations (plan.r1 and plan.r2 must be on) on `tokens` [N, S] int64.
StatusOr<RotationTrainingResult> TrainRotations(const model::LlamaModel& model,
                                                const RotationPlan& plan,
                                                const at::Tensor& tokens,
                                                const RotationTrainingOptions& options);

}  // namespace qcal::qsim
