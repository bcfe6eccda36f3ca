// Round-to-nearest integer quantizers (CPU reference): symmetric and asymmetric k-bit grids with
// per-tensor, per-channel, per-group and per-token parameters, a fixed clip ratio or the
// MSE-optimal clip search used for weights by GPTQ and QuaRot (QuaRot §4: "RTN/GPTQ weights
// per-channel symmetric with clip-ratio search, per-token activations, group-wise KV").
//
// Grids (identical to QuaRot's WeightQuantizer / ActQuantizer and GPTQ's asymmetric Quantizer):
//
//   symmetric, b bits:  qmax = 2^(b-1) - 1, codes c ∈ [-2^(b-1), qmax], zero point z = 0,
//                       scale s = r·max|x| / qmax            (r = clip ratio)
//   asymmetric, b bits: qmax = 2^b - 1,     codes c ∈ [0, qmax],
//                       lo = r·min(min x, 0), hi = r·max(max x, 0)   (the range always holds 0)
//                       s = (hi - lo) / qmax, z = nearbyint(-lo / s) ∈ [0, qmax]
//
//   with f16_scales, s is rounded to IEEE half (RoundScaleToHalf) before z and the codes.
//
//   code(x)    = clamp(nearbyint(x / s) + z, cmin, cmax)   (x / s evaluated in double; nearbyint
//                                                            rounds half to even, like torch.round)
//   dequant(c) = T(c - z) · s                               (in the element type T)
//
// so (codes, scales, zero points) reproduce the dequantized values bit for bit. A parameter set
// whose range is zero (all values 0) gets s = 1, z = 0 (symmetric) or GPTQ's [-1, 1] fallback
// s = 2/qmax, z = nearbyint(qmax/2) (asymmetric); either way every value gets code z and
// dequantizes to exactly 0.
//
// Note: GPTQ's own "sym" weight quantizer is the asymmetric formula with z = (qmax+1)/2, whose
// grid loses the top positive level; we follow QuaRot's symmetric grid above instead.
//
// Granularity (x is row-major [rows, cols]; a "row" is an output channel of a weight
// W[out_features, in_features] or a token of an activation X[tokens, hidden]):
//
//   kPerTensor   one (s, z) for the whole tensor                 scales: [1, 1]
//   kPerChannel  one per row (output channel)                    scales: [rows, 1]
//   kPerToken    one per row (token); the same math as per-channel, named for activations
//   kPerGroup    one per row and per group of group_size consecutive columns (along the input
//                dim); a last group shorter than group_size is allowed (ragged)
//                                                                 scales: [rows, ceil(cols/g)]
//
// Clip search (clip_search = true; GPTQ's Quantizer.find_params(mse=True), which QuaRot uses
// for weights with --w_clip): for each parameter set independently, try the ratios
// r_i = 1 - i / clip_search_grid for i = 0 .. floor(clip_search_max_shrink·grid) - 1 (defaults:
// 1.00, 0.99, ..., 0.21), quantize the set with each, and keep the ratio with the smallest
// sum |dequant(code(x)) - x|^clip_search_norm (first one on ties, so r = 1 wins unless a
// smaller ratio is strictly better). Because r = 1 is always tried, the chosen parameters are
// never worse than no clipping in that norm. Cost: (#ratios) quantization passes.
//
// Thread-safety: all functions are reentrant and single-threaded. No randomness.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status.h"

namespace qcal::kernels {

enum class QuantGranularity {
  kPerTensor,
  kPerChannel,
  kPerGroup,
  kPerToken,
};

struct ScalarQuantConfig {
  int bits = 4;  // symmetric: 2..16, asymmetric: 1..16.
  bool symmetric = true;
  QuantGranularity granularity = QuantGranularity::kPerChannel;
  int64_t group_size = 128;  // kPerGroup only; > 0 (need not divide cols).
  double clip_ratio = 1.0;   // In (0, 1]; used when clip_search is false.
  bool clip_search = false;
  int clip_search_grid = 100;           // GPTQ's `grid`.
  double clip_search_max_shrink = 0.8;  // GPTQ's `maxshrink`: the smallest ratio is 1 - 0.79.
  double clip_search_norm = 2.4;        // GPTQ's `norm` (p of the L_p error); 2 gives the MSE.
  // Scales rounded to IEEE half (RoundScaleToHalf) before any code is chosen, so the codes,
  // scales and zero points are exact in a format with fp16 scales (GPTQ checkpoints, fp16
  // inference kernels) and dequantize there to the values the quantizer chose.
  bool f16_scales = false;
};

// A positive scale rounded to the nearest IEEE half (ties to even), kept inside the normal half
// range [2^-14, 65504]: a scale below it would lose precision as a subnormal or round to 0.
// Rounding down by up to 2^-11 of the scale can leave the far end of a range uncovered by up to
// qmax·2^-11 steps, so the error bound is then half a step plus that. Rounding up instead keeps
// the bound exact but was measurably worse on gptq-4bit (stories260K, TinyStories perplexity
// 15.337 vs 15.282).
double RoundScaleToHalf(double scale);

// InvalidArgument if a field is out of range (bits, group_size, clip ratio, search grid, norm).
Status ValidateScalarQuantConfig(const ScalarQuantConfig& config);

// Smallest and largest integer code of the grid (see the table above).
inline int32_t ScalarCodeMin(const ScalarQuantConfig& c) {
  return c.symmetric ? -(int32_t{1} << (c.bits - 1)) : 0;
}
inline int32_t ScalarCodeMax(const ScalarQuantConfig& c) {
  return c.symmetric ? (int32_t{1} << (c.bits - 1)) - 1 : (int32_t{1} << c.bits) - 1;
}

// Quantization parameters of one set of values (one tensor / channel / group / token).
template <typename T>
struct ScalarQuantParams {
  T scale = 1;              // > 0.
  int32_t zero = 0;         // 0 for symmetric grids.
  double clip_ratio = 1.0;  // The ratio used (the searched one when clip_search is on).
};

// code(x) and dequant(c) of the header comment.
template <typename T>
inline int32_t ScalarQuantizeCode(T x, const ScalarQuantParams<T>& p, int32_t cmin, int32_t cmax) {
  double q = std::nearbyint(static_cast<double>(x) / static_cast<double>(p.scale)) + p.zero;
  q = q < cmin ? cmin : (q > cmax ? cmax : q);
  return static_cast<int32_t>(q);
}
template <typename T>
inline T ScalarDequantizeCode(int32_t code, const ScalarQuantParams<T>& p) {
  return static_cast<T>(code - p.zero) * p.scale;
}

// Parameters for the `count` contiguous values x[0..count) under `config`'s grid, clip ratio and
// clip search (granularity and group_size are ignored: the caller picks the set). Assumes a
// valid config (ValidateScalarQuantConfig) and finite values. T = float or double.
template <typename T>
ScalarQuantParams<T> ComputeScalarQuantParams(const T* x, int64_t count,
                                              const ScalarQuantConfig& config);

// Same with the range given directly (lo <= 0 <= hi not required; clip ratio r applied here,
// no search): symmetric uses max(|lo|, |hi|), asymmetric min(lo, 0) and max(hi, 0).
template <typename T>
ScalarQuantParams<T> ScalarQuantParamsFromRange(double lo, double hi, double clip_ratio,
                                                const ScalarQuantConfig& config);

// The result of quantizing a [rows, cols] tensor.
template <typename T>
struct ScalarQuantized {
  int64_t rows = 0;
  int64_t cols = 0;
  // scales / zeros / clip_ratios are row-major [param_rows, param_cols]; parameter (i, j) covers
  // row i (or every row when param_rows == 1) and columns [j·group_cols, min((j+1)·group_cols,
  // cols)).
  int64_t param_rows = 0;
  int64_t param_cols = 0;
  int64_t group_cols = 0;
  std::vector<T> values;            // Dequantized, [rows, cols].
  std::vector<int32_t> codes;       // [rows, cols], in [ScalarCodeMin, ScalarCodeMax].
  std::vector<T> scales;            // [param_rows, param_cols].
  std::vector<int32_t> zeros;       // [param_rows, param_cols].
  std::vector<double> clip_ratios;  // [param_rows, param_cols].

  ScalarQuantParams<T> params(int64_t row, int64_t col) const {
    const int64_t k = (param_rows == 1 ? 0 : row) * param_cols + col / group_cols;
    return {scales[k], zeros[k], clip_ratios[k]};
  }
};

// Quantize-dequantizes x ([rows, cols] row-major) with round-to-nearest. InvalidArgument for a
// bad config, empty or negative shape, null pointer, or a non-finite value (with its index).
// Per-channel and per-group grids run in fixed tasks of whole rows on up to `num_threads` threads
// (0: AvailableCpus(), the rank's affinity mask); each row's parameters and codes depend only on
// that row, so the result does not depend on the thread count. The clip search (80 candidate
// ratios, each an L_p error with pow() per weight) is the costly part: about 1.3 µs per weight
// on one core (bench_rounding BM_RtnClipSearchThreads).
template <typename T>
StatusOr<ScalarQuantized<T>> QuantizeScalar(const T* x, int64_t rows, int64_t cols,
                                            const ScalarQuantConfig& config, int num_threads = 0);

// Rebuilds the dequantized values from codes and parameters: out [rows, cols].
template <typename T>
void DequantizeScalar(const ScalarQuantized<T>& q, T* out);

}  // namespace qcal::kernels
