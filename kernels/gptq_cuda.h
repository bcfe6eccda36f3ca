// GPTQ on a CUDA device: the GPU counterpart of kernels/rounding.h's Gptq, same contract and
// result (act order, dead columns, damping, per-tensor / per-channel / per-group grids with clip
// search, refinement sweeps), same algorithm step for step.
//   * Host: PrepareGptq (validation, act order, damping, the result skeleton), the per-group
//     grid parameters (ComputeScalarQuantParams on the running weights of each group, copied
//     back from the device at the group's start), FinishGptqCodes, and refinement sweeps.
//   * Device: R = InverseCholeskyUpperCuda(H) (fp64, cuSOLVER); the sweep in lazy blocks: a
//     row-parallel kernel rounds each column, scales its error by 1/R_ii and applies the rank-1
//     updates inside the block, and one fp64 cuBLAS GEMM per block applies the rest.
// fp64 throughout; sums run in a different order than OpenBLAS's, so a weight within ~1e-15 of
// a grid decision boundary may round the other way (tests: ≥ 99.9% of codes equal, proxy loss
// within 0.1%).
#pragma once

#include <cstdint>

#include "common/status.h"
#include "kernels/rounding.h"

namespace qcal::kernels {

struct GptqCudaTimes {
  double factor_ms = 0;
  double sweep_ms = 0;  // including the per-group parameter round trips
};

StatusOr<ScalarRoundingResult> GptqCuda(const double* w, int64_t rows, int64_t cols,
                                        const double* h, const ScalarRoundingConfig& config,
                                        void* stream, GptqCudaTimes* times = nullptr);

}  // namespace qcal::kernels
