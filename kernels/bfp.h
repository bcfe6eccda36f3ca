// Block floating point (BFP) quantization, CPU reference (block-quantization-k-sort §II-B).
//
// A BFP format has a block size n, a mantissa precision p (bits per element, sign included) and a
// shared 8-bit exponent per block. Elements are stored as integers M_i ∈ [-(2^(p-1)-1),
// 2^(p-1)-1] and represent 2^e · M_i. BFP12 = 4-bit mantissas, BFP16 = 8-bit mantissas (both with
// the 8-bit shared exponent; "12"/"16" count mantissa + exponent bits).
//
// Exactly what this implementation does for one block x_1..x_n (float):
//
//   1. a = max_i |x_i|. If a == 0: exponent byte 0, every mantissa 0, every value +0.
//   2. E = floor(log2 a) — the unbiased binary exponent of the block's largest magnitude, i.e.
//      a = 1.f · 2^E (std::frexp(a) = (f', E+1)). E is clamped to [-127, 127] (only blocks whose
//      max is a float subnormal are affected; they lose precision). The stored 8-bit shared
//      exponent is the byte E + 127 (kBfpExponentBias), so it lies in [0, 254].
//   3. The element scale is 2^(E - (p - 2)): the largest magnitude maps to a / 2^(E-p+2) ∈
//      [2^(p-2), 2^(p-1)), the top binade of the mantissa range (as in the OCP MX spec, shared
//      exponent = floor(log2 max) - emax_elem).
//   4. M_i = clamp(nearbyint(x_i / 2^(E-p+2)), -(2^(p-1)-1), 2^(p-1)-1): round to nearest with
//      ties to even, computed exactly in double; values that round up to 2^(p-1) (only possible
//      for magnitudes ≥ (2^(p-1) - 1/2)·2^(E-p+2)) saturate to ±(2^(p-1)-1).
//      Mantissas are sign + magnitude: the range is symmetric, -0 is not distinguished from +0.
//      EncodeSignMagnitude() gives the p-bit storage pattern (sign bit p-1, magnitude bits 0..p-2).
//   5. value_i = M_i · 2^(E-p+2), exact in float (no rounding on dequantization).
//
// Example, BFP12 (p = 4), block {7.9, 1.0, -0.3}: a = 7.9, E = 2, scale 2^0 = 1;
// 7.9 → 8 → saturates to 7; 1.0 → 1; -0.3 → -0 = 0. Block {15, 3}: E = 3, scale 2;
// 15/2 = 7.5 → 8 (ties to even) → saturates to 7 → 14; 3/2 = 1.5 → 2 → 4.
//
// Blocks run along contiguous elements of a row (kAlongRows: a [rows, cols] matrix is quantized
// row by row, blocks never cross rows) or down columns (kAlongColumns: blocks of consecutive rows
// of one column, stride cols). A last block shorter than block_size is allowed (ragged).
//
// Thread-safety: reentrant, single-threaded, deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace qcal::kernels {

inline constexpr int kBfpExponentBias = 127;

struct BfpFormat {
  int block_size = 32;    // >= 1.
  int mantissa_bits = 4;  // p, sign included; 2..8 (mantissas are stored as int8_t).

  // 4-bit mantissas, shared 8-bit exponent. Block sizes 16..128 are typical.
  static BfpFormat Bfp12(int block_size = 32) { return {block_size, 4}; }
  // 8-bit mantissas, shared 8-bit exponent.
  static BfpFormat Bfp16(int block_size = 32) { return {block_size, 8}; }

  // Storage cost: p + 8 / block_size bits per element.
  double bits_per_element() const { return mantissa_bits + 8.0 / block_size; }
};

// InvalidArgument for block_size < 1 or mantissa_bits outside [2, 8].
Status ValidateBfpFormat(const BfpFormat& format);

enum class BfpAxis {
  kAlongRows,     // Blocks of consecutive elements within a row (contiguous).
  kAlongColumns,  // Blocks of consecutive rows within a column (stride = cols).
};

// The shared exponent byte (E + 127, step 2 above) for a block whose largest magnitude is
// max_abs (finite, >= 0). 0 for max_abs == 0.
uint8_t BfpSharedExponent(float max_abs);

// p-bit sign-magnitude pattern of a mantissa m ∈ [-(2^(p-1)-1), 2^(p-1)-1]: bit p-1 = sign,
// bits 0..p-2 = |m|. And its inverse.
uint8_t EncodeSignMagnitude(int m, int mantissa_bits);
int DecodeSignMagnitude(uint8_t bits, int mantissa_bits);

struct BfpQuantized {
  int64_t rows = 0;
  int64_t cols = 0;
  BfpFormat format;
  BfpAxis axis = BfpAxis::kAlongRows;
  // kAlongRows: exponents are [rows, ceil(cols / block_size)] row-major;
  // kAlongColumns: [ceil(rows / block_size), cols] row-major.
  int64_t exponent_rows = 0;
  int64_t exponent_cols = 0;
  std::vector<float> values;       // Dequantized, [rows, cols].
  std::vector<int8_t> mantissas;   // M_i, [rows, cols].
  std::vector<uint8_t> exponents;  // Biased shared exponents (E + 127).
};

// Quantizes x ([rows, cols] row-major) to `format` with blocks along `axis`. InvalidArgument for
// a bad format, a non-positive shape, a null pointer or a non-finite value (with its index).
StatusOr<BfpQuantized> BfpQuantize(const float* x, int64_t rows, int64_t cols,
                                   const BfpFormat& format, BfpAxis axis = BfpAxis::kAlongRows);

// Quantize-dequantize of one contiguous vector of `count` elements (blocks along it): out may
// alias x. Same errors as BfpQuantize.
Status BfpQuantizeDequantize(const float* x, int64_t count, const BfpFormat& format, float* out);

// Rebuilds values [rows, cols] from mantissas and exponents (exact: value = M · 2^(E-p+2)).
void BfpDequantize(const BfpQuantized& q, float* out);

}  // namespace qcal::kernels
