// Exact fixed-point Hessian accumulation on a CUDA device (the GPU counterpart of
// engine/calib/hessian.h; the shared integer format is kernels/fixed_point.h).
//
// For each sequence X_s [t, n] on the device, P = X_sᵀ X_s is computed by cuBLAS on tensor cores
// (bf16 inputs: every product of two bf16 values is exact in fp32, sums in fp32) or in fp32
// (CUBLAS_PEDANTIC_MATH: no TF32), one triangle only: column strips [j0, j0 + w) against rows
// [0, j0 + w), several sequences per strided-batched GEMM. A kernel then rounds each upper-
// triangle entry to q(P_ij) = round(P_ij · 2^50) and adds 2·Σ_s q to the device's packed 128-bit
// sums T. Integer sums are exact, so T does not depend on the grouping, the strip width, the
// number of GPUs or ranks, or the order of reduction: the same bits as the CPU reference
// (kernels/hessian_fixed.h) whenever the fp32 products are the same.
//
// Memory: 16·n(n+1)/2 bytes for T (n = 8192: 0.54 GB; 28672: 6.6 GB) plus the product buffer
// (group·(j0 + w)·w·4 bytes, at most `workspace_bytes`). No CUDA types in this header: streams
// are void* (a cudaStream_t).
//
// Thread-safety: one object per stream; not thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/fixed_point.h"

namespace qcal::kernels {

enum class HessianInputType { kBf16, kFloat32 };

struct HessianCudaOptions {
  int64_t strip = 1024;     // w: columns per strip
  // Sequences per batched GEMM (1..64): the packed 128-bit sums are read and written once per
  // group, so larger groups cut that traffic (the rounding kernel is memory-bound).
  int64_t max_group = 16;
  int64_t workspace_bytes = int64_t{2} << 30;  // cap on the product buffer (group·n·strip·4)
};

class HessianAccumulatorCuda {
 public:
  // Allocates T (zeroed) on the current device. ResourceExhausted when it does not fit.
  static StatusOr<HessianAccumulatorCuda> Create(int64_t n, void* stream,
                                                 HessianCudaOptions options = {});
  HessianAccumulatorCuda(HessianAccumulatorCuda&&) noexcept;
  HessianAccumulatorCuda& operator=(HessianAccumulatorCuda&&) noexcept;
  HessianAccumulatorCuda(const HessianAccumulatorCuda&) = delete;
  HessianAccumulatorCuda& operator=(const HessianAccumulatorCuda&) = delete;
  ~HessianAccumulatorCuda();

  // x: device pointer to [seqs, t, n] row-major values of `type` (bf16 as raw 16-bit words).
  // Enqueued on the stream; errors found on the device (a non-finite product, an overflow) are
  // reported by the next Sync(), naming the first such entry, and make the accumulator unusable.
  Status Add(const void* x, HessianInputType type, int64_t seqs, int64_t t);
  // Waits for the stream and reports any device-side error.
  Status Sync();

  int64_t dim() const { return n_; }
  int64_t count() const { return count_; }  // rows (tokens) added
  // T, downloaded (synchronizes): HessianPackedSize(n) values, the layout of fixed_point.h.
  StatusOr<std::vector<Fixed128>> Download();
  // T as reduction digits in a device buffer of 4·HessianPackedSize(n) int64 (for an NCCL
  // int64 sum across ranks), and back from summed digits (OutOfRange when a value leaves 128
  // bits). Enqueued on the stream.
  Status ToDigits(int64_t* device_limbs) const;
  Status FromDigits(const int64_t* device_limbs, int64_t count);
  // The same for the packed values [first, first + size) only (4·size int64 digits), so a
  // reduction can run in pieces through a small buffer; FromDigits' errors name the packed index.
  Status ToDigits(int64_t first, int64_t size, int64_t* device_limbs) const;
  Status FromDigits(int64_t first, int64_t size, const int64_t* device_limbs);
  // Sets the row count (after the sums were replaced by a reduction over ranks).
  void set_count(int64_t count) { count_ = count; }
  // The device pointer to T (HessianPackedSize(n) Fixed128).
  const Fixed128* device_packed() const { return packed_; }

 private:
  HessianAccumulatorCuda() = default;
  void Release();

  int64_t n_ = 0;
  int64_t count_ = 0;
  void* stream_ = nullptr;
  HessianCudaOptions options_;
  Fixed128* packed_ = nullptr;
  float* products_ = nullptr;         // the product buffer
  int64_t products_capacity_ = 0;     // floats
  unsigned long long* error_ = nullptr;  // device: first failing packed index + 1, or 0
  void* cublas_ = nullptr;            // cublasHandle_t
};

}  // namespace qcal::kernels
