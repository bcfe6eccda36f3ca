// Learned rotations (SpinQuant; issue 17): R1 [hidden, hidden] and one R2 [head_dim, head_dim] per
// block, initialised as the plan's Hadamard rotations and trained with Cayley SGD (cayley.h) on
// the causal-LM loss of the rotated, fake-quantized float model, its weights frozen (a mixture of
// experts' router rotated and kept float, every routed expert rotated and fake-quantized like
// the dense MLP, behind the block's one set of smoothing scales)
// (../shared/reference/prefixquant-spinquant-notes.md (f)):
//   * the norms are fused into the weights; every forward re-rotates the fused weights with the
//     current T1 / T2 (q/k/v/gate/up: W·T1ᵀ; o/down: T1·W; v rows per head T2·W_v^h; o columns
//     per head ·T2ᵀ) and the embedding (E·T1ᵀ) and head (H·diag(norm)·T1ᵀ); R3 (per-head
//     Hadamard on q and k after RoPE) and R4 (Hadamard on the down_proj input, its inverse fused)
//     stay fixed;
//   * fake quantization with straight-through gradients (identity backward, no gradient to the
//     scales): weights RTN per output channel, symmetric, at weight_bits (16: float, as before
//     GPTQ); the four linear inputs per token, asymmetric; K (after RoPE and R3) and V per token
//     and head, asymmetric -- or, when the options carry them, the activation and KV quantizers
//     inference will use (qcal's spinquant trains against those).
// The trainer's parameters are R = Tᵀ (the matrices a weight's input side multiplies by, W·R),
// as the reference trains them; products and the plan hold T.
//
// Two ways to evaluate the loss:
//   * RotatedQuantizedLoss: the whole model in memory, one autograd graph (the reference for
//     tests);
//   * RotationGradients: block-streamed with per-block recomputation (gradient checkpointing by
//     hand): the forward keeps only each block's input hidden states, the head's loss (and, for
//     the KL, the float model's distribution, from a float forward without rotations) and its
//     gradient are computed in vocabulary chunks from the unrotated head (logits =
//     (RMSNorm(h)·T1)·(H·diag(norm))ᵀ, so the head is never re-rotated), and the backward
//     recomputes one block at a time. Memory: one block's fused weights (or all of them when
//     they fit the cache budget), the head's chunks, and (blocks + 1) hidden states of one
//     sequence. The distributed, resumable training loop is methods/spinquant.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/cayley.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::spinquant {

using qsim::ActivationQuantizer;
using qsim::CayleyOptions;
using qsim::FakeQuantGrid;
using qsim::OnlineHadamard;
using qsim::RotationPlan;

struct RotationTrainingOptions {
  int64_t steps = 100;
  double lr = 1.5;
  int64_t batch = 8;       // sequences per step (global, over all ranks)
  double grad_clip = 1.0;  // global L2 norm of the gradients; <= 0: none
  int weight_bits = 16;    // 16: float weights (the GPTQ pipeline trains W16AxKVx)
  int act_bits = 4;        // 16: float
  int kv_bits = 4;         // 16: float
  uint64_t seed = 0;       // the QR re-orthonormalisation steps
  bool identity_init = false;  // start from R1 = R2 = I instead of the plan's Hadamards
  // The loss: the causal-LM cross-entropy of the calibration tokens (SpinQuant), or the mean
  // KL(float model ‖ fake-quantized model) of the next-token distributions (AMD Quark's "kl"
  // losses, over the whole vocabulary). The float model's distribution does not depend on the
  // rotations (it is rotation-invariant), so its gradient with respect to them is zero at the
  // float point: the KL's gradient carries only what quantization changes, where the
  // cross-entropy's adds the float model's own misfit of the calibration text.
  enum class Loss { kCrossEntropy, kKlToFloat };
  Loss loss = Loss::kCrossEntropy;
  // Straight-through gradients that also pass through the dynamic quantizers' ranges (LSQ's
  // scale gradient, with the scale a function of the values: d q / d s = (q − x)/s), so the
  // gradient sees that a smaller per-token (per-head) range means a smaller rounding error --
  // what a rotation can change. false: identity backward with no gradient to the scale
  // (SpinQuant's). The value of the forward is the same either way.
  bool range_gradient = false;
  // The KV quantizer's grid below, for the range gradient (the scale of a set is clip · max|x| /
  // qmax, symmetric, or clip · (max(x, 0) − min(x, 0)) / qmax): one set per token and kv_group
  // channels of a head (0: the head); kv_range_gradient false: the identity gradient for K and V
  // (a KV quantizer with other sets). The activation quantizer's grid and sets are its own.
  FakeQuantGrid kv_grid{4, false, 1.0};
  // The weights' sets for the range gradient (weight_bits < 16): groups of weight_group inputs
  // of an output channel (-1: the channel), symmetric or not; a clip search's ratio is held
  // fixed (its scale is ratio · range / qmax, so the gradient is the same as the range's).
  bool weight_symmetric = true;
  int64_t weight_group = -1;
  int64_t kv_group = 0;
  bool kv_range_gradient = true;
  CayleyOptions cayley;
  // The quantizers inference will run (dynamic), applied with straight-through gradients in
  // place of the reference's per-token asymmetric ones when set: act_quantizer on the four
  // linear inputs (when act_bits < 16), kv_quantizer on K and V (when kv_bits < 16).
  std::shared_ptr<const ActivationQuantizer> act_quantizer;
  std::shared_ptr<const model::KvCacheHook> kv_quantizer;
  // The weights' fake quantizer when weight_bits < 16 (the recipe's RTN grid: clip search, groups;
  // a rotated weight [out, in] float32 in, its dequantized rounding out); unset: per-channel
  // symmetric RTN at the channel's max, as the reference.
  std::function<StatusOr<at::Tensor>(const at::Tensor&)> weight_quantizer;
  // Smoothing scales will be passed (SmoothingSize; AMD Quark's O = D·R for the fixed online
  // rotations): RotationGradients then keeps each block's unfused down_proj beside the R4-fused
  // one (the scales sit before R4). The loss depends only on the scales passed.
  bool smooth = false;
  // The scales' optimizer (methods/spinquant): Adam (β 0.9 / 0.999, ε 1e-8) at this learning
  // rate with the rotations' cosine schedule, on unclipped gradients, as Quark trains them beside
  // the Cayley SGD of the rotations.
  double smooth_lr = 0.05;
};

// Whether block `layer`'s K/Q smoothing scales apply: not on a layer with L2 qk-norm (Llama 4's
// RoPE layers), which divides each head of q and k by its own norm and so would undo a
// per-channel scale unevenly; those a_k are never used (their gradient is zero).
bool SmoothsAttention(const LlamaConfig& config, int64_t layer);

// Whether rotation training handles the model: every MLP (dense, shared expert, routed expert)
// of one intermediate size (R4 and the smoothing scales are trained for one). InvalidArgument
// naming the layer otherwise (Llama 4 with dense layers of intermediate_size_mlp).
Status CheckTrainableModel(const LlamaConfig& config);

// The smoothing scales of one block (AMD Quark's jointly trained SmoothQuant scales D, placed
// where the rotations that follow stay fixed, O = D·R): log-scales a = [a_k, a_d], zeros = none,
// function-preserving in float:
//   * a_k [kv_heads · head_dim/2], before R3: RoPE pair (i, i + head_dim/2) of KV head g (entry
//     g·head_dim/2 + i) divides K by e^a and multiplies the queries of g's heads by e^a (W_k
//     rows ÷, W_q rows ×; RoPE turns the pair as a whole, so the scale commutes with it, and q·k
//     is unchanged): QServe's SmoothAttention, learned; the K cache sees K·e^{−a};
//   * a_d [intermediate], before R4: up_proj rows ÷ e^a, down_proj columns × e^a; the down_proj
//     input (after the SiLU gate) is divided by e^a before R4 and its quantizer.
int64_t SmoothingSize(const LlamaConfig& config);
// The factors e^{±a} as per-row (Q, K, up) and per-column (down) vectors of the four weights:
// {q_rows [q_dim], k_rows [kv_dim], up_rows [intermediate], down_cols [intermediate]}, in a's
// dtype (differentiable in a [SmoothingSize]).
std::vector<at::Tensor> SmoothingFactors(const LlamaConfig& config, const at::Tensor& a);
// Fuses one block's log-scales a [SmoothingSize] (float64) into its float weights (Q, K, up and
// down become float32 dense linears): what inference runs after training.
Status SmoothBlockWeights(const LlamaConfig& config, const at::Tensor& a,
                          model::BlockWeights* weights);

// The cosine learning rate of step t of `steps` (SpinQuant's schedule: to 0, no warm-up).
double RotationLr(const RotationTrainingOptions& options, int64_t t);

// The mean next-token loss (options.loss) of `tokens` [b, s] under the rotated, fake-quantized
// model with rotations t1 / t2 (differentiable in both). `model` is the float model as loaded.
// smooth: the blocks' smoothing log-scales [layers, SmoothingSize] (differentiable; undefined:
// none).
StatusOr<at::Tensor> RotatedQuantizedLoss(const model::LlamaModel& model, const RotationPlan& plan,
                                          const at::Tensor& t1, const at::Tensor& t2,
                                          const at::Tensor& tokens,
                                          const RotationTrainingOptions& options,
                                          const at::Tensor& smooth = at::Tensor());

// Block-streamed loss and gradients of one sequence (see above). Not thread-safe (the source and
// the cache); one per rank.
class RotationGradients {
 public:
  // plan.r1 and plan.r2 must be on. cache_bytes: how much of the fused float blocks and the head
  // may stay in memory between sequences (0: reload every time).
  static StatusOr<std::unique_ptr<RotationGradients>> Create(model::ModelSource* source,
                                                             const RotationPlan& plan,
                                                             const RotationTrainingOptions& options,
                                                             int64_t cache_bytes);

  struct Result {
    double loss = 0;  // the mean loss over the sequence's s-1 predicted tokens
    at::Tensor g1;    // d loss / d R1 [hidden, hidden] float64
    at::Tensor g2;    // d loss / d R2 [layers, head_dim, head_dim] float64
    at::Tensor gs;    // d loss / d smooth [layers, SmoothingSize] float64 (with smooth)
  };
  // tokens [s] int64 (s >= 2); r1 = T1ᵀ, r2 = T2ᵀ per layer, float64; smooth: the smoothing
  // log-scales [layers, SmoothingSize] float64 (undefined: none).
  StatusOr<Result> Sequence(const at::Tensor& r1, const at::Tensor& r2, const at::Tensor& tokens,
                            const at::Tensor& smooth = at::Tensor());

  // The loss of each sequence of tokens [m, s] (s >= 2; forward only) under `options`' quantizers
  // and loss (e.g. the weights at the bits they will be deployed with, where training keeps them
  // float); the rotations as for Sequence. Block-major: each block is loaded (or taken from the
  // cache) once for all m sequences, every sequence run alone, so a sequence's loss has the same
  // bits whatever else is in `tokens`. options' weight offsets are computed once per block.
  StatusOr<std::vector<double>> Losses(const at::Tensor& r1, const at::Tensor& r2,
                                       const at::Tensor& tokens,
                                       const RotationTrainingOptions& options,
                                       const at::Tensor& smooth = at::Tensor());

  ~RotationGradients();

 private:
  struct Fused;  // one block's fused float weights
  RotationGradients() = default;
  StatusOr<std::shared_ptr<const Fused>> Block(int64_t layer);
  StatusOr<at::Tensor> HeadChunk(int64_t begin, int64_t n);  // rows·diag(norm), float32
  // The mean loss over n predicted tokens from the head's inputs u = RMSNorm(h)·T1 [n, hidden]
  // (uf: the float model's, for the KL; targets: the next tokens, for the cross-entropy), in
  // vocabulary chunks; with grad_u, also d loss / d u into it ([n, hidden], zeroed by the caller).
  StatusOr<double> HeadLoss(const at::Tensor& u, const at::Tensor& uf, const at::Tensor& targets,
                            bool kl, at::Tensor* grad_u);
  // Block `layer`'s weight fake-quantization offsets q(W) − W for rotations (r1, r2): computed by
  // the first sequence of a step, reused by the others (and by the backward's recomputation).
  std::vector<at::Tensor>* StepOffsets(const at::Tensor& r1, const at::Tensor& r2,
                                       const at::Tensor& smooth, int64_t layer);

  model::ModelSource* source_ = nullptr;
  RotationPlan plan_;
  RotationTrainingOptions options_;
  int64_t cache_bytes_ = 0;
  std::shared_ptr<const OnlineHadamard> t4_;
  at::Tensor r3_;
  at::Tensor final_norm_;
  std::vector<std::shared_ptr<const Fused>> cached_;
  at::Tensor head_;  // cached whole (rows·diag(norm)) when it fits
  at::Tensor offsets_r1_, offsets_r2_, offsets_s_;  // what the offsets were computed for
  int64_t offsets_v1_ = 0, offsets_v2_ = 0, offsets_vs_ = 0;
  bool keep_down_ = false;  // the fused blocks keep the raw down_proj (smoothing before R4)
  std::vector<std::vector<at::Tensor>> offsets_;
};

}  // namespace qcal::methods::spinquant
