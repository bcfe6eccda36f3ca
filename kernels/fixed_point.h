// The exact fixed-point Hessian sums, defined once for host and device code.
//
// qcal sums Hessians H = Σ xᵀx as 128-bit integers so that the sum is independent of how the
// sequences are split across ranks, threads or GPUs (engine/calib/hessian.h has the whole
// contract). This header holds the pieces both the CPU path (engine/calib) and the CUDA path
// (kernels/hessian_cuda.cu) must agree on bit for bit:
//
//  * q(p) = round(p · 2^F), F = kHessianFracBits = 50, to nearest with ties to even, for one
//    product entry p (an fp32 value, widened to double exactly); |p · 2^F| ≥ 2^123 or a
//    non-finite p is an overflow;
//  * the stored sum T(i, j) = Σ_seq 2·q(P_ij) on the upper triangle, packed row-major: entry
//    (i, j), i ≤ j, at HessianPackedIndex(n, i, j);
//  * the reduction format: each 128-bit value as 4 base-2^32 digits in int64 limbs (digits 0..2
//    in [0, 2^32), digit 3 signed), so summing the limbs of fewer than 2^31 ranks (MPI or NCCL
//    int64 sums) cannot overflow, and CombineFixedDigits propagates the carries.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QCAL_FIXED_HD __host__ __device__ inline
#else
#define QCAL_FIXED_HD inline
#endif

// Host code compiled by the C++ compiler on x86-64 rounds with one instruction (cvtsd2si, which
// rounds to nearest even under the default MXCSR): the same integers as the portable steps.
#if defined(__x86_64__) && !defined(__CUDACC__)
#define QCAL_FIXED_X86 1
#include <immintrin.h>
#else
#define QCAL_FIXED_X86 0
#endif

namespace qcal::kernels {

inline constexpr int kHessianFracBits = 50;
using Fixed128 = __int128;

QCAL_FIXED_HD int64_t HessianPackedIndex(int64_t n, int64_t i, int64_t j) {
  return i * n - i * (i - 1) / 2 + (j - i);
}
QCAL_FIXED_HD int64_t HessianPackedSize(int64_t n) { return n * (n + 1) / 2; }

// round(v · 2^50) into *out (ties to even); false when |v · 2^50| ≥ 2^123 or v is not finite.
// Multiplying by a power of two is exact, so the only rounding is the final one; every step
// below is exact in IEEE double, so host and device give the same integer. What the device runs
// (and host code without the x86 instruction); ToFixed128 below is the one to call.
QCAL_FIXED_HD bool ToFixed128Portable(double v, Fixed128* out) {
  const double d = v * 0x1p50;
  const double ad = d < 0 ? -d : d;
  if (!(ad < 0x1p123)) return false;  // also NaN
  if (ad < 0x1p53) {
    // trunc and the fraction are exact below 2^53; then round half to even.
    int64_t q = static_cast<int64_t>(d);
    const double frac = d - static_cast<double>(q);
    const double af = frac < 0 ? -frac : frac;
    if (af > 0.5 || (af == 0.5 && (q & 1) != 0)) q += frac < 0 ? -1 : 1;
    *out = q;
    return true;
  }
  if (ad < 0x1p62) {
    *out = static_cast<int64_t>(d);  // an integer: converted exactly
    return true;
  }
  // |d| ≥ 2^62, an integer: |d| = hi·2^64 + lo with hi = trunc(|d|·2^-64) and lo < 2^64 exact
  // (below 2^64 lo = |d|; above, |d| is a multiple of 2^12 and so is lo, which needs ≤ 52 bits).
  const double hi = static_cast<double>(static_cast<uint64_t>(ad * 0x1p-64));
  const double lo = ad - hi * 0x1p64;
  const unsigned __int128 u =
      (static_cast<unsigned __int128>(static_cast<uint64_t>(hi)) << 64) +
      static_cast<unsigned __int128>(static_cast<uint64_t>(lo));
  *out = d < 0 ? -static_cast<Fixed128>(u) : static_cast<Fixed128>(u);
  return true;
}

// q(v) = round(v · 2^50), ties to even: the one rounding of every Hessian entry, on the host
// (CPU paths) and on the device. Same contract and integers as ToFixed128Portable (tested).
QCAL_FIXED_HD bool ToFixed128(double v, Fixed128* out) {
#if QCAL_FIXED_X86
  const double d = v * 0x1p50;
  const double ad = d < 0 ? -d : d;
  if (ad < 0x1p62) {
    *out = _mm_cvtsd_si64(_mm_set_sd(d));
    return true;
  }
  if (!(ad < 0x1p123)) return false;  // also NaN
  *out = static_cast<Fixed128>(d);    // |d| ≥ 2^62 > 2^53: already an integer, converted exactly
  return true;
#else
  return ToFixed128Portable(v, out);
#endif
}

// *acc += v; false on signed 128-bit overflow (then *acc is unspecified).
QCAL_FIXED_HD bool AddFixed128(Fixed128* acc, Fixed128 v) {
#if !defined(__CUDA_ARCH__)
  return !__builtin_add_overflow(*acc, v, acc);
#else
  const unsigned __int128 r =
      static_cast<unsigned __int128>(*acc) + static_cast<unsigned __int128>(v);
  const Fixed128 s = static_cast<Fixed128>(r);
  const bool overflow = ((*acc < 0) == (v < 0)) && ((s < 0) != (v < 0));
  *acc = s;
  return !overflow;
#endif
}

// One value's 4 reduction digits (see the header comment).
QCAL_FIXED_HD void SplitFixedDigits(Fixed128 value, int64_t* limbs) {
  const unsigned __int128 u = static_cast<unsigned __int128>(value);
  limbs[0] = static_cast<int64_t>(static_cast<uint64_t>(u) & 0xffffffffu);
  limbs[1] = static_cast<int64_t>(static_cast<uint64_t>(u >> 32) & 0xffffffffu);
  limbs[2] = static_cast<int64_t>(static_cast<uint64_t>(u >> 64) & 0xffffffffu);
  limbs[3] = static_cast<int64_t>(value >> 96);  // arithmetic: in [-2^31, 2^31)
}

// The value of 4 summed digits; false when it leaves 128 bits or the digits are malformed.
QCAL_FIXED_HD bool CombineFixedDigits(const int64_t* s, Fixed128* value) {
  // Digits 0..2 are sums of values in [0, 2^32): non-negative, so >> is a floor division.
  int64_t t = s[0];
  const uint64_t d0 = static_cast<uint64_t>(t) & 0xffffffffu;
  t = s[1] + (t >> 32);
  const uint64_t d1 = static_cast<uint64_t>(t) & 0xffffffffu;
  t = s[2] + (t >> 32);
  const uint64_t d2 = static_cast<uint64_t>(t) & 0xffffffffu;
  const int64_t top = s[3] + (t >> 32);
  if (s[0] < 0 || s[1] < 0 || s[2] < 0 || top < -(int64_t{1} << 31) ||
      top >= (int64_t{1} << 31)) {
    return false;
  }
  const unsigned __int128 u = (static_cast<unsigned __int128>(static_cast<uint64_t>(top)) << 96) |
                              (static_cast<unsigned __int128>(d2) << 64) |
                              (static_cast<unsigned __int128>(d1) << 32) | d0;
  *value = static_cast<Fixed128>(u);
  return true;
}

}  // namespace qcal::kernels
