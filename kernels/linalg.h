// Dense fp64 linear algebra for Hessian-aware rounding (CPU; LAPACK/BLAS from OpenBLAS).
//
// Layout: every matrix is a row-major n×n array of double (element (i, j) at a[i·n + j]).
// Symmetric inputs are read in full: both triangles must hold the same values (Cholesky reads the
// lower triangle only, in LAPACK terms the upper triangle of the column-major view).
//
// Factorizations offered (QuIP# §4.1 and appendix B; QuIP's LDLQ; GPTQ):
//
//   Cholesky               H = C Cᵀ, C lower triangular with positive diagonal (LAPACK dpotrf).
//   LDL (kLDLt)            H = L D Lᵀ, L unit lower triangular, D diagonal — the textbook form.
//   LDL (kLtDL)            H = Lᵀ D L, L unit lower triangular — the form QuIP/QuIP# write, so
//                          that U = Lᵀ - I is strictly upper triangular and LDLQ rounds columns
//                          front to back: Ŵ = Q(W + (W - Ŵ)U).
//   g-block LDL            the same two forms with L unit *block* lower triangular (its g×g
//                          diagonal blocks are I, blocks above them 0) and D block diagonal with
//                          g×g symmetric positive definite blocks (QuIP# §4.1, the "g-block LDL
//                          decomposition"). g need not divide n: the last block (kLDLt and kLtDL
//                          alike, in the original index order) is then n mod g wide.
//   GPTQ's inverse factor  H⁻¹ = Rᵀ R, R upper triangular (Cholesky of H⁻¹ as GPTQ computes it).
//
// Everything is computed from one Cholesky factorization: with C = chol(H) and C_b its b-th
// diagonal block, L = C·blockdiag(C_b)⁻¹ and D_b = C_b C_bᵀ (kLDLt); kLtDL applies the same to
// the index-reversed matrix P H P (P the exchange matrix) and maps back: H = (P L' P)(P D' P)
// (P L'ᵀ P) so L = P L'ᵀ P.
//
// Errors: InvalidArgument for a bad shape, a null pointer or a non-finite entry; FailedPrecondition
// when the matrix is not (numerically) positive definite, naming the pivot at which the
// factorization failed and suggesting damping (DampHessian).
//
// Thread-safety: reentrant; BLAS/LAPACK may use OpenBLAS's own threads. Deterministic for a fixed
// OpenBLAS thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace qcal::kernels {

// H ← H + δ·mean(diag H)·I in place (GPTQ's "percdamp", QuIP#'s sigma_reg). Returns the amount
// added to each diagonal entry. InvalidArgument for n <= 0, a null pointer, δ < 0 or non-finite,
// or a non-finite diagonal.
StatusOr<double> DampHessian(double* h, int64_t n, double delta = 0.01);

// In-place Cholesky: on success a holds C (lower triangle, H = C Cᵀ) and its strict upper
// triangle is zeroed. On FailedPrecondition `a` is left partially overwritten.
Status CholeskyInPlace(double* a, int64_t n);

// Copying variant: returns C, [n, n] row-major.
StatusOr<std::vector<double>> Cholesky(const double* h, int64_t n);

// Which LDL form (see the header comment).
enum class LdlForm {
  kLDLt,  // H = L D Lᵀ.
  kLtDL,  // H = Lᵀ D L (QuIP# §4.1).
};

struct BlockLdl {
  int64_t n = 0;
  int64_t block = 1;  // g.
  LdlForm form = LdlForm::kLDLt;
  // L, [n, n] row-major, unit block lower triangular in both forms.
  std::vector<double> L;
  // The block-diagonal D stored compactly as [n, block] row-major: D(i, j) for j in the same
  // block as i is at d[i·block + (j - BlockStart(i))]; entries past a ragged last block are 0.
  // For block == 1 this is just diag(D).
  std::vector<double> d;

  int64_t BlockStart(int64_t i) const { return (i / block) * block; }
  double D(int64_t i, int64_t j) const {
    const int64_t s = BlockStart(i);
    return (j >= s && j < s + block) ? d[i * block + (j - s)] : 0.0;
  }
  // D as a dense [n, n] row-major matrix (tests, small n).
  std::vector<double> DenseD() const;
  // tr(D).
  double TraceD() const;
};

// g-block LDL (QuIP# §4.1) of a symmetric positive definite H [n, n], block g >= 1.
StatusOr<BlockLdl> BlockLdlDecompose(const double* h, int64_t n, int64_t block, LdlForm form);

// The same, factoring in place: `h` (n·n values) is consumed and its storage becomes the result's
// L, so the peak is one n×n matrix instead of two (a 70B down_proj Hessian is 6.6 GB in fp64).
// Bit-identical to the copying form. On error `h` is left in an unspecified state.
StatusOr<BlockLdl> BlockLdlDecompose(std::vector<double>&& h, int64_t n, int64_t block,
                                     LdlForm form);

// Plain LDL (block 1).
inline StatusOr<BlockLdl> LdlDecompose(const double* h, int64_t n, LdlForm form = LdlForm::kLDLt) {
  return BlockLdlDecompose(h, n, 1, form);
}

// GPTQ's Hessian-inverse factor: R upper triangular with positive diagonal and H⁻¹ = Rᵀ R (GPTQ
// computes it as cholesky(cholesky_inverse(cholesky(H)), upper=True)). Since that factor is
// unique, it is computed here as R = P C'⁻¹ P with C' = chol(P H P) (n³/3 + n³/3 flops instead of
// 4n³/3). [n, n] row-major, strict lower triangle zero.
StatusOr<std::vector<double>> InverseCholeskyUpper(const double* h, int64_t n);
// The same computed in `h`'s own storage (moved in, returned as R): the peak is one n×n matrix
// instead of two. Bit-identical to the copying form. On error `h` is consumed.
StatusOr<std::vector<double>> InverseCholeskyUpper(std::vector<double>&& h, int64_t n);

// The same R computed in h's own storage while keeping h: on success the upper triangle of h
// (diagonal included) is R, bit-identical to the copying forms, and the strict lower triangle is
// h's own, untouched; on a FailedPrecondition (not positive definite, singular) the strict lower
// triangle is h's too and the rest unspecified. R is computed from h's upper triangle (h is
// meant to be symmetric). Lets GPTQ restore H after its sweep without a second n×n matrix
// (GptqInPlace in kernels/rounding.h). InvalidArgument (non-finite entries, bad n) leaves h as
// it was.
Status InverseCholeskyUpperKeepingLower(double* h, int64_t n);

// Reconstruction helpers (tests, small n): L·Lᵀ, and the product of a form's factors.
std::vector<double> MultiplyLLt(const std::vector<double>& c, int64_t n);
std::vector<double> ReconstructLdl(const BlockLdl& f);

// ‖A − B‖_F / ‖B‖_F for two [n, n] matrices.
double RelativeFrobeniusError(const double* a, const double* b, int64_t n);

}  // namespace qcal::kernels
