// QuaRot stage 1 (QuaRot §3.4, §4 stages 1a–1d, appendix A.1; AMD Quark's R1–R4): norm fusion
// and the rotations that leave the float model's function unchanged.
//
// Notation: activations are row vectors, a linear computes y = x·Wᵀ with W [out, in]. For an
// orthogonal n×n transform T (a vector v becomes T·v), "rotating the input side" of W means
// W ← W·Tᵀ and "rotating the output side" W ← T·W.
//
//   Norm fusion: RMSNorm(x)·diag(α) feeds q/k/v (input_layernorm), gate/up
//     (post_attention_layernorm) and the head (final norm): W ← W·diag(α), α ← 1.
//   R1 (hidden size n): T1 = H·diag(s)/√n, the randomized Hadamard of kernels/hadamard.h with
//     signs RandomSigns(n, seed) (QuIP#'s RHT; the randomized FFT where n has no Hadamard
//     matrix). The residual stream becomes x·T1ᵀ: embedding rows E ← E·T1ᵀ; q/k/v/gate/up and
//     the head: input side; o_proj and down_proj: output side. RMSNorm commutes with T1 since it
//     only divides by the norm (which is why α is fused first). The head becomes untied.
//   R2 (head_dim d): T2 = H_d/√d per head, fused: v_proj rows of each KV head W_v^(h) ← T2·W_v^(h)
//     (values come out rotated), o_proj columns of each head W_o[:, h] ← W_o[:, h]·T2ᵀ.
//   R3 (head_dim, online): q_h ← q_h·T3ᵀ and k_h ← k_h·T3ᵀ after RoPE (T3 = H_d/√d); cancels in
//     q·kᵀ. Installed as model::BlockHooks::qk_rotation.
//   R4 (intermediate size m, online): the down_proj input u becomes u·T4ᵀ (T4 = H_m/√m, an
//     ActQuantLinear around down_proj) and W_down ← W_down·T4ᵀ offline.
//   Mixture of experts: the router and each routed expert read the normalised residual as the
//     dense MLP does (post_attention_layernorm fused into the router's and every expert's
//     gate/up columns, R1 on their input side; Llama 4's router score scales an expert's input,
//     which commutes with both) and each expert's down_proj writes to it (R1 on its output
//     side); R4 acts on every expert's down_proj input as on the dense one. The router stays
//     float32. R2 and R3 concern attention only.
//
// Fallbacks (AMD Quark): an online rotation (R3, R4) needs a Hadamard matrix of its size
// (PlanHadamard(n).IsHadamard()); without one it is skipped with a logged warning and R1/R2 are
// kept. The offline R1 / R2 only need an orthogonal matrix: the randomized FFT (kRfft) stands
// in for sizes without a Hadamard matrix; odd sizes (kNone) are an error.
//
// Thread-safety: the functions mutate the model/block passed in; nothing else is shared.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/quant_specs.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/act_quant.h"

namespace qcal::qsim {

// The rotations that apply to one model.
struct RotationPlan {
  bool r1 = false, r2 = false, r3 = false, r4 = false;
  int64_t r4_block = 0;  // RotationSpec::r4_block: 0, the whole Hadamard; else its blocks
  uint64_t seed = 0;
  int64_t hidden = 0, head_dim = 0, intermediate = 0;
  std::vector<std::string> warnings;  // fallbacks taken (also logged)
  // Learned rotations (SpinQuant, issue 17) in place of the random ones: T1 [hidden, hidden] for
  // R1 and T2 [layers, head_dim, head_dim] (one per block) for R2, float64 and orthogonal, in the
  // transforms' convention (a weight's input side A ← A·Tᵀ, its output side A ← T·A; the rotated
  // residual row vector is h·T1ᵀ). Undefined: the (randomized) Hadamards. SetLearnedRotations.
  at::Tensor r1_matrix, r2_matrices;
  bool learned() const { return r1_matrix.defined() || r2_matrices.defined(); }
  bool fuse_norms() const { return r1; }
  bool any() const { return r1 || r2 || r3 || r4; }
  std::string Describe() const;  // "R1 R2 R3 R4" or "none", plus fallbacks
};

// Applies the size rules above to the recipe's rotation section. spec.enabled = false gives an
// empty plan. InvalidArgument when R1 or R2 is requested for an odd size.
StatusOr<RotationPlan> PlanRotations(const RotationSpec& spec, const LlamaConfig& config);

// The plan's R1 / R2 as dense matrices T (what RotateBlockWeights applies: A ← A·Tᵀ on a
// weight's input side): T1 [hidden, hidden] and T2 [layers, head_dim, head_dim] float64.
StatusOr<std::pair<at::Tensor, at::Tensor>> DenseRotations(const RotationPlan& plan,
                                                           int64_t layers);

// Sets the plan's learned rotations (either may be undefined: that rotation keeps its Hadamard).
// InvalidArgument unless r1 is [hidden, hidden] and r2 [layers, head_dim, head_dim] with
// |T·Tᵀ − I| <= 1e-6, and the plan applies R1 / R2 at all.
Status SetLearnedRotations(RotationPlan* plan, const at::Tensor& r1, const at::Tensor& r2,
                           int64_t layers);

// R4's transform for the plan (OnlineHadamard::Create, or CreateBlockDiagonal with r4_block) of
// the intermediate size, or of size n: a down_proj's input size (Llama 4's dense layers are
// intermediate_size_mlp wide, its experts intermediate_size; PlanRotations checks every size).
StatusOr<std::shared_ptr<const OnlineHadamard>> R4Transform(const RotationPlan& plan);
StatusOr<std::shared_ptr<const OnlineHadamard>> R4Transform(const RotationPlan& plan, int64_t n);
// R4's transforms by size, each made once and shared by every down_proj of that size (a MoE
// block's experts). Holds `plan` by pointer: it must outlive this.
class R4Transforms {
 public:
  static StatusOr<R4Transforms> Create(const RotationPlan& plan);
  StatusOr<std::shared_ptr<const OnlineHadamard>> For(int64_t n);

 private:
  const RotationPlan* plan_ = nullptr;
  std::map<int64_t, std::shared_ptr<const OnlineHadamard>> by_size_;
};

// One block's offline work: norm fusion (when plan.fuse_norms()), R1, R2, and R4's fused half.
// Every linear is replaced by a DenseLinear of its transformed DenseWeight() (pass float
// weights). Does not install the online parts (nor record the rotations: methods/rotated_block.h
// RotateAndMarkBlock does, for the methods that check them).
// `layer` selects the block's learned R2 (needed only when the plan has r2_matrices).
Status RotateBlockWeights(model::BlockWeights& weights, const LlamaConfig& config,
                          const RotationPlan& plan, int64_t layer = -1);

// The online parts for one block: R3 as the block's qk_rotation hook, R4 as an ActQuantLinear
// (rotation only) around every down_proj (a MoE block's experts' too). Must follow RotateBlockWeights with the same plan.
Status InstallOnlineRotations(model::DecoderBlock& block, const RotationPlan& plan);

// The non-block weights: embedding (R1), final norm fused into the head (R1 implies fusion),
// head (R1). Replaces the model's head by a DenseLinear (untied).
Status RotateNonBlockWeights(model::LlamaModel& model, const RotationPlan& plan);

// The same on the non-block weights alone (a streamed model): embed and head rotated, the final
// norm fused into the head (then ones), head_tied false.
Status RotateNonBlockWeights(model::NonBlockWeights& weights, const RotationPlan& plan);
// Rows of the float embedding table ([..., hidden]) as RotateNonBlockWeights leaves them (each
// row transformed on its own, so rows rotated alone equal the rows of the rotated table).
StatusOr<at::Tensor> RotateEmbeddingRows(const at::Tensor& rows, const RotationPlan& plan);
// Rows [n, hidden] of the float head as RotateNonBlockWeights leaves them: the final norm's
// weights fused in, then R1 (row by row, so a table rotated in row chunks equals the whole
// table rotated).
StatusOr<at::Tensor> RotateHeadRows(const at::Tensor& rows, const at::Tensor& final_norm,
                                    const RotationPlan& plan);
// The final norm's weights once fused into the head: ones with R1, else unchanged.
at::Tensor FusedFinalNorm(const at::Tensor& final_norm, const RotationPlan& plan);

// The whole model: every block (RotateBlockWeights + InstallOnlineRotations) and the non-block
// weights. The float function is unchanged up to rounding.
Status RotateModel(model::LlamaModel& model, const RotationPlan& plan);

}  // namespace qcal::qsim
