// The fixed orthogonal transforms of incoherence processing as differentiable LibTorch ops.
//
// kernels/hadamard.h and kernels/incoherence.h define the transforms on raw buffers (the CPU
// reference). QuIP#'s inference and fine-tuning (Algorithm 2, §5) need the same maps inside a
// LibTorch graph, so that gradients flow through them to the sign vectors and to the inputs.
// This file provides them along the LAST dimension of a floating tensor x [..., d]:
//
//   * Hadamard sizes (kPow2, kPow2TimesM): T = H_d / sqrt(d) with H_d = H_{2^k} ⊗ H_m exactly as
//     hadamard.h defines it (entry (a·m+b, a'·m+b') = H_{2^k}[a][a']·H_m[b][b'], H_{2^k} the
//     Sylvester matrix). The signs of a RandomizedTransform are NOT part of T: incoherence.h's
//     U = T·diag(s), and quantized layers keep s as a separate (trainable) vector.
//   * kRfft sizes: T = F·diag(phases) on d/2 complex numbers z_k = x[2k] + i·x[2k+1], F the
//     unitary DFT (F[j][k] = e^{-2πi jk/(d/2)} / sqrt(d/2)); the phases ARE part of T.
//   * Identity (incoherence disabled): T = I.
//
// Forward(x) maps every vector x_b ← T x_b; Inverse(x) maps x_b ← Tᵀ x_b (= T⁻¹ x_b). Equal to
// kernels::ApplyTransform with all signs +1 (RandomizedFftTransform for kRfft) to fp32 rounding
// for float tensors and to ~1e-15 for double tensors (tests/methods/quantized_linear_test.cc).
//
// Implementation: the 2^k factor is split into Sylvester blocks of at most 64 (H_{2^k} =
// H_{2^a} ⊗ H_{2^b} ⊗ …, each block scaled by 1/sqrt(its order)), and every Kronecker factor (the
// blocks and H_m) is applied with one dense product along its axis: a matmul for the innermost,
// a bmm against the factor expanded over the batch (stride 0) for the others, so no transposes
// are materialized. On one CPU thread this is ~4x the time of kernels' in-place FWHT for 4096
// (whose butterflies need no allocation) but faster than its dense H_172 pass for 11008; LibTorch
// butterflies (log2(d) stack/add passes) measured no faster than the matmuls, and the matmuls
// keep the autograd graph to a handful of nodes and map well to GPUs. RFFT uses at::fft_fft /
// fft_ifft with norm "ortho" on at::view_as_complex. All ops are differentiable and run on any
// device; the constants are moved to x's device and dtype (cached for float32 and float64).
//
// Supported dtypes: float32 and float64. Thread-safety: immutable after construction; Forward
// and Inverse may be called concurrently.
#pragma once

#include <complex>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "kernels/hadamard.h"
#include "kernels/incoherence.h"

namespace qcal::methods::quip {

class OrthogonalTransformOp {
 public:
  OrthogonalTransformOp() = default;  // dimension 0; use the factories.

  // T = I of dimension d (d >= 1).
  static OrthogonalTransformOp Identity(int64_t d);
  // T = H_d / sqrt(d) for PlanHadamard(d).IsHadamard(); InvalidArgument otherwise.
  static StatusOr<OrthogonalTransformOp> Hadamard(int64_t d);
  // T = F·diag(phases) for even d (any even d, kRfft plan or not); phases.size() == d/2.
  static StatusOr<OrthogonalTransformOp> Rfft(int64_t d,
                                              const std::vector<std::complex<double>>& phases);
  // The fixed part of a kernels::RandomizedTransform: Hadamard(t.dim()) for Hadamard kinds
  // (t.signs ignored) or Rfft(t.dim(), t.phases) for kRfft. InvalidArgument for kNone.
  static StatusOr<OrthogonalTransformOp> FixedPart(const kernels::RandomizedTransform& t);

  enum class Kind { kIdentity, kHadamard, kRfft };
  Kind kind() const { return kind_; }
  int64_t dim() const { return dim_; }

  // x [..., dim()] float32/float64 -> same shape and dtype. x_b ← T x_b / x_b ← Tᵀ x_b.
  // Throws (c10::Error, as ATen ops do) when the last dimension is not dim(): shape errors on
  // tensors are programmer errors here, like at::matmul's.
  at::Tensor Forward(const at::Tensor& x) const;
  at::Tensor Inverse(const at::Tensor& x) const;
  at::Tensor Apply(const at::Tensor& x, TransformDirection dir) const {
    return dir == TransformDirection::kForward ? Forward(x) : Inverse(x);
  }

 private:
  at::Tensor Run(const at::Tensor& x, bool inverse) const;  // checks x, then dispatches on kind_
  at::Tensor ApplyHadamard(const at::Tensor& x, bool transpose) const;
  at::Tensor ApplyRfft(const at::Tensor& x, bool inverse) const;
  // Constant `c64` (float64 / complex128) or `c32` in x's dtype family, on x's device.
  static at::Tensor Like(const at::Tensor& c64, const at::Tensor& c32, const at::Tensor& x);

  Kind kind_ = Kind::kIdentity;
  int64_t dim_ = 0;
  // Hadamard: Kronecker factors A_1 ⊗ … ⊗ A_r = T (outermost first), each [f, f] and orthogonal
  // (±1/sqrt(f) entries), in float64 and float32.
  std::vector<at::Tensor> factors64_, factors32_;
  at::Tensor phases128_, phases64_;  // kRfft: [dim/2] complex128 / complex64
};

}  // namespace qcal::methods::quip
