// FP8 (E4M3) KV cache with static per-tensor scales: what compressed-tensors' `kv_cache_scheme`
// (8-bit float, strategy tensor, static) describes and vLLM serves. Each attention layer has a
// float32 k_scale and v_scale calibrated by the job; the cache holds e4m3(x / scale) and
// attention reads float(e4m3) · scale (docs/formats.md, "FP8 KV cache").
//
// E4M3 ("fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits; normal values
// (1 + m/8) · 2^(e-7) for e in 1..15 (e = 15, m = 7 is NaN), subnormals m/8 · 2^-6; largest
// finite 448. Conversion as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3): round to
// nearest, ties to even, magnitudes beyond 448 (infinities included) saturate to ±448, NaN stays
// NaN.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/qsim/kv_quantizer.h"

namespace qcal::qsim {

inline constexpr double kFp8E4M3Max = 448.0;

// Every element of y (float32, any shape and device) rounded to the nearest E4M3 value as above,
// returned as float32 (exact: every E4M3 value is a float32).
at::Tensor RoundToFp8E4M3(const at::Tensor& y);

// The static scale of a calibrated range [lo, hi]: float32(max(|lo|, |hi|) / 448), computed in
// double (compressed-tensors' FP8 rule: the largest magnitude maps to the largest finite value);
// 1 for an all-zero range.
float Fp8StaticScale(double lo, double hi);

// The FP8 KV hook: keys (after RoPE and R3) and values become RoundToFp8E4M3(x / s) · s, the
// division and the product in float32 (IEEE), s the role's static scale; queries pass. Causal
// (fixed scales), deterministic, thread-safe.
class Fp8KvQuantizer final : public KvQuantizer {
 public:
  // InvalidArgument unless both scales are finite and > 0.
  static StatusOr<std::shared_ptr<const Fp8KvQuantizer>> Create(float k_scale, float v_scale);
  // From calibrated ranges (Fp8StaticScale of each role's).
  static StatusOr<std::shared_ptr<const Fp8KvQuantizer>> FromRanges(const KvStaticRanges& ranges);
  at::Tensor Apply(const at::Tensor& x, KvRole role) const override;
  std::string Describe() const override;
  float scale(KvRole role) const { return scales_[role == KvRole::kKey ? 0 : 1]; }

 private:
  Fp8KvQuantizer() = default;
  float scales_[2] = {1.0f, 1.0f};
};

}  // namespace qcal::qsim
