// The QuIP# rounding of one linear layer, free of LibTorch: pad, IP-RHT (or RFFT), per-row or
// per-matrix scale, BlockLDLQ with a lattice codebook, and the proxy loss in the original space.
// methods/quip/quip_method.cc wraps the result into a QuipLinear; the 70B-shaped block
// benchmark (bench/quip_block_bench.cc) calls it directly so it runs where LibTorch is absent.
//
// Memory (n = in_pad, m = out_pad): besides the caller's W and H it holds one n×n working
// Hessian, which is rotated in place and then factored in place (kernels::BlockLdlqConsuming-
// Hessian), and about five m×n buffers (the rotated W, BlockLDLQ's target and error, Ŵ and its
// copy in the original space). For Llama-2-70B's down_proj (n = 28672, m = 8192) that is
// 6.6 GB + 5 × 1.9 GB on top of the caller's H.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "kernels/gpu_backend.h"
#include "kernels/rounding.h"
#include "methods/quip/quip_linear_data.h"

namespace qcal::methods::quip {

struct QuipRoundingOptions {
  std::string codebook = "e8p";  // kernels::MakeCodebook name
  bool incoherence = true;       // IP-RHT / IP-RFFT with the seeds below; false: no transforms
  uint64_t seed_u = 0;           // output side U (out_pad)
  uint64_t seed_v = 0;           // input side V (in_pad)
  double damp = 0.01;            // BlockLDLQ damping (fraction of the mean diagonal)
  bool per_row_scale = true;     // true: one scale per row of the rotated W; false: one per matrix
  bool choose_scale = false;     // round with both and keep the lower proxy loss (per_row ignored)
  int num_threads = 0;           // codebook search threads (0: all cores)
  int refine_sweeps = 0;         // refinement sweeps after BlockLDLQ (kernels::RefineRounding)
  // The rank's GPU backend (null: the CPU): E8P BlockLDLQ runs there (kernels::RunBlockLdlq).
  kernels::GpuBackend* gpu = nullptr;
  // Optional: BlockLDLQ's progress (kernels::VectorRoundingConfig::progress; with choose_scale
  // it counts up once per rounding).
  std::function<void(int64_t rows_done, int64_t rows)> progress;
};

struct QuipRounding {
  QuipLinearData data;
  double proxy_loss = 0;  // tr((Ŵ − W) H (Ŵ − W)ᵀ), original space, [out, in]
  double relative = 0;    // proxy_loss / tr(W H Wᵀ) (NaN when tr(W H Wᵀ) = 0)
  double code_bits = 0;   // code bits per original weight (padding included)
  kernels::RefineStats refine;  // what the sweeps did (in the rotated, scaled space)
  // Seconds: the incoherence transforms (forward and back), BlockLDLQ's (factor, round,
  // refine), the proxy loss.
  double transform_seconds = 0;
  kernels::RoundingTimes times;
  double proxy_seconds = 0;
};

// w: [out, in] row-major; h: [in, in] row-major (both fp64, finite). in_pad is the smallest
// multiple of the codebook dimension (with a Hadamard or RFFT size when incoherence is on); the
// padded inputs get H's mean diagonal so the padded H stays positive definite (their weights
// multiply zeros, so any value is exact). Errors: InvalidArgument for bad sizes, non-finite
// values, an unknown codebook; FailedPrecondition when H is not positive definite after damping.
StatusOr<QuipRounding> RoundQuipLinear(const double* w, int64_t out, int64_t in, const double* h,
                                       const QuipRoundingOptions& options);

// Smallest size >= n and a multiple of `multiple` that has an orthogonal transform
// (kernels::PlanHadamard not kNone).
int64_t QuipTransformSize(int64_t n, int64_t multiple);

}  // namespace qcal::methods::quip
