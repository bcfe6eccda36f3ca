// QuIP#'s quantized linear layer (the "quip" layer format): a model::Linear that computes y from
// stored codebook codes exactly as an inference engine would, plus its checkpoint
// (de)serialisation.
//
// QuipLinear (QuIP# Algorithm 2): W ≈ diag(su) · T_uᵀ · (S · Ŵ) · T_v · diag(sv), where
//   * Ŵ [out_pad, in_pad] is decoded from codebook codes (E8P, RVQ, half-integer grid),
//   * S is one scale for the whole matrix (QuIP#'s rule) or diag(row_scales), one per row of Ŵ,
//   * T_u (out_pad) and T_v (in_pad) are the fixed orthogonal parts of the transforms of
//     kernels/incoherence.h: the normalized Hadamard H_{2^k}⊗H_m, or for RFFT sizes F·diag(phases),
//   * su [out_pad], sv [in_pad] are the sign vectors: for Hadamard sizes S_U/S_V (so that
//     T_u·diag(su) is incoherence.h's U), for RFFT sizes all ones; ±1 after quantization, real
//     numbers after fine-tuning (QuIP# §5),
//   * inputs are zero-padded from in_features to in_pad (a multiple of the codebook dimension)
//     and outputs sliced from out_pad to out_features.
// Forward(x): x → pad → ·sv → T_v → matmul with (S·Ŵ)ᵀ → T_uᵀ → ·su → slice. The decoded S·Ŵ is
// cached as a float tensor (decoding again is pure overhead on CPU). Every step is a LibTorch op,
// so gradients flow to su, sv (and to x) for fine-tuning.
//
// The fixed transforms are methods/quip/transforms_torch.h's OrthogonalTransformOp; tensor names,
// dtypes and shapes are listed in docs/formats.md ("Quantized linear tensors").
//
// Thread-safety: Forward is const and safe to call concurrently; fine-tuning mutates parameters
// and must not overlap Forward on other threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/safetensors.h"
#include "common/status.h"
#include "kernels/codebook.h"
#include "kernels/incoherence.h"
#include "methods/quip/quip_linear_data.h"
#include "engine/model/llama.h"

namespace qcal::methods::quip {

class QuipLinear final : public model::Linear {
 public:
  // Validates `data` and decodes Ŵ. InvalidArgument for non-positive sizes, pads smaller than the
  // features, an unknown codebook, in_pad not a multiple of the codebook dimension, a code count
  // other than out_pad·(in_pad/dim)·code_words, a code word >= 2^16, a non-positive scale, or
  // (incoherence) transforms whose dimension is not out_pad / in_pad or whose signs/phases do
  // not match their kind, or row_scales neither empty nor out_pad positive finite values.
  static StatusOr<std::unique_ptr<QuipLinear>> Create(QuipLinearData data);

  // x [..., in_features] float32 (float64 computes in float64) -> [..., out_features].
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override;
  int64_t out_features() const override;
  at::Tensor DenseWeight() const override;  // [out, in] float32, = diag(su)·T_uᵀ·S·Ŵ·T_v·diag(sv)
  std::vector<at::Tensor> TunableVectors() override { return {su(), sv()}; }
  // Ŵ, su and sv (the transforms' small tables follow the input on every call).
  Status MoveTo(const at::Device& device) override;

  // Fine-tuning (QuIP# §5): the sign vectors as real-valued leaf tensors (requires_grad off
  // until the caller sets it; assigning a new tensor of the same shape is allowed). su/sv are
  // what Forward, DenseWeight and AppendTensors use; data().t_u/t_v keep the original ±1 signs.
  at::Tensor& su();  // [out_pad] float32
  at::Tensor& sv();  // [in_pad]  float32
  const QuipLinearData& data() const;
  // S·Ŵ [out_pad, in_pad] float32: the decoded, scaled weights in the rotated basis (no grad).
  const at::Tensor& RotatedWeight() const;

  // Checkpoint tensors under `prefix` (e.g. "model.layers.3.self_attn.q_proj"):
  //   prefix.codes [out_pad, in_pad/dim, code_words] U16 when any code word > 255, else U8
  //   prefix.su [out_pad] F32, prefix.sv [in_pad] F32 (the current, possibly fine-tuned values)
  //   prefix.scale [] F32 (one scale per matrix) or [out_pad] F32 (row_scales); Load accepts both
  //   prefix.phase_u [out_pad/2, 2] / prefix.phase_v [in_pad/2, 2] F64 (re, im), only for RFFT
  //     sizes with incoherence (Hadamard sizes need none: their signs are su/sv)
  //   prefix.shape [4] I64 = {out_features, in_features, out_pad, in_pad}
  // The codebook name and the incoherence flag go into quantization_config (docs/formats.md).
  const char* layer_format() const override { return "quip"; }
  Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const override;
  // Rebuilds the layer from those tensors. Hadamard transforms get signs sign(su) (+1 for 0) in
  // data(); su/sv keep the stored real values. NotFound naming the missing tensor;
  // InvalidArgument for a wrong dtype/shape or anything Create rejects.
  static StatusOr<std::unique_ptr<QuipLinear>> Load(CheckpointReader& ckpt,
                                                    const std::string& prefix,
                                                    const std::string& codebook, bool incoherence);

 private:
  QuipLinear() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace qcal::methods::quip
