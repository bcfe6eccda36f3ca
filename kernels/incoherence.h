// Incoherence processing (QuIP# §3, Algorithm 3 "IP-RHT" and Algorithm 4 "IP-RFFT") and the
// matching inference-time transforms (QuIP# Algorithm 2), CPU reference.
//
// Notation. A linear layer computes y = W x with W [m = out_features, n = in_features], stored
// row-major (PyTorch's nn.Linear weight layout). H = E[x xᵀ] is its input Hessian, [n, n].
// Incoherence processing picks two random orthogonal matrices
//
//   U (m×m, the OUTPUT side)  and  V (n×n, the INPUT side)
//
// and replaces (W, H) by
//
//   Ŵ = U·W·Vᵀ   [m, n]      Ĥ = V·H·Vᵀ   [n, n].
//
// Each of U, V is a RandomizedTransform T of its dimension d, chosen by PlanHadamard(d):
//
//   Hadamard sizes (kPow2, kPow2TimesM):  T = (H_d / sqrt(d))·diag(s),  s ∈ {±1}^d
//       (QuIP#'s RHT; H_d is the ±1 matrix of hadamard.h, H_{2^k} ⊗ H_m for d = 2^k·m),
//   kRfft sizes (even d, no Hadamard factorisation):  T = F·diag(p) on d/2 complex values
//       z_k = v[2k] + i·v[2k+1] (QuIP#'s RFFT, hadamard.h's RandomizedFftTransform), p unit phases,
//   kNone (odd d > 1): unsupported, InvalidArgument.
//
// so in the paper's notation U = H_m·S_U and V = H_n·S_V, Ŵ = H_m S_U W S_V H_nᵀ (Lemma 3.1).
// What "acts on which side" means for the row-major buffers:
//
//   Ŵ = U W Vᵀ : every ROW of W (length n, one output neuron's weights) is mapped w_r → V w_r,
//                then every COLUMN (length m) is mapped c → U c. Row i of Ŵ is not row i of W:
//                U mixes output channels. For kRfft along the columns, the complex pairs are
//                rows (2k, 2k+1); along rows, columns (2k, 2k+1).
//   Ĥ = V H Vᵀ : V applied to every column of H, then to every row.
//   Inverse    : W = Uᵀ Ŵ V (RestoreWeights): rows w_r → Vᵀ w_r, columns c → Uᵀ c. This is how
//                a quantized Ŵ_q is mapped back to W-space: W_q = Uᵀ Ŵ_q V.
//
// Inference (Algorithm 2). Since W = Uᵀ Ŵ V,  y = W x = Uᵀ·(Ŵ·(V·x)). For a batch of B
// activations stored row-major X [B, n] (row b = x_b), Y = X Wᵀ [B, m]:
//
//   1. TransformInputs:  x_b ← V x_b       (X̂ = X Vᵀ)            — RHT/RFFT forward, length n
//   2. Ŷ = X̂ Ŵ_qᵀ                           (the quantized matmul, in the rotated basis)
//   3. RestoreOutputs:   y_b ← Uᵀ ŷ_b      (Y = Ŷ U)             — RHT/RFFT inverse, length m
//
// The Hessian of the rotated inputs x̂ = V x is exactly Ĥ = V H Vᵀ, and the proxy loss is
// invariant: tr((Ŵ_q − Ŵ) Ĥ (Ŵ_q − Ŵ)ᵀ) = tr((W_q − W) H (W_q − W)ᵀ) for W_q = Uᵀ Ŵ_q V.
// The proxy loss itself is kernels/rounding.h's ProxyLoss (not duplicated here).
//
// Seeds and stored state (what a checkpoint needs to reproduce U and V):
//
//   * MakeRandomizedTransform(d, seed) derives s = RandomSigns(d, seed) (Hadamard sizes) or
//     p = RandomPhases(d/2, seed) (kRfft), exactly as hadamard.h's
//     RandomizedOrthogonalTransformMatrix(…, seed, …) does, so (d, seed) alone reproduces T on
//     every platform for Hadamard sizes (bit-exact signs; see hadamard.h for the last-ulp caveat
//     on cos/sin of RFFT phases).
//   * Alternatively store the signs themselves (int8 ±1, one per coordinate, index i = input
//     coordinate i of diag(s), i.e. s is applied BEFORE the Hadamard matrix) or the phases (n/2
//     complex values) and rebuild with RandomizedTransformFromSigns / FromPhases.
//   * U and V are independent: IncoherenceProcess takes seed_u and seed_v separately. Use
//     distinct seeds (with m == n and seed_u == seed_v, U and V would coincide).
//   * QuIP#'s fine-tuned variant (§5) learns real-valued sign vectors; that is not supported
//     here (signs are ±1, as hadamard.h requires).
//
// Incoherence measures (QuIP# Definition 2.1):
//   μ_W = max_ij |W_ij| · sqrt(m n) / ||W||_F  ∈ [1, sqrt(mn)],
//   μ_H = max_ij |Q_ij| · sqrt(n) for the eigenvectors Q of H = Q Λ Qᵀ  ∈ [1, sqrt(n)].
// Lemma 3.1: after the RHT, with probability ≥ 1 − δ, μ_H ≤ sqrt(2 log(2n²/δ)) and
// μ_W ≤ 2 log(4mn/δ) (the same bounds hold for the RFFT, Lemmas A.3/A.4).
//
// Conventions: all buffers row-major; in-place functions overwrite their input and leave it
// unmodified when they return an error (validation happens before any write). fp64 is the
// reference; float overloads transform in float (Hadamard) or through double (RFFT) as
// hadamard.h does.
// Errors: InvalidArgument for a non-positive or unsupported (odd, kNone) dimension, a null
// pointer, a size mismatch between a buffer and a transform, invalid signs/phases, or (for
// IncoherenceProcess and the measures) a non-finite entry. Internal if LAPACK fails.
// Thread-safety: every function is reentrant; a RandomizedTransform is immutable after
// construction and may be shared between threads. Single-threaded except HessianIncoherence,
// which calls LAPACK (OpenBLAS may use its own threads).
#pragma once

#include <complex>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/hadamard.h"

namespace qcal::kernels {

// One side's random orthogonal transform T (d×d, TᵀT = I). See the header comment.
struct RandomizedTransform {
  HadamardPlan plan;  // plan.n is the dimension d; plan.kind is kPow2, kPow2TimesM or kRfft.
  // The seed the signs/phases were derived from (MakeRandomizedTransform); 0 and meaningless when
  // built from stored signs/phases (has_seed == false).
  uint64_t seed = 0;
  bool has_seed = false;
  std::vector<int8_t> signs;                 // Hadamard kinds: d entries of ±1; else empty.
  std::vector<std::complex<double>> phases;  // kRfft: d/2 unit complex numbers; else empty.

  int64_t dim() const { return plan.n; }
  HadamardKind kind() const { return plan.kind; }
};

// T for dimension d from a seed (signs = RandomSigns(d, seed) or phases = RandomPhases(d/2, seed)).
StatusOr<RandomizedTransform> MakeRandomizedTransform(int64_t d, uint64_t seed);
// T from stored ±1 signs (d = signs.size(); PlanHadamard(d) must be a Hadamard kind).
StatusOr<RandomizedTransform> RandomizedTransformFromSigns(std::vector<int8_t> signs);
// T from stored phases for even d with PlanHadamard(d).kind == kRfft (phases.size() == d/2, each
// of modulus 1 within 1e-9).
StatusOr<RandomizedTransform> RandomizedTransformFromPhases(
    int64_t d, std::vector<std::complex<double>> phases);

// x_b ← T x_b (kForward) or Tᵀ x_b (kInverse) for `batch` contiguous vectors of length t.dim().
Status ApplyTransform(const RandomizedTransform& t, double* x, int64_t batch,
                      TransformDirection dir);
Status ApplyTransform(const RandomizedTransform& t, float* x, int64_t batch,
                      TransformDirection dir);
// The same along an axis of a row-major rows×cols matrix (hadamard.h's MatrixAxis): kRows maps
// each row r → T^{±1} r (A ← A·Tᵀ for kForward, n = cols); kColumns maps A ← T^{±1}·A (n = rows).
Status ApplyTransformMatrix(const RandomizedTransform& t, double* a, int64_t rows, int64_t cols,
                            MatrixAxis axis, TransformDirection dir);
Status ApplyTransformMatrix(const RandomizedTransform& t, float* a, int64_t rows, int64_t cols,
                            MatrixAxis axis, TransformDirection dir);

// The pair (U, V) of one linear layer: what the checkpoint stores next to the quantized Ŵ.
struct IncoherenceTransforms {
  RandomizedTransform u;  // m×m, output side (out_features).
  RandomizedTransform v;  // n×n, input side (in_features).

  int64_t rows() const { return u.dim(); }  // m
  int64_t cols() const { return v.dim(); }  // n
};

// U from seed_u (dimension m), V from seed_v (dimension n).
StatusOr<IncoherenceTransforms> MakeIncoherenceTransforms(int64_t m, int64_t n, uint64_t seed_u,
                                                          uint64_t seed_v);

// Output of IncoherenceProcess (QuIP# Algorithm 3 / 4).
struct IncoherenceResult {
  int64_t rows = 0;                  // m
  int64_t cols = 0;                  // n
  std::vector<double> w_hat;         // [m, n] = U W Vᵀ
  std::vector<double> h_hat;         // [n, n] = V H Vᵀ (empty when no H was given)
  IncoherenceTransforms transforms;  // U (S_U / phases, plan for m), V (S_V / phases, plan for n)
};

// IP-RHT / IP-RFFT: Ŵ = U W Vᵀ, Ĥ = V H Vᵀ with U = MakeRandomizedTransform(m, seed_u) and
// V = MakeRandomizedTransform(n, seed_v). w: [m, n] row-major; h: [n, n] row-major or nullptr
// (then h_hat is empty). H need not be symmetric (any H is conjugated as given).
StatusOr<IncoherenceResult> IncoherenceProcess(const double* w, int64_t m, int64_t n,
                                               const double* h, uint64_t seed_u, uint64_t seed_v);
// The same with caller-provided transforms (e.g. loaded from a checkpoint).
StatusOr<IncoherenceResult> IncoherenceProcess(const double* w, const double* h,
                                               const IncoherenceTransforms& t);

// In place, w: [t.rows(), t.cols()] row-major.
//   TransformWeights: W ← U W Vᵀ.      RestoreWeights: Ŵ ← Uᵀ Ŵ V (exact inverse).
Status TransformWeights(const IncoherenceTransforms& t, double* w);
Status TransformWeights(const IncoherenceTransforms& t, float* w);
Status RestoreWeights(const IncoherenceTransforms& t, double* w_hat);
Status RestoreWeights(const IncoherenceTransforms& t, float* w_hat);
// Copying variant of RestoreWeights: W-space weights Uᵀ Ŵ V from a (quantized) Ŵ.
StatusOr<std::vector<double>> RecoverWeights(const IncoherenceTransforms& t, const double* w_hat);

// In place, h: [v.dim(), v.dim()] row-major.
//   TransformHessian: H ← V H Vᵀ.      RestoreHessian: Ĥ ← Vᵀ Ĥ V.
Status TransformHessian(const RandomizedTransform& v, double* h);
Status RestoreHessian(const RandomizedTransform& v, double* h_hat);

// Algorithm 2's activation transforms, in place on row-major batches.
//   TransformInputs: x: [batch, n], x_b ← V x_b.   RestoreOutputs: y: [batch, m], y_b ← Uᵀ y_b.
// With Ŵ = U W Vᵀ: RestoreOutputs(Ŵ·TransformInputs(x)) = W x.
Status TransformInputs(const IncoherenceTransforms& t, double* x, int64_t batch);
Status TransformInputs(const IncoherenceTransforms& t, float* x, int64_t batch);
Status RestoreOutputs(const IncoherenceTransforms& t, double* y, int64_t batch);
Status RestoreOutputs(const IncoherenceTransforms& t, float* y, int64_t batch);

// μ_W = max|W_ij|·sqrt(m n)/||W||_F for w [m, n]. InvalidArgument for an empty/null/non-finite
// or all-zero matrix. The Frobenius norm is accumulated in double (scaled, no overflow).
StatusOr<double> WeightIncoherence(const double* w, int64_t m, int64_t n);
StatusOr<double> WeightIncoherence(const float* w, int64_t m, int64_t n);

// μ_H = max_ij |Q_ij|·sqrt(n) with Q the eigenvectors of the symmetric h [n, n] (LAPACK dsyevd;
// the lower triangle of the row-major array is read). Caveat: for repeated eigenvalues Q is
// not unique and μ_H depends on the basis LAPACK returns (e.g. H = I gives Q = I, μ_H = sqrt(n));
// QuIP#'s definition has the same ambiguity. Cost O(n³), memory 2n² doubles.
// InvalidArgument for n <= 0, null, non-finite; Internal when dsyevd fails to converge.
StatusOr<double> HessianIncoherence(const double* h, int64_t n);

}  // namespace qcal::kernels
