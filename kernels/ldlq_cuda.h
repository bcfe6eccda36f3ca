// BlockLDLQ with the E8P codebook on a CUDA device (QuIP# §4.1; the GPU counterpart of
// kernels/rounding.h's BlockLdlq for codebook "e8p"), and the g-block LDL it needs.
//
// The same algorithm as the CPU sweep (BlockLdlqSweep), step for step: dead input columns (zero
// Hessian diagonal) get diagonal 1 and zero weights, H is damped by δ·mean(diag H) (the same sum
// in the same order), factored H = Lᵀ D L with 8-blocks (BlockLdlCuda below, fp64 cuSOLVER), and
// the targets X (fp32) are rounded 8 columns at a time front to back: the feedback from earlier
// lazy blocks with one fp32 cuBLAS GEMM per lazy block (no TF32, as the CPU's sgemm), inside a
// lazy block by a row-parallel kernel that also encodes every 8-vector with the device E8P
// encoder (the CPU's EncodeOne, bit for bit). Ŵ is decoded from the codes. Float sums run in a
// different order than OpenBLAS's, so a target within ~1e-7 of a decision boundary may round the
// other way: results match the CPU within that (tests: proxy loss within 0.5%, ≥ 99% of codes).
//
// Memory on the device: H / L (n² fp64), L in fp32 (n² / 2 fp64-equivalents), X and W
// (m·n fp32 each), the codes. Host memory: a float copy of W and the results.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "kernels/rounding.h"

namespace qcal::kernels {

// In place on a device matrix h [n, n] row-major, symmetric positive definite: h becomes L of
// H = Lᵀ D L with L unit block lower triangular in blocks of g (LdlForm::kLtDL of
// BlockLdlDecompose; g must divide n). D is not formed. FailedPrecondition (naming the pivot)
// when H is not positive definite. Synchronizes `stream`.
Status BlockLdlCuda(double* h, int64_t n, int64_t g, void* stream);

// Wall times of the device phases (ms), for benchmarks.
struct BlockLdlqCudaTimes {
  double upload_ms = 0;  // H, W to the device (and the damping)
  double factor_ms = 0;  // BlockLdlCuda
  double sweep_ms = 0;   // the rounding sweep
  double download_ms = 0;
};

// BlockLdlq(w, m, n, h, E8pCodebook(), config) on the current device: the same errors (shape,
// non-finite, not positive definite), the same result layout. config.refine_sweeps must be 0
// and config.num_threads is ignored. w and h are host arrays.
StatusOr<VectorRoundingResult> BlockLdlqE8pCuda(const double* w, int64_t m, int64_t n,
                                                const double* h,
                                                const VectorRoundingConfig& config, void* stream,
                                                BlockLdlqCudaTimes* times = nullptr);

}  // namespace qcal::kernels
