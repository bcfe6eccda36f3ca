#include "kernels/linalg.h"

#include "common/cpu.h"
#include "kernels/blas_threads.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

// LAPACK (Fortran ABI; provided by OpenBLAS). The trailing size_t is the hidden length of the
// character argument that gfortran passes.
extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info, size_t);
void dtrtri_(const char* uplo, const char* diag, const int* n, double* a, const int* lda, int* info,
             size_t, size_t);
}

namespace qcal::kernels {
namespace {

Status CheckSquare(const double* a, int64_t n, const char* what) {
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": n = ", n, " must be > 0"));
  if (n > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": n = ", n, " too large for LAPACK"));
  }
  if (a == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null matrix"));
  for (int64_t i = 0; i < n * n; ++i) {
    if (!std::isfinite(a[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": non-finite entry at (", i / n, ", ", i % n, ")"));
    }
  }
  return absl::OkStatus();
}

// dpotrf on a row-major symmetric matrix, result C lower (H = C Cᵀ), strict upper zeroed.
// `index_of` maps the LAPACK pivot (0-based, in a's own order) to the caller's description.
// Cholesky tile: the diagonal tiles are factored by LAPACK, the panel solves and the trailing
// update are single-threaded BLAS calls on tiles of this size spread over qcal's threads.
constexpr int64_t kCholeskyTile = 256;

// Tiled right-looking Cholesky of the row-major symmetric a (lower part read and written; the
// strict upper part is left as it was). Every tile operation has fixed shapes, so the factor's
// bits do not depend on the thread count. Returns LAPACK's info convention: 0, or the order of
// the first leading minor that is not positive definite.
int TiledPotrfLower(double* a, int64_t n) {
  PinBlasToOneThread();
  const int ni = static_cast<int>(n);
  const int64_t tiles = (n + kCholeskyTile - 1) / kCholeskyTile;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    const int64_t k0 = kt * kCholeskyTile, kb = std::min(kCholeskyTile, n - k0);
    const int kbi = static_cast<int>(kb);
    double* a11 = a + k0 * n + k0;
    int info = 0;
    dpotrf_("U", &kbi, a11, &ni, &info, 1);  // row-major lower == column-major upper
    if (info != 0) return info < 0 ? info : static_cast<int>(k0) + info;
    const int64_t rest = tiles - kt - 1;
    if (rest == 0) break;
    // A21 := A21 · L11⁻ᵀ, one row tile per task.
    qcal::ParallelTasks(rest, 0, [&](int64_t i) {
      const int64_t r0 = (kt + 1 + i) * kCholeskyTile, rows = std::min(kCholeskyTile, n - r0);
      cblas_dtrsm(CblasRowMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit,
                  static_cast<int>(rows), kbi, 1.0, a11, ni, a + r0 * n + k0, ni);
    });
    // A22 −= A21 · A21ᵀ on the lower tiles (i >= j), one tile per task.
    qcal::ParallelTasks(rest * (rest + 1) / 2, 0, [&](int64_t t) {
      int64_t i = 0;
      while ((i + 1) * (i + 2) / 2 <= t) ++i;
      const int64_t j = t - i * (i + 1) / 2;
      const int64_t ri = (kt + 1 + i) * kCholeskyTile, rj = (kt + 1 + j) * kCholeskyTile;
      const int ti = static_cast<int>(std::min(kCholeskyTile, n - ri));
      const int tj = static_cast<int>(std::min(kCholeskyTile, n - rj));
      if (i == j) {
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasNoTrans, ti, kbi, -1.0, a + ri * n + k0, ni,
                    1.0, a + ri * n + ri, ni);
      } else {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ti, tj, kbi, -1.0, a + ri * n + k0,
                    ni, a + rj * n + k0, ni, 1.0, a + ri * n + rj, ni);
      }
    });
  }
  return 0;
}

// In place L ← L⁻¹ for the row-major lower triangular a (strict upper part zero), in
// kCholeskyTile tiles on qcal's threads with single-threaded BLAS: first every diagonal tile's own
// inverse (dtrtri per tile), then tile row by tile row (row i needs the finished rows above it),
// each off-diagonal tile of the row one task: X_ij = −X_ii · Σ_{j <= k < i} L_ik X_kj, the sum one
// dgemm over the row's tiles j..i−1 (into a scratch strip: the row's original L is read by the
// row's other tasks) and the product one dtrmm. Every tile has fixed operation shapes, so the bits
// do not depend on the thread count. Returns 0, or 1 + the index of a zero diagonal entry.
int TiledTrtriLower(double* a, int64_t n) {
  PinBlasToOneThread();
  const int ni = static_cast<int>(n);
  const int64_t tiles = (n + kCholeskyTile - 1) / kCholeskyTile;
  std::atomic<int64_t> bad{0};
  qcal::ParallelTasks(tiles, 0, [&](int64_t t) {
    const int64_t k0 = t * kCholeskyTile;
    const int kb = static_cast<int>(std::min(kCholeskyTile, n - k0));
    int info = 0;
    dtrtri_("U", "N", &kb, a + k0 * n + k0, &ni, &info, 1, 1);  // row-major lower, see above
    if (info > 0) {
      int64_t want = 0;
      bad.compare_exchange_strong(want, k0 + info);  // any one singular tile's index
    }
  });
  if (bad.load() != 0) return static_cast<int>(bad.load());
  std::vector<double> strip;
  for (int64_t it = 1; it < tiles; ++it) {
    const int64_t i0 = it * kCholeskyTile, rows = std::min(kCholeskyTile, n - i0);
    strip.assign(rows * i0, 0.0);  // [rows, i0]: the row's new tiles left of the diagonal
    qcal::ParallelTasks(it, 0, [&](int64_t jt) {
      const int64_t j0 = jt * kCholeskyTile;
      const int64_t cols = kCholeskyTile;  // tiles left of the diagonal are whole
      double* out = strip.data() + j0;
      // out = L[i, j0:i0] · X[j0:i0, j0:j0+cols] (X's rows above row i are final; the strict
      // upper parts of their diagonal tiles are zero).
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                  static_cast<int>(cols), static_cast<int>(i0 - j0), 1.0, a + i0 * n + j0, ni,
                  a + j0 * n + j0, ni, 0.0, out, static_cast<int>(i0));
      // out = −X_ii · out.
      cblas_dtrmm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasNonUnit,
                  static_cast<int>(rows), static_cast<int>(cols), -1.0, a + i0 * n + i0, ni, out,
                  static_cast<int>(i0));
    });
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(strip.data() + r * i0, strip.data() + (r + 1) * i0, a + (i0 + r) * n);
    }
  }
  return 0;
}

Status PotrfLower(double* a, int64_t n, const std::string& what, bool reversed) {
  const int info = TiledPotrfLower(a, n);
  if (info < 0) {
    return absl::InternalError(absl::StrCat(what, ": dpotrf argument ", -info, " invalid"));
  }
  if (info > 0) {
    const int64_t k = info;  // Leading minor of order k (of a) is not positive definite.
    if (!reversed) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": matrix is not positive definite: Cholesky failed at pivot ", k - 1,
          " (0-based; the leading ", k, "x", k,
          " principal minor is not positive definite). Damp the Hessian (DampHessian, e.g. "
          "delta = 0.01) or check it for rank deficiency."));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": matrix is not positive definite: Cholesky of the index-reversed matrix failed at "
        "original index ",
        n - k, " (the trailing ", k, "x", k, " principal minor, indices ", n - k, "..", n - 1,
        ", is not positive definite). Damp the Hessian (DampHessian, e.g. delta = 0.01) or check "
        "it for rank deficiency."));
  }
  for (int64_t i = 0; i < n; ++i) std::fill(a + i * n + i + 1, a + (i + 1) * n, 0.0);
  return absl::OkStatus();
}

// Turns a lower Cholesky factor C (in place) into the unit block lower L of L D Lᵀ for the block
// partition `starts` (ascending, starts[0] = 0, plus n as sentinel), returning each D block
// (w×w row-major) in `dblocks`.
void BlockLdlFromCholesky(double* c, int64_t n, const std::vector<int64_t>& starts,
                          std::vector<std::vector<double>>* dblocks) {
  dblocks->clear();
  std::vector<double> cb;
  for (size_t b = 0; b + 1 < starts.size(); ++b) {
    const int64_t s = starts[b], e = starts[b + 1], w = e - s;
    cb.assign(w * w, 0.0);
    for (int64_t i = 0; i < w; ++i) {
      for (int64_t j = 0; j <= i; ++j) cb[i * w + j] = c[(s + i) * n + s + j];
    }
    // D_b = C_b C_bᵀ.
    std::vector<double> db(w * w, 0.0);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(w), static_cast<int>(w),
                static_cast<int>(w), 1.0, cb.data(), static_cast<int>(w), cb.data(),
                static_cast<int>(w), 0.0, db.data(), static_cast<int>(w));
    for (int64_t i = 0; i < w; ++i) {  // Exactly symmetric.
      for (int64_t j = 0; j < i; ++j) db[j * w + i] = db[i * w + j];
    }
    dblocks->push_back(std::move(db));
    // L[s:n, s:e] = C[s:n, s:e] · C_b⁻¹.
    cblas_dtrsm(CblasRowMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit,
                static_cast<int>(n - s), static_cast<int>(w), 1.0, cb.data(), static_cast<int>(w),
                c + s * n + s, static_cast<int>(n));
    for (int64_t i = 0; i < w; ++i) {  // The diagonal block is I exactly.
      for (int64_t j = 0; j < w; ++j) c[(s + i) * n + s + j] = (i == j) ? 1.0 : 0.0;
    }
  }
}

// a ← P a P (index reversal of rows and columns, a 180° rotation), in place.
void Rotate180(double* a, int64_t n) {
  const int64_t total = n * n;
  for (int64_t i = 0; i < total / 2; ++i) std::swap(a[i], a[total - 1 - i]);
}

// a ← P aᵀ P, i.e. a[i][j] ↔ a[n-1-j][n-1-i] (transpose about the anti-diagonal), in place.
// Tiled so both sides of each swap stay in cache.
void AntiTranspose(double* a, int64_t n) {
  constexpr int64_t kTile = 64;
  for (int64_t ib = 0; ib < n; ib += kTile) {
    for (int64_t jb = 0; jb < n - ib; jb += kTile) {
      const int64_t ie = std::min(ib + kTile, n), je = std::min(jb + kTile, n);
      for (int64_t i = ib; i < ie; ++i) {
        for (int64_t j = jb; j < std::min(je, n - 1 - i); ++j) {
          std::swap(a[i * n + j], a[(n - 1 - j) * n + (n - 1 - i)]);
        }
      }
    }
  }
}

// A row-major copy of P h P.
std::vector<double> ReversedCopy(const double* h, int64_t n) {
  std::vector<double> r(n * n);
  for (int64_t i = 0; i < n; ++i) {
    const double* src = h + (n - 1 - i) * n;
    double* dst = r.data() + i * n;
    for (int64_t j = 0; j < n; ++j) dst[j] = src[n - 1 - j];
  }
  return r;
}

}  // namespace

StatusOr<double> DampHessian(double* h, int64_t n, double delta) {
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("damp: n = ", n, " must be > 0"));
  if (h == nullptr) return absl::InvalidArgumentError("damp: null matrix");
  if (!(delta >= 0.0) || !std::isfinite(delta)) {
    return absl::InvalidArgumentError(absl::StrCat("damp: delta = ", delta, " must be >= 0"));
  }
  double mean = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(h[i * n + i])) {
      return absl::InvalidArgumentError(absl::StrCat("damp: non-finite diagonal entry ", i));
    }
    mean += h[i * n + i];
  }
  mean /= static_cast<double>(n);
  const double add = delta * mean;
  for (int64_t i = 0; i < n; ++i) h[i * n + i] += add;
  return add;
}

Status CholeskyInPlace(double* a, int64_t n) {
  QCAL_RETURN_IF_ERROR(CheckSquare(a, n, "cholesky"));
  return PotrfLower(a, n, "cholesky", /*reversed=*/false);
}

StatusOr<std::vector<double>> Cholesky(const double* h, int64_t n) {
  QCAL_RETURN_IF_ERROR(CheckSquare(h, n, "cholesky"));
  std::vector<double> c(h, h + n * n);
  QCAL_RETURN_IF_ERROR(PotrfLower(c.data(), n, "cholesky", false));
  return c;
}

std::vector<double> BlockLdl::DenseD() const {
  std::vector<double> out(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = BlockStart(i);
    for (int64_t j = s; j < std::min(s + block, n); ++j) out[i * n + j] = d[i * block + (j - s)];
  }
  return out;
}

double BlockLdl::TraceD() const {
  double t = 0.0;
  for (int64_t i = 0; i < n; ++i) t += d[i * block + (i - BlockStart(i))];
  return t;
}

namespace {

// Reverses the index order of a square matrix in place: a[i][j] <-> a[n-1-i][n-1-j]
// (the in-place form of ReversedCopy: P A P with P the reversal permutation).
void ReverseInPlace(double* a, int64_t n) {
  std::reverse(a, a + n * n);
}

StatusOr<BlockLdl> BlockLdlDecomposeImpl(const double* h, std::vector<double>* owned, int64_t n,
                                         int64_t block, LdlForm form) {
  const char* what = form == LdlForm::kLDLt ? "block LDL (H = L D L^T)" : "block LDL (H = L^T D L)";
  if (block < 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": block = ", block, " must be >= 1"));
  }
  if (owned != nullptr && static_cast<int64_t>(owned->size()) != n * n) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the Hessian holds ", owned->size(),
                                                   " values, not n*n = ", n * n));
  }
  QCAL_RETURN_IF_ERROR(CheckSquare(h, n, what));
  BlockLdl f;
  f.n = n;
  f.block = std::min(block, n);
  f.form = form;
  const int64_t g = f.block;
  f.d.assign(n * g, 0.0);
  std::vector<std::vector<double>> dblocks;

  if (form == LdlForm::kLDLt) {
    if (owned != nullptr) {
      f.L = std::move(*owned);
    } else {
      f.L.assign(h, h + n * n);
    }
    QCAL_RETURN_IF_ERROR(PotrfLower(f.L.data(), n, what, false));
    std::vector<int64_t> starts;
    for (int64_t s = 0; s < n; s += g) starts.push_back(s);
    starts.push_back(n);
    BlockLdlFromCholesky(f.L.data(), n, starts, &dblocks);
    for (size_t b = 0; b + 1 < starts.size(); ++b) {
      const int64_t s = starts[b], w = starts[b + 1] - s;
      for (int64_t i = 0; i < w; ++i) {
        for (int64_t j = 0; j < w; ++j) f.d[(s + i) * g + j] = dblocks[b][i * w + j];
      }
    }
    return f;
  }

  // kLtDL: factor P H P (index reversal) as L' D' L'ᵀ, then L = P L'ᵀ P, D = P D' P.
  if (owned != nullptr) {
    f.L = std::move(*owned);
    ReverseInPlace(f.L.data(), n);
  } else {
    f.L = ReversedCopy(h, n);
  }
  QCAL_RETURN_IF_ERROR(PotrfLower(f.L.data(), n, what, /*reversed=*/true));
  // Original blocks [s, e) become [n - e, n - s) in reversed order.
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < n; s += g) starts.push_back(n - std::min(s + g, n));
  std::reverse(starts.begin(), starts.end());
  starts.push_back(n);
  BlockLdlFromCholesky(f.L.data(), n, starts, &dblocks);
  AntiTranspose(f.L.data(), n);  // L[i][j] = L'[n-1-j][n-1-i].
  for (size_t b = 0; b + 1 < starts.size(); ++b) {
    const int64_t rs = starts[b], w = starts[b + 1] - rs;
    const int64_t s = n - (rs + w);  // Original start of this block.
    for (int64_t i = 0; i < w; ++i) {
      for (int64_t j = 0; j < w; ++j) {
        // D(s+i, s+j) = D'(n-1-(s+i), n-1-(s+j)) = D'_b(w-1-i, w-1-j).
        f.d[(s + i) * g + j] = dblocks[b][(w - 1 - i) * w + (w - 1 - j)];
      }
    }
  }
  return f;
}

}  // namespace

StatusOr<BlockLdl> BlockLdlDecompose(const double* h, int64_t n, int64_t block, LdlForm form) {
  return BlockLdlDecomposeImpl(h, nullptr, n, block, form);
}

StatusOr<BlockLdl> BlockLdlDecompose(std::vector<double>&& h, int64_t n, int64_t block,
                                     LdlForm form) {
  return BlockLdlDecomposeImpl(h.data(), &h, n, block, form);
}

namespace {

// InverseCholeskyUpper on `a` = P H P (the reversed H), in place.
StatusOr<std::vector<double>> InverseCholeskyUpperReversed(std::vector<double> a, int64_t n) {
  // GPTQ computes chol(H) -> H⁻¹ -> chol(H⁻¹, upper). The factor is unique (upper triangular,
  // positive diagonal), so we get it more cheaply: with C' = chol(P H P) lower, H = U Uᵀ for the
  // upper triangular U = P C' P, hence H⁻¹ = U⁻ᵀ U⁻¹ and R = U⁻¹ = P C'⁻¹ P.
  // Cost n³/3 (potrf) + n³/3 (trtri) instead of 4n³/3.
  const char* what = "GPTQ inverse Cholesky";
  QCAL_RETURN_IF_ERROR(PotrfLower(a.data(), n, what, /*reversed=*/true));
  // C'⁻¹ in place (row-major lower), tiled on qcal's threads.
  const int info = TiledTrtriLower(a.data(), n);
  if (info != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": triangular inverse failed (zero diagonal at reversed index ",
                     info - 1, "): H is singular"));
  }
  Rotate180(a.data(), n);
  return a;
}

}  // namespace

Status InverseCholeskyUpperKeepingLower(double* h, int64_t n) {
  const char* what = "GPTQ inverse Cholesky";
  QCAL_RETURN_IF_ERROR(CheckSquare(h, n, what));
  // The steps of InverseCholeskyUpperReversed on a = P h P in place. Its potrf reads and writes
  // only a's lower triangle (h's upper, reflected) and leaves a's strict upper (h's strict lower)
  // alone; its triangular inverse reads the strict upper parts of the kCholeskyTile diagonal tiles
  // as zeros, so only those are saved and zeroed (the copying form zeroes all of it: same bits).
  ReverseInPlace(h, n);
  const int potrf = TiledPotrfLower(h, n);
  if (potrf != 0) {
    Rotate180(h, n);  // back: the strict lower is h's again
    if (potrf < 0) {
      return absl::InternalError(absl::StrCat(what, ": dpotrf argument ", -potrf, " invalid"));
    }
    const int64_t k = potrf;
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": matrix is not positive definite: Cholesky of the index-reversed matrix failed at "
        "original index ",
        n - k, " (the trailing ", k, "x", k, " principal minor, indices ", n - k, "..", n - 1,
        ", is not positive definite). Damp the Hessian (DampHessian, e.g. delta = 0.01) or check "
        "it for rank deficiency."));
  }
  std::vector<double> saved;  // the diagonal tiles' strict upper parts, row by row
  saved.reserve(static_cast<size_t>(n) * (kCholeskyTile - 1) / 2 + 1);
  for (int64_t k0 = 0; k0 < n; k0 += kCholeskyTile) {
    const int64_t k1 = std::min(k0 + kCholeskyTile, n);
    for (int64_t i = k0; i < k1; ++i) {
      for (int64_t j = i + 1; j < k1; ++j) {
        saved.push_back(h[i * n + j]);
        h[i * n + j] = 0.0;
      }
    }
  }
  const int trtri = TiledTrtriLower(h, n);
  Rotate180(h, n);
  size_t s = 0;  // a's (i, j) is now at (n-1-i, n-1-j)
  for (int64_t k0 = 0; k0 < n; k0 += kCholeskyTile) {
    const int64_t k1 = std::min(k0 + kCholeskyTile, n);
    for (int64_t i = k0; i < k1; ++i) {
      for (int64_t j = i + 1; j < k1; ++j) h[(n - 1 - i) * n + (n - 1 - j)] = saved[s++];
    }
  }
  if (trtri != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": triangular inverse failed (zero diagonal at reversed index ",
                     trtri - 1, "): H is singular"));
  }
  return absl::OkStatus();
}

StatusOr<std::vector<double>> InverseCholeskyUpper(const double* h, int64_t n) {
  QCAL_RETURN_IF_ERROR(CheckSquare(h, n, "GPTQ inverse Cholesky"));
  return InverseCholeskyUpperReversed(ReversedCopy(h, n), n);
}

StatusOr<std::vector<double>> InverseCholeskyUpper(std::vector<double>&& h, int64_t n) {
  if (static_cast<int64_t>(h.size()) != n * n) {
    return absl::InvalidArgumentError(absl::StrCat("GPTQ inverse Cholesky: ", h.size(),
                                                   " values for an ", n, "x", n, " matrix"));
  }
  QCAL_RETURN_IF_ERROR(CheckSquare(h.data(), n, "GPTQ inverse Cholesky"));
  std::vector<double> a = std::move(h);
  ReverseInPlace(a.data(), n);
  return InverseCholeskyUpperReversed(std::move(a), n);
}

std::vector<double> MultiplyLLt(const std::vector<double>& c, int64_t n) {
  std::vector<double> out(n * n, 0.0);
  const int ni = static_cast<int>(n);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ni, ni, 1.0, c.data(), ni, c.data(), ni,
              0.0, out.data(), ni);
  return out;
}

std::vector<double> ReconstructLdl(const BlockLdl& f) {
  const int ni = static_cast<int>(f.n);
  const std::vector<double> d = f.DenseD();
  std::vector<double> tmp(f.n * f.n, 0.0), out(f.n * f.n, 0.0);
  if (f.form == LdlForm::kLDLt) {  // (L D) Lᵀ.
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0, f.L.data(), ni,
                d.data(), ni, 0.0, tmp.data(), ni);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ni, ni, 1.0, tmp.data(), ni,
                f.L.data(), ni, 0.0, out.data(), ni);
  } else {  // (Lᵀ D) L.
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ni, ni, ni, 1.0, f.L.data(), ni, d.data(),
                ni, 0.0, tmp.data(), ni);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0, tmp.data(), ni,
                f.L.data(), ni, 0.0, out.data(), ni);
  }
  return out;
}

double RelativeFrobeniusError(const double* a, const double* b, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n * n; ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace qcal::kernels
