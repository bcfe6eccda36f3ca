// Refinement sweeps after a rounding pass (kernels/rounding.h, RefineRounding).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cpu.h"
#include "kernels/blas_threads.h"
#include "kernels/rounding.h"

namespace qcal::kernels {
namespace {

// Rounds g-blocks of consecutive rows to the codebook and commits kept ones. Round may be
// called from several threads at once for disjoint rows; Commit is called for distinct rows.
class BlockRounder {
 public:
  virtual ~BlockRounder() = default;
  virtual int code_words() const = 0;
  // Rows that move together (a joint codebook's tile height; 1 otherwise).
  virtual int joint_rows() const { return 1; }
  // targets, points: [count, g] for rows row0.., block columns k..k+g; codes: [count, words].
  virtual void Round(int64_t row0, int64_t k, int64_t count, const double* targets,
                     double* points, uint32_t* codes) const = 0;
  virtual void Commit(int64_t row, int64_t k, const uint32_t* codes) = 0;
};

// Inverse of the SPD g×g matrix a (row-major) by Gauss-Jordan without pivoting (positive
// definite: the pivots are positive). False if a pivot is not.
bool InvertSpd(std::vector<double> a, int64_t g, double* inv) {
  for (int64_t i = 0; i < g * g; ++i) inv[i] = 0.0;
  for (int64_t i = 0; i < g; ++i) inv[i * g + i] = 1.0;
  for (int64_t c = 0; c < g; ++c) {
    const double p = a[c * g + c];
    if (!(p > 0.0) || !std::isfinite(p)) return false;
    for (int64_t j = 0; j < g; ++j) {
      a[c * g + j] /= p;
      inv[c * g + j] /= p;
    }
    for (int64_t r = 0; r < g; ++r) {
      if (r == c) continue;
      const double f = a[r * g + c];
      if (f == 0.0) continue;
      for (int64_t j = 0; j < g; ++j) {
        a[r * g + j] -= f * a[c * g + j];
        inv[r * g + j] -= f * inv[c * g + j];
      }
    }
  }
  return true;
}

Status CheckRefineArgs(const double* w, const double* h, int64_t m, int64_t n, int sweeps,
                       double damp, int num_threads) {
  if (w == nullptr || h == nullptr || m <= 0 || n <= 0) {
    return absl::InvalidArgumentError("refine: need W [m, n] and H [n, n] with m, n > 0");
  }
  if (sweeps < 0 || num_threads < 0 || !(damp >= 0.0) || !std::isfinite(damp)) {
    return absl::InvalidArgumentError(absl::StrCat("refine: sweeps = ", sweeps, ", damp = ",
                                                   damp, ", num_threads = ", num_threads,
                                                   " (each must be >= 0)"));
  }
  return absl::OkStatus();
}

// The sweeps on Ŵ (w_hat, [m, n], updated in place) against W and H, g columns per block.
RefineStats Refine(const double* W, double* What, int64_t m, int64_t n, const double* H, int64_t g,
                   int sweeps, double damp, int64_t lazy_block, int num_threads,
                   BlockRounder& rounder) {
  const int64_t joint = rounder.joint_rows();
  RefineStats stats;
  // C = (Ŵ − W)H and each row's loss, in row tasks (one [128, n] temporary each).
  std::vector<double> C(m * n);
  std::vector<double> row_loss(m, 0.0);
  PinBlasToOneThread();  // every dgemm below runs on one row task's thread
  constexpr int64_t kRowsPerTask = 128;
  const int64_t tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  qcal::ParallelTasks(tasks, num_threads, [&](int64_t task) {
    {
      const int64_t r0 = task * kRowsPerTask;
      const int64_t rc = std::min(kRowsPerTask, m - r0);
      std::vector<double> e(rc * n);
      for (int64_t i = 0; i < rc * n; ++i) e[i] = What[r0 * n + i] - W[r0 * n + i];
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rc),
                  static_cast<int>(n), static_cast<int>(n), 1.0, e.data(), static_cast<int>(n), H,
                  static_cast<int>(n), 0.0, &C[r0 * n], static_cast<int>(n));
      for (int64_t r = 0; r < rc; ++r) {
        double s = 0.0;
        for (int64_t j = 0; j < n; ++j) s += e[r * n + j] * C[(r0 + r) * n + j];
        row_loss[r0 + r] = s;
      }
    }
  });
  for (double l : row_loss) stats.loss_before += l;
  stats.loss_after = stats.loss_before;
  double mean_diag = 0.0;
  for (int64_t i = 0; i < n; ++i) mean_diag += H[i * n + i];
  mean_diag /= static_cast<double>(n);
  if (sweeps == 0 || !(mean_diag > 0.0)) return stats;

  // (H_kk + λI)⁻¹ for every block.
  const int64_t blocks = n / g;
  const double lambda = std::max(damp, 1e-6) * mean_diag;
  std::vector<double> hinv(blocks * g * g);
  {
    std::vector<double> a(g * g);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k = b * g;
      for (int64_t i = 0; i < g; ++i) {
        for (int64_t j = 0; j < g; ++j) a[i * g + j] = H[(k + i) * n + k + j];
        a[i * g + i] += lambda;
      }
      if (!InvertSpd(a, g, &hinv[b * g * g])) {
        // Not SPD even with λ (H is not PSD there): never move this block.
        std::fill(&hinv[b * g * g], &hinv[(b + 1) * g * g], 0.0);
      }
    }
  }

  const int64_t B = ((std::max<int64_t>(1, lazy_block) + g - 1) / g) * g;
  std::vector<double> D(m * B);  // kept changes in the current lazy block
  const int cw = rounder.code_words();
  constexpr double kRelTol = 1e-12;

  auto sweep_rows = [&](int64_t r0, int64_t r1, int64_t b0, int64_t b1, int64_t* kept) {
    const int64_t rc = r1 - r0, bw = b1 - b0;
    if (rc <= 0) return;
    std::vector<double> targets(rc * g), points(rc * g), d(joint * g), unit_delta(joint);
    std::vector<uint32_t> codes(rc * cw);
    for (int64_t r = r0; r < r1; ++r) std::fill(&D[r * B], &D[r * B] + bw, 0.0);
    for (int64_t k = b0; k < b1; k += g) {
      const double* hi = &hinv[(k / g) * g * g];
      for (int64_t r = 0; r < rc; ++r) {
        const double* c = &C[(r0 + r) * n + k];
        const double* wh = &What[(r0 + r) * n + k];
        for (int64_t j = 0; j < g; ++j) {
          double s = 0.0;
          for (int64_t i = 0; i < g; ++i) s += c[i] * hi[i * g + j];
          targets[r * g + j] = wh[j] - s;
        }
      }
      rounder.Round(r0, k, rc, targets.data(), points.data(), codes.data());
      // Rows move together in units of `joint` (a trellis tile's rows share one code stream):
      // a unit's new points are kept only if they lower the sum of its rows' losses.
      for (int64_t u = 0; u < rc; u += joint) {
        const int64_t u1 = std::min(rc, u + joint);  // a matrix's last tile may be short
        bool moved = false;
        for (int64_t r = u; r < u1; ++r) {
          const double* wh = &What[(r0 + r) * n + k];
          for (int64_t j = 0; j < g; ++j) moved |= points[r * g + j] != wh[j];
        }
        if (!moved) continue;
        double delta = 0.0, unit_loss = 0.0;
        for (int64_t r = u; r < u1; ++r) {
          const int64_t row = r0 + r;
          const double* wh = &What[row * n + k];
          const double* c = &C[row * n];
          for (int64_t j = 0; j < g; ++j) d[(r - u) * g + j] = points[r * g + j] - wh[j];
          const double* dr = &d[(r - u) * g];
          double row_delta = 0.0;
          for (int64_t i = 0; i < g; ++i) {
            double hd = 0.0;
            for (int64_t j = 0; j < g; ++j) hd += H[(k + i) * n + k + j] * dr[j];
            row_delta += dr[i] * (2.0 * c[k + i] + hd);
          }
          unit_delta[r - u] = row_delta;
          delta += row_delta;
          unit_loss += row_loss[row];
        }
        if (!(delta < -kRelTol * std::max(unit_loss, 0.0))) continue;
        for (int64_t r = u; r < u1; ++r) {
          const int64_t row = r0 + r;
          double* wh = &What[row * n + k];
          double* c = &C[row * n];
          const double* dr = &d[(r - u) * g];
          row_loss[row] += unit_delta[r - u];
          for (int64_t j = 0; j < g; ++j) {
            wh[j] = points[r * g + j];
            D[row * B + (k - b0) + j] += dr[j];
          }
          // C[row, b0:b1] += d · H[k:k+g, b0:b1] (the rest of the row after the lazy block).
          for (int64_t i = 0; i < g; ++i) {
            if (dr[i] == 0.0) continue;
            const double* hrow = &H[(k + i) * n];
            for (int64_t j = b0; j < b1; ++j) c[j] += dr[i] * hrow[j];
          }
          rounder.Commit(row, k, &codes[r * cw]);
          ++*kept;
        }
      }
    }
  };

  // Rows are independent: each task sweeps its rows through the lazy block, then brings the
  // kept changes D into the rest of its rows of C (two single-threaded dgemms), so the bits do not
  // depend on the thread count.
  for (int s = 0; s < sweeps; ++s) {
    int64_t kept_this_sweep = 0;
    for (int64_t b0 = 0; b0 < n; b0 += B) {
      const int64_t b1 = std::min(b0 + B, n), bw = b1 - b0;
      std::vector<int64_t> kept(tasks, 0);
      qcal::ParallelTasks(tasks, num_threads, [&](int64_t task) {
        const int64_t r0 = task * kRowsPerTask, r1 = std::min(m, r0 + kRowsPerTask);
        sweep_rows(r0, r1, b0, b1, &kept[task]);
        if (kept[task] == 0) return;
        const int rc = static_cast<int>(r1 - r0);
        // C[rows, outside b0:b1] += D[rows] · H[b0:b1, outside].
        if (b0 > 0) {
          cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rc, static_cast<int>(b0),
                      static_cast<int>(bw), 1.0, &D[r0 * B], static_cast<int>(B), &H[b0 * n],
                      static_cast<int>(n), 1.0, &C[r0 * n], static_cast<int>(n));
        }
        if (b1 < n) {
          cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rc, static_cast<int>(n - b1),
                      static_cast<int>(bw), 1.0, &D[r0 * B], static_cast<int>(B),
                      &H[b0 * n + b1], static_cast<int>(n), 1.0, &C[r0 * n + b1],
                      static_cast<int>(n));
        }
      });
      for (int64_t v : kept) kept_this_sweep += v;
    }
    stats.sweeps = s + 1;
    stats.changed += kept_this_sweep;
    if (kept_this_sweep == 0) break;
  }
  stats.loss_after = 0.0;
  for (double l : row_loss) stats.loss_after += l;
  return stats;
}

class ScalarRounder final : public BlockRounder {
 public:
  ScalarRounder(const ScalarQuantConfig& q, ScalarRoundingResult* res)
      : res_(res), cmin_(ScalarCodeMin(q)), cmax_(ScalarCodeMax(q)) {}
  int code_words() const override { return 1; }
  void Round(int64_t row0, int64_t k, int64_t count, const double* targets, double* points,
             uint32_t* codes) const override {
    for (int64_t r = 0; r < count; ++r) {
      const ScalarQuantParams<double> p = res_->params(row0 + r, k);
      const int32_t code = ScalarQuantizeCode(targets[r], p, cmin_, cmax_);
      codes[r] = static_cast<uint32_t>(code);
      points[r] = ScalarDequantizeCode(code, p);
    }
  }
  void Commit(int64_t row, int64_t k, const uint32_t* codes) override {
    res_->codes[row * res_->cols + k] = static_cast<int32_t>(codes[0]);
  }

 private:
  ScalarRoundingResult* res_;
  int32_t cmin_, cmax_;
};

class VectorRounder final : public BlockRounder {
 public:
  VectorRounder(const VectorCodebook& cb, VectorRoundingResult* res) : cb_(cb), res_(res) {}
  int code_words() const override { return cb_.code_words(); }
  int joint_rows() const override { return cb_.joint_vectors(); }
  void Round(int64_t, int64_t, int64_t count, const double* targets, double* points,
             uint32_t* codes) const override {
    const int64_t g = cb_.dim();
    std::vector<float> in(count * g), out(count * g);
    for (int64_t i = 0; i < count * g; ++i) in[i] = static_cast<float>(targets[i] / res_->scale);
    cb_.Quantize(in.data(), count, out.data(), codes);
    for (int64_t i = 0; i < count * g; ++i) points[i] = res_->scale * static_cast<double>(out[i]);
  }
  void Commit(int64_t row, int64_t k, const uint32_t* codes) override {
    const int64_t g = cb_.dim(), cw = cb_.code_words();
    std::copy(codes, codes + cw, &res_->codes[(row * (res_->cols / g) + k / g) * cw]);
  }

 private:
  const VectorCodebook& cb_;
  VectorRoundingResult* res_;
};

}  // namespace

StatusOr<RefineStats> RefineRounding(const double* w, const double* h, int sweeps, double damp,
                                     int64_t lazy_block, int num_threads,
                                     const ScalarQuantConfig& quant, ScalarRoundingResult* res) {
  const int64_t m = res->rows, n = res->cols;
  QCAL_RETURN_IF_ERROR(CheckRefineArgs(w, h, m, n, sweeps, damp, num_threads));
  if (static_cast<int64_t>(res->w_hat.size()) != m * n ||
      static_cast<int64_t>(res->codes.size()) != m * n) {
    return absl::InvalidArgumentError("refine: the rounding result is incomplete");
  }
  ScalarRounder rounder(quant, res);
  res->refine = Refine(w, res->w_hat.data(), m, n, h, 1, sweeps, damp, lazy_block, num_threads,
                       rounder);
  return res->refine;
}

StatusOr<RefineStats> RefineRounding(const double* w, const double* h, int sweeps, double damp,
                                     int64_t lazy_block, int num_threads,
                                     const VectorCodebook& codebook, VectorRoundingResult* res) {
  const int64_t m = res->rows, n = res->cols, g = codebook.dim();
  QCAL_RETURN_IF_ERROR(CheckRefineArgs(w, h, m, n, sweeps, damp, num_threads));
  if (g != res->dim || n % g != 0 || static_cast<int64_t>(res->w_hat.size()) != m * n ||
      static_cast<int64_t>(res->codes.size()) != m * (n / g) * codebook.code_words() ||
      !(res->scale > 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refine: the rounding result does not match codebook '", codebook.name(), "'"));
  }
  VectorRounder rounder(codebook, res);
  res->refine = Refine(w, res->w_hat.data(), m, n, h, g, sweeps, damp, lazy_block, num_threads,
                       rounder);
  return res->refine;
}

}  // namespace qcal::kernels
