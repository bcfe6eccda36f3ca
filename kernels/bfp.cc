#include "kernels/bfp.h"

#include <algorithm>
#include <cmath>

namespace qcal::kernels {
namespace {

// Quantizes one block of `len` elements at x[0], x[stride], ...; writes mantissas / values with
// the same stride and returns the biased exponent.
uint8_t QuantizeBlock(const float* x, int64_t len, int64_t stride, int p, int8_t* mant,
                      float* values) {
  float a = 0.0f;
  for (int64_t i = 0; i < len; ++i) a = std::max(a, std::fabs(x[i * stride]));
  const uint8_t e_byte = BfpSharedExponent(a);
  if (a == 0.0f) {
    for (int64_t i = 0; i < len; ++i) {
      if (mant) mant[i * stride] = 0;
      values[i * stride] = 0.0f;
    }
    return e_byte;
  }
  const int shift = static_cast<int>(e_byte) - kBfpExponentBias - (p - 2);  // log2(scale).
  const double mmax = static_cast<double>((1 << (p - 1)) - 1);
  for (int64_t i = 0; i < len; ++i) {
    double m = std::nearbyint(std::ldexp(static_cast<double>(x[i * stride]), -shift));
    m = std::min(std::max(m, -mmax), mmax);
    if (mant) mant[i * stride] = static_cast<int8_t>(m);
    values[i * stride] = static_cast<float>(std::ldexp(m, shift));
  }
  return e_byte;
}

Status CheckInputs(const float* x, int64_t count, const BfpFormat& format) {
  QCAL_RETURN_IF_ERROR(ValidateBfpFormat(format));
  if (x == nullptr) return absl::InvalidArgumentError("bfp: null input");
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(absl::StrCat("bfp: non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status ValidateBfpFormat(const BfpFormat& f) {
  if (f.block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bfp: block_size = ", f.block_size, " must be >= 1"));
  }
  if (f.mantissa_bits < 2 || f.mantissa_bits > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("bfp: mantissa_bits = ", f.mantissa_bits, " must be in [2, 8]"));
  }
  return absl::OkStatus();
}

uint8_t BfpSharedExponent(float max_abs) {
  if (!(max_abs > 0.0f)) return 0;
  int e2 = 0;
  std::frexp(max_abs, &e2);  // max_abs = f · 2^e2, f ∈ [0.5, 1) → floor(log2) = e2 - 1.
  const int e = std::min(std::max(e2 - 1, -kBfpExponentBias), 127);
  return static_cast<uint8_t>(e + kBfpExponentBias);
}

uint8_t EncodeSignMagnitude(int m, int p) {
  const int mag = std::min(std::abs(m), (1 << (p - 1)) - 1);
  return static_cast<uint8_t>(((m < 0 ? 1 : 0) << (p - 1)) | mag);
}

int DecodeSignMagnitude(uint8_t bits, int p) {
  const int mag = bits & ((1 << (p - 1)) - 1);
  return (bits >> (p - 1)) & 1 ? -mag : mag;
}

StatusOr<BfpQuantized> BfpQuantize(const float* x, int64_t rows, int64_t cols,
                                   const BfpFormat& format, BfpAxis axis) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bfp: shape [", rows, ", ", cols, "] must be positive"));
  }
  QCAL_RETURN_IF_ERROR(CheckInputs(x, rows * cols, format));
  BfpQuantized q;
  q.rows = rows;
  q.cols = cols;
  q.format = format;
  q.axis = axis;
  q.values.resize(rows * cols);
  q.mantissas.resize(rows * cols);
  const int64_t bs = format.block_size;
  const int p = format.mantissa_bits;
  if (axis == BfpAxis::kAlongRows) {
    q.exponent_rows = rows;
    q.exponent_cols = (cols + bs - 1) / bs;
    q.exponents.resize(q.exponent_rows * q.exponent_cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < q.exponent_cols; ++b) {
        const int64_t off = r * cols + b * bs;
        q.exponents[r * q.exponent_cols + b] =
            QuantizeBlock(x + off, std::min(bs, cols - b * bs), 1, p, q.mantissas.data() + off,
                          q.values.data() + off);
      }
    }
  } else {
    q.exponent_rows = (rows + bs - 1) / bs;
    q.exponent_cols = cols;
    q.exponents.resize(q.exponent_rows * q.exponent_cols);
    for (int64_t b = 0; b < q.exponent_rows; ++b) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t off = b * bs * cols + c;
        q.exponents[b * cols + c] = QuantizeBlock(x + off, std::min(bs, rows - b * bs), cols, p,
                                                  q.mantissas.data() + off, q.values.data() + off);
      }
    }
  }
  return q;
}

Status BfpQuantizeDequantize(const float* x, int64_t count, const BfpFormat& format, float* out) {
  if (count < 0) return absl::InvalidArgumentError("bfp: negative count");
  if (out == nullptr) return absl::InvalidArgumentError("bfp: null output");
  QCAL_RETURN_IF_ERROR(CheckInputs(x, count, format));
  const int64_t bs = format.block_size;
  for (int64_t b = 0; b * bs < count; ++b) {
    // QuantizeBlock reads the whole block (the max) before writing, so out may alias x.
    QuantizeBlock(x + b * bs, std::min(bs, count - b * bs), 1, format.mantissa_bits, nullptr,
                  out + b * bs);
  }
  return absl::OkStatus();
}

void BfpDequantize(const BfpQuantized& q, float* out) {
  const int64_t bs = q.format.block_size;
  const int p = q.format.mantissa_bits;
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const int64_t e = q.axis == BfpAxis::kAlongRows ? r * q.exponent_cols + c / bs
                                                      : (r / bs) * q.exponent_cols + c;
      const int shift = static_cast<int>(q.exponents[e]) - kBfpExponentBias - (p - 2);
      out[r * q.cols + c] = static_cast<float>(std::ldexp(q.mantissas[r * q.cols + c], shift));
    }
  }
}

}  // namespace qcal::kernels
