// Hadamard and randomized orthogonal transforms (CPU reference).
//
// These are the rotations QuIP# and QuaRot use for incoherence processing:
//
//   * the normalized Walsh-Hadamard transform for n = 2^k (Sylvester ordering, H_n = H_2^{⊗k}),
//   * H_n = H_{2^k} ⊗ H_m for n = 2^k·m with m a stored/constructed Hadamard order
//     (Paley I, Paley II, Sylvester-doubling or Williamson constructions),
//   * the randomized Hadamard transform x → H·diag(s)·x with a seeded ±1 sign vector (QuIP# RHT),
//   * QuIP#'s randomized FFT (Algorithm 4) for even n with no Hadamard factorisation.
//
// Conventions shared by every function here:
//
//   * Normalization: every transform is orthonormal. Hadamard transforms multiply by
//     H_n / sqrt(n) where H_n has ±1 entries, so ||Tx|| = ||x|| and T^{-1} = T^T.
//   * Layout: `batch` vectors of length n stored contiguously, vector b at x + b·n (row-major
//     [batch][n]). The *Matrix variants act on a row-major rows×cols matrix along either axis.
//   * In place: outputs overwrite inputs. float data is transformed in float arithmetic
//     (Hadamard) or through a double-precision FFT (RFFT); double data in double.
//   * Errors: an unsupported size or a null pointer returns InvalidArgument; nothing is modified
//     in that case.
//   * Thread-safety: every function is reentrant and may be called concurrently on disjoint
//     buffers. The table of small Hadamard matrices is built once on first use (thread-safe
//     static initialization) and is immutable afterwards. Functions are single-threaded; callers
//     parallelize over batches if they want to.
//   * Determinism: for a fixed seed, RandomSigns returns the same signs on every platform and
//     RandomPhases the same angles (std::mt19937_64 is fully specified; no std::*_distribution
//     is used; cos/sin of those angles may differ in the last ulp between libm versions). The
//     transforms are bit-identical run to run for the same binary and inputs.
#pragma once

#include <complex>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace qcal {

// ---------------------------------------------------------------------------------------------
// Sizes and plans
// ---------------------------------------------------------------------------------------------

// Which construction PlanHadamard picked for a dimension.
enum class HadamardKind {
  kPow2,        // n = 2^k (n = 1 included): fast Walsh-Hadamard transform.
  kPow2TimesM,  // n = 2^k·m, m from HadamardFactorOrders(): H_{2^k} ⊗ H_m.
  kRfft,        // even n without such a factorisation: QuIP# randomized FFT on n/2 complex values.
  kNone,        // odd n > 1 (or n < 1): no orthogonal transform offered here.
};

// The construction for one dimension n.
struct HadamardPlan {
  HadamardKind kind = HadamardKind::kNone;
  int64_t n = 0;
  int64_t pow2 = 1;  // the 2^k factor: n for kPow2, n/m for kPow2TimesM, 1 otherwise.
  int64_t m = 1;     // the non-power-of-two Hadamard order for kPow2TimesM, 1 otherwise.

  bool IsHadamard() const {
    return kind == HadamardKind::kPow2 || kind == HadamardKind::kPow2TimesM;
  }
};

// Picks the construction for dimension n. Among factorisations n = 2^k·m with m in
// HadamardFactorOrders() it prefers the largest 2^k (smallest m); a power of two (including 1) is
// kPow2; other even n get kRfft; everything else kNone.
// Examples: 4096 → kPow2; 11008 = 64·172 → kPow2TimesM(m=172); 14336 = 512·28 → m=28;
// 202 = 2·101 → kRfft; 7 → kNone.
HadamardPlan PlanHadamard(int64_t n);

// "pow2", "pow2xm", "rfft" or "none"; and a one-line description such as "11008 = 64 x 172".
const char* HadamardKindName(HadamardKind kind);
std::string DescribeHadamardPlan(const HadamardPlan& plan);

// The non-power-of-two orders m usable in H_{2^k} ⊗ H_m, ascending:
// {12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172} (AMD Quark's list; m = 4 is a power of two).
const std::vector<int>& HadamardFactorOrders();

// A ±1 Hadamard matrix with H·H^T = order·I, row-major order×order entries of +1/-1.
struct HadamardMatrix {
  int order = 0;
  std::string construction;  // e.g. "paley1 q=11", "paley2 q=25", "williamson t=43", "sylvester".
  std::vector<int8_t> entries;
};

// Returns the (unnormalized) Hadamard matrix used for `order`: a power of two up to 4096
// (Sylvester) or one of HadamardFactorOrders(). InvalidArgument for any other order.
// The returned object is a copy; building it is cheap (the table is cached).
StatusOr<HadamardMatrix> GetHadamardMatrix(int order);

// ---------------------------------------------------------------------------------------------
// Hadamard transforms
// ---------------------------------------------------------------------------------------------

// In-place normalized fast Walsh-Hadamard transform: x_b ← (H_n / sqrt(n))·x_b for each of the
// `batch` contiguous vectors of length n. H_n is the Sylvester matrix
// H_n[i][j] = (-1)^popcount(i & j), which is symmetric, so the transform is its own inverse.
// n must be a power of two (n ≥ 1); batch ≥ 0.
Status FwhtInPlace(float* x, int64_t n, int64_t batch);
Status FwhtInPlace(double* x, int64_t n, int64_t batch);

// In-place normalized Hadamard transform for any n with PlanHadamard(n).IsHadamard():
// x_b ← (H / sqrt(n))·x_b (or (H^T / sqrt(n))·x_b with transpose = true, the inverse).
// For n = 2^k·m, H = H_{2^k} ⊗ H_m: entry (a·m + b, a'·m + b') = H_{2^k}[a][a']·H_m[b][b'],
// i.e. view each vector as a row-major 2^k × m matrix X and compute H_{2^k}·X·H_m^T.
// H_m is not symmetric in general, hence the transpose flag. For n = 2^k both flags agree.
Status HadamardTransform(float* x, int64_t n, int64_t batch, bool transpose = false);
Status HadamardTransform(double* x, int64_t n, int64_t batch, bool transpose = false);

// Which axis of a row-major rows×cols matrix a transform runs along.
enum class MatrixAxis {
  kRows,     // transform every row (a vector of length cols): A ← A·T^T. n = cols.
  kColumns,  // transform every column (a vector of length rows): A ← T·A. n = rows.
};

// HadamardTransform applied to each row or each column of a row-major rows×cols matrix `a`
// (leading dimension cols). Columns are transformed in place with row-wide butterflies, without
// transposing the matrix.
Status HadamardTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                               bool transpose = false);
Status HadamardTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                               bool transpose = false);

// ---------------------------------------------------------------------------------------------
// Randomized transforms
// ---------------------------------------------------------------------------------------------

enum class TransformDirection {
  kForward,  // x → T·x
  kInverse,  // x → T^{-1}·x = T^T·x
};

// n signs in {+1, -1} derived from `seed`: draw 64-bit words w_0, w_1, ... from
// std::mt19937_64(seed); sign i is -1 when bit (i mod 64) of w_{i/64} is set, +1 otherwise.
// The first n signs of a longer vector from the same seed are the same.
std::vector<int8_t> RandomSigns(int64_t n, uint64_t seed);

// Randomized Hadamard transform (QuIP# RHT) on `batch` contiguous vectors of length n:
//   kForward: x ← (H/sqrt(n))·diag(signs)·x;   kInverse: x ← diag(signs)·(H^T/sqrt(n))·x.
// `signs` holds n entries of ±1. n must satisfy PlanHadamard(n).IsHadamard().
Status RandomizedHadamardTransform(float* x, int64_t n, int64_t batch, const int8_t* signs,
                                   TransformDirection dir);
Status RandomizedHadamardTransform(double* x, int64_t n, int64_t batch, const int8_t* signs,
                                   TransformDirection dir);

// The same along an axis of a row-major rows×cols matrix; `signs` has length cols (kRows) or
// rows (kColumns). QuIP# IP-RHT's W ← U·diag(S_U)·W·diag(S_V)·V^T is
//   RandomizedHadamardTransformMatrix(w, m, n, kRows, s_v, kForward) followed by
//   RandomizedHadamardTransformMatrix(w, m, n, kColumns, s_u, kForward).
Status RandomizedHadamardTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                         const int8_t* signs, TransformDirection dir);
Status RandomizedHadamardTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                         const int8_t* signs, TransformDirection dir);

// `count` unit complex phases e^{iθ_k} from `seed`: θ_k = 2π·(w_k >> 11)·2^-53 with w_k the
// k-th 64-bit word of std::mt19937_64(seed) (uniform on [0, 2π)).
std::vector<std::complex<double>> RandomPhases(int64_t count, uint64_t seed);

// QuIP# randomized FFT (Algorithm 4) on `batch` contiguous real vectors of even length n.
// A vector is read as n/2 complex numbers z_k = x[2k] + i·x[2k+1]; then
//   kForward: z ← F·diag(phases)·z;   kInverse: z ← diag(conj(phases))·F^H·z,
// with F the unitary DFT of length n/2 (F[j][k] = e^{-2πi·jk/(n/2)} / sqrt(n/2)), and the result
// is written back as interleaved (re, im). As a real linear map this is orthogonal. `phases`
// holds n/2 unit complex numbers. Any n/2 works: mixed-radix Stockham for sizes whose prime
// factors are ≤ 64, Bluestein (chirp-z over a power-of-two FFT) otherwise. Computation is in
// double precision for both element types.
Status RandomizedFftTransform(float* x, int64_t n, int64_t batch,
                              const std::complex<double>* phases, TransformDirection dir);
Status RandomizedFftTransform(double* x, int64_t n, int64_t batch,
                              const std::complex<double>* phases, TransformDirection dir);
// Along an axis of a row-major rows×cols matrix (pairs are consecutive elements along the axis).
Status RandomizedFftTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                    const std::complex<double>* phases, TransformDirection dir);
Status RandomizedFftTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                    const std::complex<double>* phases, TransformDirection dir);

// Convenience dispatcher for incoherence processing: picks the transform from PlanHadamard(n)
// (RHT with RandomSigns(n, seed) for Hadamard sizes, RFFT with RandomPhases(n/2, seed) for
// kRfft) and applies it along `axis`. InvalidArgument for kNone sizes.
Status RandomizedOrthogonalTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                           uint64_t seed, TransformDirection dir);
Status RandomizedOrthogonalTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                           uint64_t seed, TransformDirection dir);

}  // namespace qcal
