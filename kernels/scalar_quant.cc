#include "kernels/scalar_quant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/cpu.h"
#include "common/dtype.h"

namespace qcal::kernels {
namespace {

// sum |dequant(code(x)) - x|^norm, the clip-search objective (norm == 2 avoids pow), summed in
// index order. Stops early, returning the partial sum, once that reaches `bound`: every term is
// >= 0 and round-to-nearest addition of a non-negative term never decreases a sum, so the full
// sum would be >= bound too and the candidate could not win a strict `err < bound` comparison.
// The search therefore chooses exactly what summing every term would choose (at 70B shapes the
// pow() calls are the GPTQ block task's largest cost on CPU; the far-off ratios stop early).
template <typename T>
double LpError(const T* x, int64_t count, const ScalarQuantParams<T>& p, int32_t cmin, int32_t cmax,
               double norm, double bound) {
  constexpr int64_t kCheckEvery = 64;
  double err = 0;
  for (int64_t i0 = 0; i0 < count; i0 += kCheckEvery) {
    const int64_t i1 = std::min(count, i0 + kCheckEvery);
    if (norm == 2.0) {
      for (int64_t i = i0; i < i1; ++i) {
        const double d =
            static_cast<double>(ScalarDequantizeCode(ScalarQuantizeCode(x[i], p, cmin, cmax), p)) -
            static_cast<double>(x[i]);
        err += d * d;
      }
    } else {
      for (int64_t i = i0; i < i1; ++i) {
        const double d =
            static_cast<double>(ScalarDequantizeCode(ScalarQuantizeCode(x[i], p, cmin, cmax), p)) -
            static_cast<double>(x[i]);
        err += std::pow(std::fabs(d), norm);
      }
    }
    if (err >= bound) return err;
  }
  return err;
}

}  // namespace

Status ValidateScalarQuantConfig(const ScalarQuantConfig& c) {
  const int min_bits = c.symmetric ? 2 : 1;
  if (c.bits < min_bits || c.bits > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("scalar quant: bits = ", c.bits, " out of [", min_bits, ", 16] for a ",
                     c.symmetric ? "symmetric" : "asymmetric", " grid"));
  }
  if (c.granularity == QuantGranularity::kPerGroup && c.group_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("scalar quant: group_size = ", c.group_size, " must be > 0"));
  }
  if (!(c.clip_ratio > 0.0 && c.clip_ratio <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scalar quant: clip_ratio = ", c.clip_ratio, " must be in (0, 1]"));
  }
  if (c.clip_search) {
    if (c.clip_search_grid <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("scalar quant: clip_search_grid = ", c.clip_search_grid, " must be > 0"));
    }
    if (!(c.clip_search_max_shrink > 0.0 && c.clip_search_max_shrink < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("scalar quant: clip_search_max_shrink = ", c.clip_search_max_shrink,
                       " must be in (0, 1)"));
    }
    if (!(c.clip_search_norm > 0.0) || !std::isfinite(c.clip_search_norm)) {
      return absl::InvalidArgumentError(
          absl::StrCat("scalar quant: clip_search_norm = ", c.clip_search_norm, " must be > 0"));
    }
  }
  return absl::OkStatus();
}

double RoundScaleToHalf(double scale) {
  constexpr double kMinNormal = 6.103515625e-05;  // 2^-14
  constexpr double kMax = 65504.0;
  if (!(scale > kMinNormal)) return kMinNormal;  // NaN too
  if (scale >= kMax) return kMax;
  return static_cast<double>(HalfToFloat(FloatToHalf(static_cast<float>(scale))));
}

template <typename T>
ScalarQuantParams<T> ScalarQuantParamsFromRange(double lo, double hi, double clip_ratio,
                                                const ScalarQuantConfig& c) {
  ScalarQuantParams<T> p;
  p.clip_ratio = clip_ratio;
  auto scale_of = [&c](double s) {
    return static_cast<T>(c.f16_scales ? RoundScaleToHalf(s) : s);
  };
  if (c.symmetric) {
    const double qmax = static_cast<double>(ScalarCodeMax(c));
    const double m = clip_ratio * std::max(std::fabs(lo), std::fabs(hi));
    if (m == 0.0) {
      p.scale = T(1);
      p.zero = 0;
    } else {
      p.scale = scale_of(m / qmax);
      p.zero = 0;
    }
  } else {
    const double qmax = static_cast<double>(ScalarCodeMax(c));
    double xmin = clip_ratio * std::min(lo, 0.0);
    double xmax = clip_ratio * std::max(hi, 0.0);
    if (xmin == 0.0 && xmax == 0.0) {  // GPTQ's fallback.
      xmin = -1.0;
      xmax = 1.0;
    }
    p.scale = scale_of((xmax - xmin) / qmax);
    const double z = std::nearbyint(-xmin / static_cast<double>(p.scale));
    p.zero = static_cast<int32_t>(std::min(std::max(z, 0.0), qmax));
  }
  if (!(p.scale > T(0))) p.scale = std::numeric_limits<T>::min();  // Underflow in T (tiny data).
  return p;
}

template <typename T>
ScalarQuantParams<T> ComputeScalarQuantParams(const T* x, int64_t count,
                                              const ScalarQuantConfig& c) {
  double lo = 0, hi = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double v = static_cast<double>(x[i]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (!c.clip_search) return ScalarQuantParamsFromRange<T>(lo, hi, c.clip_ratio, c);

  const int32_t cmin = ScalarCodeMin(c), cmax = ScalarCodeMax(c);
  const int steps = static_cast<int>(c.clip_search_max_shrink * c.clip_search_grid);
  ScalarQuantParams<T> best = ScalarQuantParamsFromRange<T>(lo, hi, 1.0, c);
  double best_err = LpError(x, count, best, cmin, cmax, c.clip_search_norm,
                            std::numeric_limits<double>::infinity());
  for (int i = 1; i < steps; ++i) {
    const double ratio = 1.0 - static_cast<double>(i) / c.clip_search_grid;
    const ScalarQuantParams<T> p = ScalarQuantParamsFromRange<T>(lo, hi, ratio, c);
    const double err = LpError(x, count, p, cmin, cmax, c.clip_search_norm, best_err);
    if (err < best_err) {
      best_err = err;
      best = p;
    }
  }
  return best;
}

template <typename T>
StatusOr<ScalarQuantized<T>> QuantizeScalar(const T* x, int64_t rows, int64_t cols,
                                            const ScalarQuantConfig& c, int num_threads) {
  QCAL_RETURN_IF_ERROR(ValidateScalarQuantConfig(c));
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("scalar quant: shape [", rows, ", ", cols, "] must be positive"));
  }
  if (x == nullptr) return absl::InvalidArgumentError("scalar quant: null input");
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(static_cast<double>(x[i]))) {
      return absl::InvalidArgumentError(
          absl::StrCat("scalar quant: non-finite value at row ", i / cols, ", col ", i % cols));
    }
  }

  ScalarQuantized<T> q;
  q.rows = rows;
  q.cols = cols;
  switch (c.granularity) {
    case QuantGranularity::kPerTensor:
      q.param_rows = 1;
      q.param_cols = 1;
      q.group_cols = cols;
      break;
    case QuantGranularity::kPerChannel:
    case QuantGranularity::kPerToken:
      q.param_rows = rows;
      q.param_cols = 1;
      q.group_cols = cols;
      break;
    case QuantGranularity::kPerGroup:
      q.param_rows = rows;
      q.group_cols = std::min(c.group_size, cols);
      q.param_cols = (cols + q.group_cols - 1) / q.group_cols;
      break;
  }
  const int64_t np = q.param_rows * q.param_cols;
  q.scales.resize(np);
  q.zeros.resize(np);
  q.clip_ratios.resize(np);
  q.values.resize(n);
  q.codes.resize(n);
  const int32_t cmin = ScalarCodeMin(c), cmax = ScalarCodeMax(c);

  auto quantize_span = [&](const T* src, int64_t count, const ScalarQuantParams<T>& p,
                           int64_t offset) {
    for (int64_t i = 0; i < count; ++i) {
      const int32_t code = ScalarQuantizeCode(src[i], p, cmin, cmax);
      q.codes[offset + i] = code;
      q.values[offset + i] = ScalarDequantizeCode(code, p);
    }
  };
  auto store = [&](int64_t k, const ScalarQuantParams<T>& p) {
    q.scales[k] = p.scale;
    q.zeros[k] = p.zero;
    q.clip_ratios[k] = p.clip_ratio;
  };

  if (q.param_rows == 1) {  // Per-tensor: the tensor is one contiguous set.
    const ScalarQuantParams<T> p = ComputeScalarQuantParams(x, n, c);
    store(0, p);
    quantize_span(x, n, p, 0);
    return q;
  }
  // Tasks of whole rows, at least kMinTaskWeights weights each (a small tensor, such as one
  // token's activations, stays on the calling thread); the boundaries never change a result.
  constexpr int64_t kMinTaskWeights = int64_t{1} << 16;
  const int64_t rows_per_task = std::max<int64_t>(1, kMinTaskWeights / cols);
  const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
  ParallelTasks(tasks, num_threads, [&](int64_t task) {
    const int64_t r1 = std::min(rows, (task + 1) * rows_per_task);
    for (int64_t r = task * rows_per_task; r < r1; ++r) {
      for (int64_t g = 0; g < q.param_cols; ++g) {
        const int64_t c0 = g * q.group_cols;
        const int64_t len = std::min(q.group_cols, cols - c0);
        const T* src = x + r * cols + c0;
        const ScalarQuantParams<T> p = ComputeScalarQuantParams(src, len, c);
        store(r * q.param_cols + g, p);
        quantize_span(src, len, p, r * cols + c0);
      }
    }
  });
  return q;
}

template <typename T>
void DequantizeScalar(const ScalarQuantized<T>& q, T* out) {
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t col = 0; col < q.cols; ++col) {
      out[r * q.cols + col] = ScalarDequantizeCode(q.codes[r * q.cols + col], q.params(r, col));
    }
  }
}

#define QCAL_INSTANTIATE_SCALAR_QUANT(T)                                                 \
  template ScalarQuantParams<T> ScalarQuantParamsFromRange<T>(double, double, double,    \
                                                              const ScalarQuantConfig&); \
  template ScalarQuantParams<T> ComputeScalarQuantParams<T>(const T*, int64_t,           \
                                                            const ScalarQuantConfig&);   \
  template StatusOr<ScalarQuantized<T>> QuantizeScalar<T>(const T*, int64_t, int64_t,    \
                                                          const ScalarQuantConfig&, int); \
  template void DequantizeScalar<T>(const ScalarQuantized<T>&, T*);

QCAL_INSTANTIATE_SCALAR_QUANT(float)
QCAL_INSTANTIATE_SCALAR_QUANT(double)
#undef QCAL_INSTANTIATE_SCALAR_QUANT

}  // namespace qcal::kernels
