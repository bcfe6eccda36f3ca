// The exact fixed-point Hessian sums on the CPU (kernels/fixed_point.h has the format):
//
//  * AccumulateHessianFixedReference: plain loops, for each sequence s, P = X_sᵀ X_s in fp32
//    (one cblas_sgemm), then T(i, j) += 2·q(P_ij) for i ≤ j;
//  * AccumulateHessianFixed: the fast path engine/calib's HessianAccumulator runs (tiled, grouped,
//    vectorized rounding, parallel over `threads`);
//  * kernels/hessian_cuda.h: the GPU path.
// The fast paths are tested against the reference: the integers agree bit for bit whenever the
// fp32 products agree (e.g. inputs whose products are exact in fp32).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/fixed_point.h"

namespace qcal::kernels {

// fp32 products are computed in row strips of this many rows (each entry by the same GEMM shape
// whatever the threads, the grouping or the band that holds it).
inline constexpr int64_t kHessianStripRows = 512;

// Rows [begin, end) of a Hessian's packed upper triangle.
struct HessianRows {
  int64_t begin = 0, end = 0;
  bool operator==(const HessianRows& o) const { return begin == o.begin && end == o.end; }
};

// T(i, j) += Σ_s 2·q(P_s[i][j]) for i ≤ j and i in `rows`, P_s = X_sᵀX_s for each sequence X_s
// [t, n] of x ([seqs, t, n] row-major fp32). `packed` holds the values of rows [rows.begin,
// rows.end) from HessianPackedIndex(n, rows.begin, rows.begin) on (the whole triangle when rows
// is [0, n)). Row strips of `strip_rows` rows (kHessianStripRows) cut into 2048-wide pieces, one
// single-threaded sgemm per piece and sequence, up to 8 sequences' products rounded side by side
// and added once per group; `threads` work items at a time. Every entry comes from the same GEMM
// shape whatever `threads` or the band, and integer sums are exact, so the bits depend on neither.
// False on overflow or a non-finite product (packed is then unspecified).
bool AccumulateHessianFixed(const float* x, int64_t seqs, int64_t t, int64_t n, HessianRows rows,
                            int64_t strip_rows, int threads, Fixed128* packed);

// T(i, j) += q(P[i][j]) + q(P[j][i]) for i ≤ j, P [n, n] row-major fp64 (a Hessian given as a sum,
// or fp64 inputs' product); `packed` the whole triangle. False on overflow or a non-finite entry.
bool AccumulateSymmetricFixed(const double* p, int64_t n, int threads, Fixed128* packed);

// x: [seqs, t, n] row-major fp32. packed: HessianPackedSize(n) values, added to. OutOfRange on
// overflow or a non-finite product (naming the entry); packed is then unspecified.
Status AccumulateHessianFixedReference(const float* x, int64_t seqs, int64_t t, int64_t n,
                                       Fixed128* packed);

// The fp64 mean (S + Sᵀ)/(2·count) as a dense [n, n] row-major matrix from packed sums T.
std::vector<double> HessianMeanFromFixed(const Fixed128* packed, int64_t n, int64_t count);

}  // namespace qcal::kernels
