// Quantized linear layers: drop-in model::Linear implementations that compute y from stored codes
// exactly as the inference engines would, plus their checkpoint (de)serialisation.
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
// ScalarQuantLinear (RTN / GPTQ): integer codes [out, in] with per-channel or per-group scales
// and zero points; W ≈ scale · (code − zero). Exports the standard GPTQ tensors too.
//
// The fixed transforms are worker/quant/transforms_torch.h's OrthogonalTransformOp; tensor
// names, dtypes and shapes are listed in docs/formats.md ("Quantized linear tensors").
//
// Thread-safety: Forward is const and safe to call concurrently; fine-tuning mutates parameters
// and must not overlap Forward on other threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/safetensors.h"
#include "common/status.h"
#include "kernels/codebook.h"
#include "kernels/incoherence.h"
#include "worker/model/llama.h"
#include "worker/quant/quip_linear_data.h"

namespace qcal::quant {


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
  Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const;
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

// Everything needed to rebuild a ScalarQuantLinear (kernels::ScalarRoundingResult with
// per-channel or per-group parameters, param_rows == rows).
struct ScalarLinearData {
  int64_t in_features = 0, out_features = 0;
  int bits = 4;                     // symmetric: 2..16, asymmetric: 1..16
  bool symmetric = true;
  int64_t group_size = -1;          // -1: per channel (groups = 1), else groups = ceil(in / g)
  std::vector<int32_t> codes;       // [out, in], in [ScalarCodeMin, ScalarCodeMax] of the grid
  std::vector<float> scales;        // [out, groups], positive and finite
  std::vector<int32_t> zeros;       // [out, groups]; 0 for symmetric grids
  std::vector<int32_t> g_idx;       // [in]: group of each input column (act-order permutes);
                                    // empty = column j in group j / group_size (or 0)
  // Checkpoint storage: codes packed two per byte (bits <= 4 only) instead of one per byte, and
  // no GPTQ layout (QuaRot checkpoints, whose rotated weights need the online transforms anyway).
  bool pack_int4 = false;
};

// GPTQ's packed tensors (AutoGPTQ "gptq" checkpoint format, a.k.a. v1). Codes are stored
// unsigned: u = code + 2^(bits-1) for symmetric grids (whose zero point becomes 2^(bits-1)),
// u = code for asymmetric ones. Packing is a little-endian bit stream: value j of a packed run
// occupies bits [bits·j, bits·(j+1)) of the run, word w holding stream bits [32w, 32w+32); for
// bits 3 a value may straddle two words (AutoGPTQ's 3-bit layout).
//   qweight [in·bits/32, out]: column c is the stream of u[c][0..in) (packed along the input dim)
//   qzeros [groups, out·bits/32]: row g is the stream of (zero[c][g] − 1) mod 2^bits over c
//     (AutoGPTQ stores zero − 1 and its kernels add the 1 back; a zero point of 0 wraps to
//     2^bits − 1, AutoGPTQ's known limitation of this format)
//   scales [groups, out] F16, g_idx [in] I32.
struct GptqTensors {
  int bits = 0;
  int64_t in_features = 0, out_features = 0, groups = 0;
  std::vector<int32_t> qweight;  // [in·bits/32, out]
  std::vector<int32_t> qzeros;   // [groups, out·bits/32]
  std::vector<uint16_t> scales;  // [groups, out] IEEE half bits
  std::vector<int32_t> g_idx;    // [in]
};

class ScalarQuantLinear final : public model::Linear {
 public:
  // Validates `data` (sizes, bits, group_size, code range, parameter counts, g_idx range) and
  // dequantizes W = scale·(code − zero) in float32. InvalidArgument naming the problem.
  static StatusOr<std::unique_ptr<ScalarQuantLinear>> Create(ScalarLinearData data);
  // x @ Wᵀ with the cached dequantized W.
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override;
  int64_t out_features() const override;
  at::Tensor DenseWeight() const override;  // [out, in] float32, scale·(code − zero)
  const ScalarLinearData& data() const;

  // The GPTQ layout (see GptqTensors). InvalidArgument for bits other than 2, 3, 4, 8 or when
  // in·bits or out·bits is not a multiple of 32.
  StatusOr<GptqTensors> ExportGptq() const;
  bool GptqExportable() const;

  // qcal tensors: prefix.codes [out, in] I8/I16 (signed, symmetric) or U8/U16 (asymmetric) by
  // bits <= 8 / > 8 — or, with data().pack_int4, prefix.codes_int4 [out, ceil(in/2)] U8 holding
  // codes 2j (low nibble) and 2j+1 (high nibble) of each row, two's complement for symmetric
  // grids, unsigned for asymmetric ones, a zero high nibble when in is odd —, prefix.scales
  // [out, groups] F32, prefix.zeros [out, groups] I32,
  // prefix.g_idx [in] I32, prefix.qconfig [5] I64 = {out_features, in_features, bits,
  // group_size (-1 per channel), symmetric (1/0)}; and, when GptqExportable(), the GPTQ layout
  // inference engines load: prefix.qweight [in·bits/32, out] I32, prefix.qzeros
  // [groups, out·bits/32] I32, prefix.scales_gptq [groups, out] F16 (prefix.g_idx is shared:
  // same name, same meaning in both layouts); never with pack_int4.
  Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const;
  // Rebuilds from the qcal tensors (the GPTQ ones are not read; codes_int4 when present, which
  // sets pack_int4). NotFound naming the missing tensor; InvalidArgument for a wrong dtype/shape
  // or anything Create rejects.
  static StatusOr<std::unique_ptr<ScalarQuantLinear>> Load(CheckpointReader& ckpt,
                                                           const std::string& prefix);

 private:
  ScalarQuantLinear() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace qcal::quant
