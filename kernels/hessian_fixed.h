// The CPU reference of the exact fixed-point Hessian sums (kernels/fixed_point.h), in plain
// loops: for each sequence s, P = X_sᵀ X_s in fp32 (one cblas_sgemm), then T(i, j) += 2·q(P_ij)
// for i ≤ j. worker/calib/hessian.h is the fast CPU path (tiled, grouped, vectorized rounding)
// and kernels/hessian_cuda.h the GPU path; both are tested against this one. The integers agree
// bit for bit whenever the fp32 products agree (e.g. inputs whose products are exact in fp32).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/fixed_point.h"

namespace qcal::kernels {

// x: [seqs, t, n] row-major fp32. packed: HessianPackedSize(n) values, added to. OutOfRange on
// overflow or a non-finite product (naming the entry); packed is then unspecified.
Status AccumulateHessianFixedReference(const float* x, int64_t seqs, int64_t t, int64_t n,
                                       Fixed128* packed);

// The fp64 mean (S + Sᵀ)/(2·count) as a dense [n, n] row-major matrix from packed sums T.
std::vector<double> HessianMeanFromFixed(const Fixed128* packed, int64_t n, int64_t count);

}  // namespace qcal::kernels
