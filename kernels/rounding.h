// Hessian-aware rounding of weight matrices (CPU, fp64): GPTQ, LDLQ, BlockLDLQ, and the plain
// nearest-rounding baselines, plus the proxy loss they minimise.
//
// Conventions shared by every function here:
//
//   * W is a weight matrix [rows = out_features m, cols = in_features n], row-major double.
//   * H is the input Hessian E[x xᵀ], [n, n] row-major double, symmetric positive semidefinite.
//   * Proxy loss (QuIP# eq. 2): ℓ(Ŵ) = tr((Ŵ − W) H (Ŵ − W)ᵀ).
//   * Rounding proceeds along columns (input features), front to back (in the act-order
//     permutation when act_order is set), one column at a time for scalar grids and g columns
//     at a time for BlockLDLQ with a g-dimensional codebook.
//   * Hessian preparation, identical for GPTQ, LDLQ and BlockLDLQ (GPTQ's fasterquant): columns
//     with H_ii == 0 ("dead" inputs) get H_ii = 1 and W[:, i] = 0; with act_order the columns of
//     W and rows/columns of H are permuted by decreasing diag(H) (stable: ties keep index order);
//     then H ← H + damp·mean(diag H)·I (DampHessian). Per-tensor / per-channel scalar grid
//     parameters are computed from the caller's W before any of this (as GPTQ does).
//   * Outputs are in the original column order; Ŵ is rebuilt from the returned codes and
//     parameters, so (codes, scales, zeros) reproduce w_hat exactly.
//
// Equivalence: QuIP (Chee et al. 2023; see QuIP# §2.2 footnote 1) showed GPTQ (OPTQ) and LDLQ
// produce the same Ŵ. Gptq() and Ldlq() below implement the two formulations independently (GPTQ
// from the upper Cholesky factor of H⁻¹, LDLQ from the LDL of H) and agree to rounding error,
// including with groups and act_order; tests/kernels/rounding_test.cc checks it.
//
// Grouped scalar grids (static_groups = False semantics): a group's (scale, zero) per row are
// computed when rounding reaches the group's first column, from the group's *current* targets —
// the weights after all error feedback from the columns already rounded (GPTQ's running W). For
// LDLQ, whose running targets X = W + (W − Ŵ)U only receive feedback lazily, the same values are
// obtained by solving the group's feedback recursion with zero error for its own not-yet-rounded
// columns, so both algorithms use identical parameters. Difference from reference GPTQ: with
// group_size < blocksize the reference reads, at a group's start, columns that have not yet
// received the updates from earlier columns of the same 128-column block (an artifact of its lazy
// batching); here the lazy block is rounded to a multiple of the group size (down, or up to one
// group when the group is larger), so parameters never depend on the batching. For group_size a
// multiple of 128 (the common case) the two coincide.
//
// Thread-safety: reentrant; BLAS may use OpenBLAS threads. Deterministic for a fixed OpenBLAS
// thread count (no randomness here).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/status.h"
#include "kernels/codebook.h"
#include "kernels/scalar_quant.h"

namespace qcal::kernels {

// ℓ(Ŵ) = tr((Ŵ − W) H (Ŵ − W)ᵀ), computed with dgemm in row chunks. w, w_hat: [rows, cols];
// h: [cols, cols].
double ProxyLoss(const double* w, const double* w_hat, const double* h, int64_t rows, int64_t cols);
// tr(A H Aᵀ) for A [rows, cols] (the proxy loss of rounding everything to zero), without an
// [rows, cols] temporary.
double QuadraticForm(const double* a, const double* h, int64_t rows, int64_t cols);

// Scalar-grid rounding options (GPTQ / LDLQ).
struct ScalarRoundingConfig {
  // Grid and parameter granularity: kPerTensor, kPerChannel or kPerGroup (group_size along the
  // input dim, ragged last group allowed). kPerToken is for activations and rejected here.
  ScalarQuantConfig quant;
  double damp = 0.01;        // δ of H + δ·mean(diag H)·I.
  bool act_order = false;    // GPTQ's act-order (desc_act).
  int64_t lazy_block = 128;  // Columns per lazy batch update (GPTQ's blocksize); >= 1.
  // Refinement sweeps after the pass (RefineRounding below; 0: none).
  int refine_sweeps = 0;
  // Threads (0 = the CPUs of the affinity mask). The rows are rounded in fixed 128-row tasks
  // with single-threaded BLAS, so the result does not depend on this.
  int num_threads = 0;
};

// What the refinement sweeps did (RefineRounding).
struct RefineStats {
  int sweeps = 0;          // sweeps run: it stops early after one that changes nothing
  int64_t changed = 0;     // g-blocks re-rounded (kept), over all sweeps
  double loss_before = 0;  // tr((Ŵ − W) H (Ŵ − W)ᵀ) with the H the sweeps used, before / after
  double loss_after = 0;
};

// Where a rounding's time went, in wall seconds: the Hessian's factorization (permutation,
// damping, Cholesky or block LDL), the rounding pass, the refinement sweeps. A device pass that
// does all in one call counts as `round`.
struct RoundingTimes {
  double factor = 0;
  double round = 0;
  double refine = 0;
};

struct ScalarRoundingResult {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> w_hat;   // [rows, cols], Ŵ in original column order.
  std::vector<int32_t> codes;  // [rows, cols], original column order.
  // Grid parameters, row-major [param_rows, param_cols]: param_rows = 1 (per-tensor) or rows;
  // param_cols = 1 or the number of groups. Original column j of row r uses parameter
  // (r or 0, g_idx[j]); without act_order g_idx[j] = j / group_size.
  int64_t param_rows = 0;
  int64_t param_cols = 0;
  std::vector<double> scales;
  std::vector<int32_t> zeros;
  std::vector<int32_t> g_idx;  // [cols].
  std::vector<int64_t> perm;   // [cols]: perm[k] = the original column rounded k-th.
  RefineStats refine;          // zero without refinement sweeps
  RoundingTimes times;

  ScalarQuantParams<double> params(int64_t row, int64_t col) const {
    const int64_t k = (param_rows == 1 ? 0 : row) * param_cols + g_idx[col];
    return {scales[k], zeros[k], 1.0};
  }
};

// Round-to-nearest (RTN) baseline: QuantizeScalar on W with the same grid, returned in the same
// form (perm = identity), on up to num_threads threads (0: every CPU of the rank; the bits do not
// depend on it). InvalidArgument as for QuantizeScalar, or for kPerToken.
StatusOr<ScalarRoundingResult> RoundToNearest(const double* w, int64_t rows, int64_t cols,
                                              const ScalarQuantConfig& quant, int num_threads = 0);

// GPTQ (Frantar et al. 2023, Algorithm 1 with lazy batch updates and optional act-order):
// R = chol(H⁻¹) upper (InverseCholeskyUpper); for each column i: q = Q(w_i),
// err = (w_i − q)/R_ii, w_{i+1:} −= err·R_{i,i+1:}, the updates beyond the current lazy block
// applied once per block with dgemm. Cost: O(n³) factorization + m·n² flops.
// Errors: InvalidArgument (shapes, null, non-finite, bad config), FailedPrecondition (H not
// positive definite after damping).
StatusOr<ScalarRoundingResult> Gptq(const double* w, int64_t rows, int64_t cols, const double* h,
                                    const ScalarRoundingConfig& config);

// The same result, bit for bit, using H's own storage as GPTQ's work matrix (the permuted, damped
// H and then R = chol(H⁻¹)) instead of a copy: the peak is one n×n matrix fewer (6.6 GB at the
// 70B down_proj's n = 28672). H is restored, bit for bit, before returning, on success and on
// errors from its factorization alike (not positive definite); an H that is not exactly symmetric
// is rounded by the copying Gptq instead (the restoration rebuilds H from one triangle).
StatusOr<ScalarRoundingResult> GptqInPlace(const double* w, int64_t rows, int64_t cols, double* h,
                                           const ScalarRoundingConfig& config);

// The host half of Gptq, for other implementations of its sweep (kernels/gptq_cuda.h):
// validation, act order (perm), dead columns (zeroed weights, diagonal 1), damping, and the
// result skeleton with per-tensor / per-channel grid parameters from the caller's W. The sweep
// then rounds `w` column by column in `perm` order with R = InverseCholeskyUpper(h), setting
// per-group parameters from the running weights at each group start (ComputeScalarQuantParams),
// and FinishGptqCodes stores its codes (processing order, [m, n]) and Ŵ in original order.
struct GptqPlan {
  std::vector<double> w;  // [m, n], permuted columns, dead columns zeroed
  std::vector<double> h;  // [n, n], permuted, dead diagonals 1, damped
  ScalarRoundingResult res;
  int64_t lazy_block = 0;  // the effective lazy block (a multiple of the group size)
};
StatusOr<GptqPlan> PrepareGptq(const double* w, int64_t rows, int64_t cols, const double* h,
                               const ScalarRoundingConfig& config);
void FinishGptqCodes(const std::vector<int32_t>& codes_perm, ScalarRoundingResult* res);
// Mutable access to one row's parameter set of a result (for sweeps that set group parameters).
void SetScalarParams(ScalarRoundingResult* res, int64_t row, int64_t group,
                     const ScalarQuantParams<double>& p);

// LDLQ (QuIP §4 / QuIP# §4.1 with g = 1): H = Lᵀ D L (LdlForm::kLtDL), U = Lᵀ − I strictly upper,
// Ŵ = Q(W + (W − Ŵ)U) solved column by column: X_k = W_k + Σ_{j<k} (W_j − Ŵ_j) U_jk, Ŵ_k = Q(X_k).
// Feedback from earlier lazy blocks is applied with one dgemm per block. Same errors and cost as
// Gptq; produces the same Ŵ.
StatusOr<ScalarRoundingResult> Ldlq(const double* w, int64_t rows, int64_t cols, const double* h,
                                    const ScalarRoundingConfig& config);

// Vector-codebook rounding options (BlockLDLQ and its nearest baseline).
struct VectorRoundingConfig {
  double damp = 0.01;  // BlockLDLQ only.
  // The codebook quantizes W / scale at unit scale and Ŵ = scale · point. 0 picks QuIP#'s choice
  // scale = RMS(W) / codebook.default_scale() (so the codebook sees RMS = default_scale()).
  double scale = 0.0;
  int64_t lazy_block = 128;  // Rounded up to a multiple of the codebook dimension. BlockLDLQ only.
  // Threads for the codebook searches (VectorCodebook::Quantize on row chunks; codebooks are
  // thread-safe). 0 = the CPUs of the affinity mask. Each vector is rounded independently,
  // so a deterministic codebook gives bit-identical results for any thread count; a stochastic
  // codebook that draws from one shared generator is only reproducible with 1.
  int num_threads = 0;
  // Refinement sweeps after BlockLDLQ (RefineRounding below; 0: none). BlockLdlqConsumingHessian
  // then keeps a copy of the undamped H (one more n×n).
  int refine_sweeps = 0;
  // Optional: BlockLDLQ's progress on the CPU, rows_done of rows rounded through every column,
  // called after each task of rows by the thread that finished it, one call at a time (under a
  // lock; the bits do not depend on it). Not called by the GPU path (RunBlockLdlq with a backend)
  // nor by the refinement sweeps.
  std::function<void(int64_t rows_done, int64_t rows)> progress;
};

struct VectorRoundingResult {
  int64_t rows = 0;
  int64_t cols = 0;
  int dim = 0;                  // Codebook dimension g.
  int code_words = 0;           // Words per vector.
  double scale = 0.0;           // The scale used.
  std::vector<double> w_hat;    // [rows, cols]; every g-block of a row is scale · codebook point.
  std::vector<uint32_t> codes;  // [rows, cols / dim, code_words] row-major.
  RefineStats refine;           // zero without refinement sweeps
  RoundingTimes times;
};

// BlockLDLQ (QuIP# §4.1): g = codebook.dim() must divide cols. g-block LDL H = Lᵀ D L
// (BlockLdlDecompose(…, g, kLtDL)), U = Lᵀ − I, and for each block k of g columns:
// Ŵ_k = scale · Q((W_k + (W_{:k} − Ŵ_{:k}) A_k) / scale), A_k = the k-th block column of U.
// Q is the codebook's Quantize on float input. Same errors as Gptq, plus InvalidArgument if g
// does not divide cols or the scale is not positive and finite.
StatusOr<VectorRoundingResult> BlockLdlq(const double* w, int64_t rows, int64_t cols,
                                         const double* h, const VectorCodebook& codebook,
                                         const VectorRoundingConfig& config);

// The same, bit for bit, taking ownership of H [cols, cols]: it is damped and factored in place,
// so the peak is one n×n matrix (the copying form holds the caller's H, a damped copy and the
// factor). Used for large layers (the 70B down_proj Hessian is 28672² fp64 = 6.6 GB).
StatusOr<VectorRoundingResult> BlockLdlqConsumingHessian(const double* w, int64_t rows,
                                                         int64_t cols, std::vector<double> h,
                                                         const VectorCodebook& codebook,
                                                         const VectorRoundingConfig& config);

// InvalidArgument ("<what>: the Hessian holds ...") unless `values` is cols*cols.
Status CheckHessianValues(size_t values, int64_t cols, const char* what);

// W [rows, cols] as a BlockLDLQ pass treats it: its dead input columns (zero diagonal of the
// Hessian h) zeroed. Returns `w` itself when no column is dead, else *copy, filled.
const double* ZeroDeadColumns(const double* w, int64_t rows, int64_t cols, const double* h,
                              std::vector<double>* copy);

// The refinement sweeps that follow a BlockLDLQ pass, wherever the pass ran (the CPU's
// BlockLdlqConsumingHessian and a device pass alike): config.refine_sweeps of RefineRounding on
// `res`. w [rows, cols]: the matrix the pass rounded, its dead input columns (zero diagonal of h)
// zeroed as the pass treats them; h: the undamped Hessian. Errors annotated "block ldlq".
Status RefineAfterBlockLdlq(const double* w, const double* h, const VectorCodebook& codebook,
                            const VectorRoundingConfig& config, VectorRoundingResult* res);

// Nearest rounding with the same codebook and scale rule: Ŵ_k = scale · Q(W_k / scale), each row
// cut into consecutive g-blocks. (config.damp and lazy_block are ignored.)
StatusOr<VectorRoundingResult> NearestVectorRounding(const double* w, int64_t rows, int64_t cols,
                                                     const VectorCodebook& codebook,
                                                     const VectorRoundingConfig& config);

// Refinement sweeps (the QuIP# reference's quip_tune_iters; not in the paper). After a rounding
// pass every g-column block is revisited in turn, front to back, lazy blocks of columns at a
// time: with C = (Ŵ − W)H for the current Ŵ, block k of row r is re-rounded to the codebook
// (grid) point nearest the target t = Ŵ_rk − C_rk (H_kk + λI)⁻¹, the minimiser of the row's loss
// over that block with the other blocks fixed (λ = max(damp, 1e-6)·mean(diag H) only keeps the
// inverse defined). The new point is kept only if it lowers the row's loss, by
// Δ = 2 d·C_rk + d H_kk dᵀ < −1e-12·(the row's loss) with d the change, so the proxy loss never
// increases (the reference keeps every re-rounding); C is then updated (rank-g within the lazy
// block, one dgemm per lazy block for the rest). Up to `sweeps` passes, stopping after a pass
// that keeps nothing. Cost per pass about one m×n×n GEMM plus m·n/g codebook searches, memory
// C [m, n]. Rows are independent: threads take row chunks, each row computed by the same
// arithmetic whatever the thread count, so the result is bit-identical across thread counts.
//
// Joint codebooks (VectorCodebook::joint_vectors() > 1: a trellis tile's rows share one code
// stream) move in units of those rows: the unit's block is re-encoded from all its rows' targets
// and kept only if the sum of its rows' Δ is negative by the same margin.
//
// For scalar grids g = 1 and the nearest grid point to t is the exact minimiser over the grid
// of the row's loss in that column, so every kept move is coordinate descent; for lattices the
// Euclidean nearest point is a heuristic, which the Δ test makes safe.
//
// The two forms below refine a Gptq / Ldlq / RoundToNearest result (original column order,
// its grid parameters fixed; w, h: the caller's, undamped) and a BlockLdlq result (w: the
// matrix it rounded, at the result's scale; h: undamped).
StatusOr<RefineStats> RefineRounding(const double* w, const double* h, int sweeps, double damp,
                                     int64_t lazy_block, int num_threads,
                                     const ScalarQuantConfig& quant, ScalarRoundingResult* res);
StatusOr<RefineStats> RefineRounding(const double* w, const double* h, int sweeps, double damp,
                                     int64_t lazy_block, int num_threads,
                                     const VectorCodebook& codebook, VectorRoundingResult* res);

}  // namespace qcal::kernels
