// The scalar-quantized linear layer of RTN, GPTQ and QuaRot (the "scalar" layer format): integer
// codes [out, in] with per-channel or per-group scales and zero points, W ≈ scale·(code − zero),
// computing y exactly as an integer engine would; its checkpoint (de)serialisation, and the
// standard GPTQ tensor layout inference engines load. Tensor names, dtypes and shapes are listed
// in docs/formats.md ("Quantized linear tensors").
//
// Thread-safety: Forward is const and safe to call concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::quant {

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

// Checks `data` as ScalarQuantLinear::Create does (sizes, bits, group_size, code range,
// parameter counts, g_idx range) and fills an empty g_idx with the plain groups. InvalidArgument
// naming the problem.
Status CheckScalarLinearData(ScalarLinearData* data);

// A checkpoint's scalar layer `prefix` as stored (the qcal tensors; codes_int4 when present, which
// sets pack_int4), checked, without dequantizing it: what exports read. NotFound naming the
// missing tensor (a layer in another format has no prefix.qconfig); InvalidArgument otherwise.
StatusOr<ScalarLinearData> ReadScalarLinear(CheckpointReader& ckpt, const std::string& prefix);

// The GPTQ layout of `data` (see GptqTensors). InvalidArgument for bits other than 2, 3, 4, 8 or
// when in·bits or out·bits is not a multiple of 32 — unless `pad_words`: then a packed run that
// does not fill its last 32-bit word is zero-padded to a whole word (qweight gets
// ceil(in·bits/32) rows, qzeros ceil(out·bits/32) columns), which a reader of the documented bit
// stream decodes but loaders that assume whole words (transformers, vLLM) refuse.
StatusOr<GptqTensors> PackGptq(const ScalarLinearData& data, bool pad_words = false);

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
  Status MoveTo(const at::Device& device) override;  // the dequantized W
  const ScalarLinearData& data() const;

  // PackGptq(data(), pad_words).
  StatusOr<GptqTensors> ExportGptq(bool pad_words = false) const;
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
  const char* layer_format() const override { return "scalar"; }
  Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const override;
  // The shape and grid a checkpoint's layer `prefix` was stored with (its prefix.qconfig), read
  // without its codes: out_features, in_features, bits, group_size, symmetric. NotFound when
  // the layer is not in the scalar format.
  static StatusOr<ScalarLinearData> ReadGrid(CheckpointReader& ckpt, const std::string& prefix);
  // Create(ReadScalarLinear(ckpt, prefix)): rebuilds from the qcal tensors (the GPTQ ones are
  // not read). NotFound naming the missing tensor; InvalidArgument for a wrong dtype/shape or
  // anything Create rejects.
  static StatusOr<std::unique_ptr<ScalarQuantLinear>> Load(CheckpointReader& ckpt,
                                                           const std::string& prefix);

 private:
  ScalarQuantLinear() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace qcal::quant
