// E8P encoding on the device: the tables in constant memory and the per-vector encoder, shared
// by the CUDA kernels that round to E8P (kernels/e8p_cuda.cu, kernels/ldlq_cuda.cu). Mirrors
// E8pCodebook::EncodeOne, ScanShift, ScoreSourceRows and BestNegationMask (kernels/e8p.cc)
// operation for operation. Everything here has internal linkage: each .cu that includes it has
// its own constant-memory copy of the tables and uploads it once per device (UploadE8pTables).
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <mutex>

#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/e8p.h"

namespace qcal::kernels {
namespace {

constexpr int kRows = kE8pSourceRows;

struct alignas(16) E8pTables {
  double s[8][kRows];   // S[k][j] at s[j][k] (|coordinates|: 1/2, 3/2, 5/2)
  double norm2[kRows];  // ||S[k]||^2
  double odd[kRows];    // sum(S[k]) mod 2: 0.0 or 1.0
  double even[kRows];   // 1 - odd
  int8_t src2[kRows][8];  // 2·S[k][j]
  int16_t row_of_abs[6561];  // source row of each |p| ∈ {1/2, 3/2, 5/2}^8 (base-3 index), or -1
};

__constant__ E8pTables c_tables;

// The device's copy of the tables, uploaded once per device (the tables never change).
Status UploadE8pTables(cudaStream_t stream) {
  static std::mutex mu;
  static bool uploaded[64] = {};
  int device = 0;
  QCAL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < 64 && uploaded[device]) return absl::OkStatus();
  static const E8pTables tables = [] {
    E8pTables t{};
    for (int16_t& r : t.row_of_abs) r = -1;
    const E8pSourceTable& src = E8pSource();
    for (int k = 0; k < kRows; ++k) {
      // The same values, computed the same way, as E8pCodebook's constructor.
      double norm2 = 0;
      int sum2 = 0;
      for (int j = 0; j < 8; ++j) {
        t.s[j][k] = 0.5 * src[k][j];
        norm2 += t.s[j][k] * t.s[j][k];
        sum2 += src[k][j];
        t.src2[k][j] = src[k][j];
      }
      t.norm2[k] = norm2;
      int index = 0;
      for (int j = 0; j < 8; ++j) index = 3 * index + (src[k][j] - 1) / 2;  // 1, 3, 5 -> 0, 1, 2
      t.row_of_abs[index] = static_cast<int16_t>(k);
      // sum(S[k]) = sum2 / 2 is an integer (eight odd halves sum to an integer).
      t.odd[k] = ((sum2 / 2) % 2 != 0) ? 1.0 : 0.0;
      t.even[k] = 1.0 - t.odd[k];
    }
    return t;
  }();
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyToSymbolAsync(c_tables, &tables, sizeof(tables), 0, cudaMemcpyHostToDevice,
                              stream));
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (device >= 0 && device < 64) uploaded[device] = true;
  return absl::OkStatus();
}

__device__ __forceinline__ double Min2(double a, double b) { return b < a ? b : a; }

// score(k) exactly as ScoreSourceRows computes it (no contraction: explicit roundings).
__device__ __forceinline__ double Score(const E8pTables& T, int k, const double* a, double base,
                                         double wrong_k) {
  const double p0 = __dmul_rn(T.s[0][k], a[0]), p1 = __dmul_rn(T.s[1][k], a[1]);
  const double p2 = __dmul_rn(T.s[2][k], a[2]), p3 = __dmul_rn(T.s[3][k], a[3]);
  const double p4 = __dmul_rn(T.s[4][k], a[4]), p5 = __dmul_rn(T.s[5][k], a[5]);
  const double p6 = __dmul_rn(T.s[6][k], a[6]), p7 = __dmul_rn(T.s[7][k], a[7]);
  double dot = __dadd_rn(p0, p1);
  dot = __dadd_rn(dot, p2);
  dot = __dadd_rn(dot, p3);
  dot = __dadd_rn(dot, p4);
  dot = __dadd_rn(dot, p5);
  dot = __dadd_rn(dot, p6);
  dot = __dadd_rn(dot, p7);
  const double m01 = Min2(p0, p1), m23 = Min2(p2, p3), m45 = Min2(p4, p5), m67 = Min2(p6, p7);
  const double least = Min2(Min2(m01, m23), Min2(m45, m67));
  // base + norm2[k] - 2·dot + 4·least·wrong[k], left to right; 2·dot and 4·least·wrong are exact.
  double score = __dadd_rn(base, T.norm2[k]);
  score = __dsub_rn(score, __dmul_rn(2.0, dot));
  return __dadd_rn(score, __dmul_rn(__dmul_rn(4.0, least), wrong_k));
}

// BestNegationMask (kernels/e8p.cc), for row k.
__device__ __forceinline__ unsigned BestNegationMask(const E8pTables& T, const double* y, int k,
                                                     bool source_odd) {
  unsigned neg = 0, zero = 0;
  for (int j = 0; j < 8; ++j) {
    if (y[j] < 0) {
      neg |= 1u << j;
    } else if (y[j] == 0) {
      zero |= 1u << j;
    }
  }
  const bool parity = (__popc(neg) & 1) != 0;
  if (parity == source_odd) return neg;
  if (zero != 0) {
    if (zero & 1u) return neg | 1u;
    return neg | (1u << (31 - __clz(zero)));
  }
  double cost[8];
  double least = __longlong_as_double(0x7ff0000000000000ll);  // +inf
  for (int j = 0; j < 8; ++j) {
    cost[j] = __dmul_rn(T.s[j][k], fabs(y[j]));
    least = cost[j] < least ? cost[j] : least;  // std::min(least, cost)
  }
  unsigned tied = 0;
  for (int j = 0; j < 8; ++j) {
    if (cost[j] == least) tied |= 1u << j;
  }
  if (tied == 0) tied = 1u;
  const unsigned tied_negated = tied & neg & 0xFEu;
  if (tied_negated != 0) return neg ^ (1u << (__ffs(tied_negated) - 1));
  if (tied & 1u) return neg ^ 1u;
  return neg ^ (1u << (31 - __clz(tied)));
}

__device__ __forceinline__ uint32_t CodeFromMask(int k, unsigned neg, bool plus) {
  unsigned signs7 = 0;
  for (int j = 1; j < 8; ++j) signs7 |= ((neg >> j) & 1u) << (7 - j);
  return E8pCode::Make(static_cast<unsigned>(k), signs7, plus).bits;
}

// ScanShift: the minimal score over the shift's points and, in *code, the smallest code there.
__device__ __forceinline__ double ScanShift(const E8pTables& T, const float* x, bool plus,
                                            uint32_t* code) {
  const double shift = plus ? 0.25 : -0.25;
  double y[8], a[8];
  double base = 0;
  unsigned neg_parity = 0;
  for (int j = 0; j < 8; ++j) {
    y[j] = __dsub_rn(static_cast<double>(x[j]), shift);
    a[j] = fabs(y[j]);
    base = __dadd_rn(base, __dmul_rn(y[j], y[j]));
    neg_parity ^= y[j] < 0 ? 1u : 0u;
  }
  // wrong(k) = 1 when sign(y) has the wrong parity for row k (read from constant memory directly,
  // not through a generic pointer, so the loads stay on the constant cache).
  auto wrong = [&](int k) { return neg_parity ? T.even[k] : T.odd[k]; };
  double m = Score(T, 0, a, base, wrong(0));
  for (int k = 1; k < kRows; ++k) m = Min2(m, Score(T, k, a, base, wrong(k)));
  *code = UINT_MAX;
  for (int k = 0; k < kRows; ++k) {
    if (Score(T, k, a, base, wrong(k)) != m) continue;
    const uint32_t c = CodeFromMask(k, BestNegationMask(T, y, k, T.odd[k] != 0), plus);
    *code = c < *code ? c : *code;
  }
  return m;
}

// NearestCosetPoint (kernels/e8p.cc): the nearest point of D̂8 + shift, its distance, the gap to
// the second nearest, whether it is unique, its source row (or -1) and negation mask.
struct CosetPoint {
  double dist;
  double gap;
  bool unique;
  int row;
  unsigned neg;
};

__device__ __forceinline__ CosetPoint NearestCosetPoint(const E8pTables& T, const float* x,
                                                        double shift) {
  double y[8], p[8], c[8];
  bool finite = true, tie = false;
  double sum = 0.0;
  for (int j = 0; j < 8; ++j) {
    y[j] = __dsub_rn(static_cast<double>(x[j]), shift);
    finite &= fabs(y[j]) < 1e6;
    p[j] = __dadd_rn(floor(y[j]), 0.5);
    const double d = __dsub_rn(y[j], p[j]);
    tie |= d == -0.5;
    c[j] = __dsub_rn(1.0, __dmul_rn(2.0, fabs(d)));
    sum = __dadd_rn(sum, p[j]);
  }
  const double inf = __longlong_as_double(0x7ff0000000000000ll);
  if (!finite) return CosetPoint{inf, 0.0, false, -1, 0};
  int j1 = 0;
  double c1 = c[0];
  for (int j = 1; j < 8; ++j) {
    const bool less = c[j] < c1;
    c1 = less ? c[j] : c1;
    j1 = less ? j : j1;
  }
  double c2 = 2.0;
  for (int j = 0; j < 8; ++j) c2 = (j != j1 && c[j] < c2) ? c[j] : c2;
  const bool odd = (static_cast<int64_t>(sum) & 1) != 0;
  if (odd) {
    const double d = __dsub_rn(y[j1], p[j1]);
    tie |= d == 0.0;
    p[j1] = __dadd_rn(p[j1], d >= 0.0 ? 1.0 : -1.0);
  }
  CosetPoint cp;
  cp.gap = odd ? __dsub_rn(c2, c1) : __dadd_rn(c1, c2);
  double dist = 0.0;
  bool inside = true;
  int index = 0;
  unsigned neg = 0;
  for (int j = 0; j < 8; ++j) {
    const double e = __dsub_rn(y[j], p[j]);
    dist = __dadd_rn(dist, __dmul_rn(e, e));
    const double a = fabs(p[j]);
    inside &= a <= 2.5;
    index = 3 * index + static_cast<int>(__dsub_rn(a < 2.5 ? a : 2.5, 0.5));
    neg |= (p[j] < 0.0 ? 1u : 0u) << j;
  }
  cp.dist = dist;
  cp.unique = !tie;
  cp.row = inside ? T.row_of_abs[index] : -1;
  cp.neg = neg;
  return cp;
}

// EncodeOneByScan: both shifts scanned exactly.
__device__ __forceinline__ uint32_t EncodeByScan(const E8pTables& T, const float* xv) {
  double best = __longlong_as_double(0x7ff0000000000000ll);
  uint32_t best_code = UINT_MAX;
  for (int plus = 0; plus < 2; ++plus) {
    uint32_t code;
    const double m = ScanShift(T, xv, plus != 0, &code);
    if (!(m <= best)) continue;  // also skips NaN
    if (m < best) {
      best = m;
      best_code = UINT_MAX;
    }
    best_code = code < best_code ? code : best_code;
  }
  return best_code == UINT_MAX ? 0u : best_code;
}

// EncodeOne: the coset decoder where it decides by a clear margin, else the exact scan (the
// CPU's decision rule, so the same codes; both equal the scan's).
__device__ __forceinline__ uint32_t EncodeOne(const E8pTables& T, const float* xv) {
  double dist[2], gap[2];
  bool unique[2];
  int row[2];
  unsigned neg[2];
  for (int plus = 0; plus < 2; ++plus) {
    const CosetPoint cp = NearestCosetPoint(T, xv, plus ? 0.25 : -0.25);
    dist[plus] = cp.dist;
    gap[plus] = cp.gap;
    unique[plus] = cp.unique;
    row[plus] = cp.row;
    neg[plus] = cp.neg;
  }
  const int a = dist[0] <= dist[1] ? 0 : 1, b = 1 - a;
  const double margin = 1e-9 * (1.0 + (dist[a] < dist[b] ? dist[a] : dist[b]));
  auto clear = [&](int s) { return unique[s] && row[s] >= 0 && gap[s] > margin; };
  if (clear(a) && dist[a] < dist[b] - margin) return CodeFromMask(row[a], neg[a], a != 0);
  if (clear(b)) {
    uint32_t code_a;
    const double m_a = ScanShift(T, xv, a != 0, &code_a);
    if (dist[b] < m_a - margin) return CodeFromMask(row[b], neg[b], b != 0);
    if (m_a < dist[b] - margin) return code_a;
  }
  return EncodeByScan(T, xv);
}

// Copies the tables from constant memory into shared memory (every thread of the block takes
// part; ends with __syncthreads). The scan reads the same entry in every lane, which shared
// memory broadcasts at full rate; constant memory serializes the lanes' divergent reads.
__device__ __forceinline__ void LoadE8pTables(E8pTables* smem) {
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&c_tables);
  uint32_t* dst = reinterpret_cast<uint32_t*>(smem);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(E8pTables) / 4); i += blockDim.x) dst[i] = src[i];
  __syncthreads();
}

// The decoded point of a code (DecodeE8pWithSource's floats).
__device__ __forceinline__ void DecodeE8p(const E8pTables& T, uint32_t code, float* out) {
  const E8pCode c{static_cast<uint16_t>(code)};
  const int k = static_cast<int>(c.source_index());
  const bool odd = T.odd[k] != 0;
  const float shift = c.plus_quarter() ? 0.25f : -0.25f;
  for (int j = 0; j < 8; ++j) {
    const float magnitude = __fmul_rn(0.5f, static_cast<float>(T.src2[k][j]));
    out[j] = __fadd_rn(c.Negates(j, odd) ? -magnitude : magnitude, shift);
  }
}

}  // namespace
}  // namespace qcal::kernels
