#include "kernels/rounding.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include "common/cpu.h"
#include "kernels/blas_threads.h"
#include "kernels/linalg.h"

namespace qcal::kernels {
namespace {

Status CheckWeights(const double* w, int64_t rows, int64_t cols, const char* what) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", rows, ", ", cols, "] must be positive"));
  }
  if (w == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null weights"));
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": non-finite weight at (", i / cols, ", ", i % cols, ")"));
    }
  }
  return absl::OkStatus();
}

Status CheckHessian(const double* h, int64_t n, const char* what) {
  if (h == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null Hessian"));
  for (int64_t i = 0; i < n * n; ++i) {
    if (!std::isfinite(h[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": non-finite Hessian entry at (", i / n, ", ", i % n, ")"));
    }
  }
  return absl::OkStatus();
}

// W and H after GPTQ's preparation, in processing (permuted) order.
struct Prepared {
  std::vector<double> w;      // [m, n], permuted columns, dead columns zeroed.
  std::vector<double> h;      // [n, n], permuted, dead diagonals 1, damped.
  std::vector<int64_t> perm;  // perm[k] = original column at position k.
};

// GPTQ's column order: act order sorts by descending diagonal (dead columns counted as 1),
// stable; otherwise the identity. perm[k] = original column at position k.
std::vector<int64_t> GptqOrder(const double* h, int64_t n, bool act_order) {
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), int64_t{0});
  if (act_order) {
    std::vector<double> diag(n);
    for (int64_t i = 0; i < n; ++i) diag[i] = h[i * n + i] == 0.0 ? 1.0 : h[i * n + i];
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int64_t a, int64_t b) { return diag[a] > diag[b]; });
  }
  return perm;
}

// W's columns in processing order, dead columns (H_jj = 0) zeroed.
std::vector<double> PermutedWeights(const double* w, int64_t m, int64_t n, const double* h,
                                    const std::vector<int64_t>& perm) {
  std::vector<double> out(m * n);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = perm[k];
      out[r * n + k] = h[j * n + j] == 0.0 ? 0.0 : w[r * n + j];
    }
  }
  return out;
}

StatusOr<Prepared> Prepare(const double* w, int64_t m, int64_t n, const double* h, double damp,
                           bool act_order, const char* what) {
  Prepared p;
  p.perm = GptqOrder(h, n, act_order);
  p.w = PermutedWeights(w, m, n, h, p.perm);
  p.h.resize(n * n);
  for (int64_t a = 0; a < n; ++a) {
    const int64_t i = p.perm[a];
    for (int64_t b = 0; b < n; ++b) p.h[a * n + b] = h[i * n + p.perm[b]];
    if (h[i * n + i] == 0.0) p.h[a * n + a] = 1.0;
  }
  auto added = DampHessian(p.h.data(), n, damp);
  if (!added.ok()) return Annotate(added.status(), what);
  return p;
}

// a ← P a Pᵀ in place for the [n, n] row-major a, with to[k] the new index of old index k
// (rows moved along the permutation's cycles through one row of scratch, then each row's
// columns through another). Exact (moves only).
void PermuteSymmetricInPlace(double* a, int64_t n, const std::vector<int64_t>& to,
                             int num_threads) {
  std::vector<double> row(n), tmp(n);
  std::vector<char> done(n, 0);
  for (int64_t s = 0; s < n; ++s) {  // new row to[k] = old row k
    if (done[s] || to[s] == s) continue;
    std::copy(a + s * n, a + (s + 1) * n, row.data());  // old row s, bound for to[s]
    int64_t k = s;
    while (true) {
      const int64_t dst = to[k];
      done[k] = 1;
      if (dst == s) {
        std::copy(row.begin(), row.end(), a + s * n);
        break;
      }
      std::copy(a + dst * n, a + (dst + 1) * n, tmp.data());
      std::copy(row.begin(), row.end(), a + dst * n);
      row.swap(tmp);
      k = dst;
    }
  }
  constexpr int64_t kRowsPerTask = 64;
  qcal::ParallelTasks((n + kRowsPerTask - 1) / kRowsPerTask, num_threads, [&](int64_t t) {
    std::vector<double> r(n);
    for (int64_t i = t * kRowsPerTask; i < std::min(n, (t + 1) * kRowsPerTask); ++i) {
      double* ai = a + i * n;
      for (int64_t k = 0; k < n; ++k) r[to[k]] = ai[k];
      std::copy(r.begin(), r.end(), ai);
    }
  });
}

// Fills the strict upper triangle of a from its strict lower one (a ← tril(a) + tril(a, −1)ᵀ),
// in tiles.
void MirrorLowerToUpper(double* a, int64_t n, int num_threads) {
  constexpr int64_t kTile = 64;
  const int64_t tiles = (n + kTile - 1) / kTile;
  qcal::ParallelTasks(tiles, num_threads, [&](int64_t ti) {  // tile row ti of the upper part
    const int64_t i0 = ti * kTile, i1 = std::min(n, i0 + kTile);
    for (int64_t j0 = i0; j0 < n; j0 += kTile) {
      const int64_t j1 = std::min(n, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = std::max(j0, i + 1); j < j1; ++j) a[i * n + j] = a[j * n + i];
      }
    }
  });
}

// The lazy block for grouped grids: a multiple of the group size so that a group never straddles
// two lazy blocks (see the header).
int64_t EffectiveLazyBlock(int64_t lazy, const ScalarQuantConfig& q, int64_t n) {
  int64_t b = std::max<int64_t>(1, lazy);
  if (q.granularity == QuantGranularity::kPerGroup) {
    const int64_t g = std::min(q.group_size, n);
    b = b >= g ? (b / g) * g : g;
  }
  return b;
}

Status ValidateScalarRounding(const double* w, int64_t m, int64_t n, const double* h,
                              const ScalarRoundingConfig& c, const char* what) {
  QCAL_RETURN_IF_ERROR(CheckWeights(w, m, n, what));
  QCAL_RETURN_IF_ERROR(CheckHessian(h, n, what));
  QCAL_RETURN_IF_ERROR(ValidateScalarQuantConfig(c.quant));
  if (c.quant.granularity == QuantGranularity::kPerToken) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": per-token granularity is for activations; use per-channel for weights"));
  }
  if (!(c.damp >= 0.0) || !std::isfinite(c.damp)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": damp = ", c.damp, " must be >= 0"));
  }
  if (c.lazy_block < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": lazy_block = ", c.lazy_block, " must be >= 1"));
  }
  if (c.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": num_threads = ", c.num_threads, " must be >= 0 (0: all CPUs)"));
  }
  return absl::OkStatus();
}

// Result skeleton with parameter shapes; per-tensor / per-channel parameters are filled from
// the caller's (original) W, as GPTQ's find_params(W) before fasterquant.
// Per-channel parameters are found row by row in parallel (clip search with norm 2.4 is a pow()
// per weight and grid point: about 380 s single-threaded at 8192 × 28672); each row's result
// does not depend on the thread count.
ScalarRoundingResult InitScalarResult(const double* w, int64_t m, int64_t n,
                                      const ScalarQuantConfig& q, std::vector<int64_t> perm,
                                      int num_threads) {
  ScalarRoundingResult res;
  res.rows = m;
  res.cols = n;
  res.perm = std::move(perm);
  res.g_idx.assign(n, 0);
  switch (q.granularity) {
    case QuantGranularity::kPerTensor: {
      res.param_rows = 1;
      res.param_cols = 1;
      const ScalarQuantParams<double> p = ComputeScalarQuantParams(w, m * n, q);
      res.scales = {p.scale};
      res.zeros = {p.zero};
      break;
    }
    case QuantGranularity::kPerChannel:
    case QuantGranularity::kPerToken:
      res.param_rows = m;
      res.param_cols = 1;
      res.scales.resize(m);
      res.zeros.resize(m);
      qcal::ParallelTasks(m, num_threads, [&](int64_t r) {
        const ScalarQuantParams<double> p = ComputeScalarQuantParams(w + r * n, n, q);
        res.scales[r] = p.scale;
        res.zeros[r] = p.zero;
      });
      break;
    case QuantGranularity::kPerGroup: {
      const int64_t g = std::min(q.group_size, n);
      res.param_rows = m;
      res.param_cols = (n + g - 1) / g;
      res.scales.assign(m * res.param_cols, 1.0);
      res.zeros.assign(m * res.param_cols, 0);
      for (int64_t k = 0; k < n; ++k) res.g_idx[res.perm[k]] = static_cast<int32_t>(k / g);
      break;
    }
  }
  return res;
}

// Codes are produced in processing order; store them in original order and rebuild Ŵ.
void FinishScalarResult(const std::vector<int32_t>& codes_perm, ScalarRoundingResult* res) {
  const int64_t m = res->rows, n = res->cols;
  res->codes.resize(m * n);
  res->w_hat.resize(m * n);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = res->perm[k];
      const int32_t code = codes_perm[r * n + k];
      res->codes[r * n + j] = code;
      res->w_hat[r * n + j] = ScalarDequantizeCode(code, res->params(r, j));
    }
  }
}

ScalarQuantParams<double> ParamsAt(const ScalarRoundingResult& res, int64_t r, int64_t group) {
  const int64_t k = (res.param_rows == 1 ? 0 : r) * res.param_cols + group;
  return {res.scales[k], res.zeros[k], 1.0};
}

void SetParams(ScalarRoundingResult* res, int64_t r, int64_t group,
               const ScalarQuantParams<double>& p) {
  const int64_t k = r * res->param_cols + group;
  res->scales[k] = p.scale;
  res->zeros[k] = p.zero;
}

double RmsOf(const double* w, int64_t count) {
  double s = 0.0;
  for (int64_t i = 0; i < count; ++i) s += w[i] * w[i];
  return std::sqrt(s / static_cast<double>(count));
}

Status ValidateVectorRounding(const double* w, int64_t m, int64_t n, const VectorCodebook& cb,
                              int num_threads, const char* what) {
  QCAL_RETURN_IF_ERROR(CheckWeights(w, m, n, what));
  if (num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": num_threads = ", num_threads, " must be >= 0"));
  }
  const int g = cb.dim();
  if (g < 1 || cb.code_words() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": codebook '", cb.name(), "' has dim ", g,
                                                   ", code_words ", cb.code_words()));
  }
  if (n % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cols = ", n,
                                                   " is not a multiple of the codebook dim ", g,
                                                   " ('", cb.name(), "')"));
  }
  // Joint codebooks code tiles of joint_vectors() rows; BlockLDLQ's and the sweeps' row tasks
  // (32 and 128 rows) must hold whole tiles, so only the matrix's last tile may be short.
  const int joint = cb.joint_vectors();
  if (joint < 1 || 32 % joint != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": codebook '", cb.name(), "' codes ",
                                                   joint, " rows together (need a divisor of 32)"));
  }
  return Annotate(cb.CheckRows(m), what);
}

StatusOr<double> ResolveScale(const double* w, int64_t count, const VectorCodebook& cb,
                              double scale, const char* what) {
  if (scale == 0.0) {
    const double rms = RmsOf(w, count);
    scale = rms > 0.0 ? rms / cb.default_scale() : 1.0;
  }
  if (!(scale > 0.0) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": scale = ", scale, " must be positive and finite"));
  }
  return scale;
}

// codebook.Quantize over `count` vectors, split into contiguous chunks across threads.
void QuantizeVectors(const VectorCodebook& cb, const float* in, int64_t count, float* out,
                     uint32_t* codes, int num_threads) {
  constexpr int64_t kMinVectorsPerThread = 256;
  int threads = num_threads > 0
                    ? num_threads
                    : qcal::AvailableCpus();
  threads = static_cast<int>(
      std::min<int64_t>(threads, (count + kMinVectorsPerThread - 1) / kMinVectorsPerThread));
  if (threads <= 1) {
    cb.Quantize(in, count, out, codes);
    return;
  }
  const int64_t dim = cb.dim(), cw = cb.code_words(), joint = cb.joint_vectors();
  // Chunks of whole joint units (tiles), so the split never cuts one.
  const int64_t chunk = ((count + threads - 1) / threads + joint - 1) / joint * joint;
  auto run = [&](int64_t begin) {
    const int64_t len = std::min(chunk, count - begin);
    if (len > 0) {
      cb.Quantize(in + begin * dim, len, out + begin * dim, codes ? codes + begin * cw : nullptr);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(run, t * chunk);
  run(0);
  for (auto& th : pool) th.join();
}

}  // namespace

namespace {

// Σ_r e_r H e_rᵀ with e = w_hat − w (w_hat null: e = −w), 256 rows at a time.
double QuadraticSum(const double* w, const double* w_hat, const double* h, int64_t rows,
                    int64_t cols) {
  const int64_t chunk = 256;
  const int n = static_cast<int>(cols);
  std::vector<double> e, eh;
  double total = 0.0;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t rc = std::min(chunk, rows - r0);
    e.resize(rc * cols);
    eh.resize(rc * cols);
    for (int64_t i = 0; i < rc * cols; ++i) {
      e[i] = (w_hat != nullptr ? w_hat[r0 * cols + i] : 0.0) - w[r0 * cols + i];
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rc), n, n, 1.0,
                e.data(), n, h, n, 0.0, eh.data(), n);
    for (int64_t i = 0; i < rc * cols; ++i) total += e[i] * eh[i];
  }
  return total;
}

}  // namespace

double ProxyLoss(const double* w, const double* w_hat, const double* h, int64_t rows,
                 int64_t cols) {
  return QuadraticSum(w, w_hat, h, rows, cols);
}

double QuadraticForm(const double* a, const double* h, int64_t rows, int64_t cols) {
  return QuadraticSum(a, nullptr, h, rows, cols);
}

StatusOr<ScalarRoundingResult> RoundToNearest(const double* w, int64_t rows, int64_t cols,
                                              const ScalarQuantConfig& quant, int num_threads) {
  if (quant.granularity == QuantGranularity::kPerToken) {
    return absl::InvalidArgumentError(
        "rtn: per-token granularity is for activations; use per-channel for weights");
  }
  QCAL_ASSIGN_OR_RETURN(ScalarQuantized<double> q,
                        QuantizeScalar(w, rows, cols, quant, num_threads));
  ScalarRoundingResult res;
  res.rows = rows;
  res.cols = cols;
  res.param_rows = q.param_rows;
  res.param_cols = q.param_cols;
  res.w_hat = std::move(q.values);
  res.codes = std::move(q.codes);
  res.scales = std::move(q.scales);
  res.zeros = std::move(q.zeros);
  res.g_idx.resize(cols);
  res.perm.resize(cols);
  for (int64_t j = 0; j < cols; ++j) {
    res.g_idx[j] = static_cast<int32_t>(j / q.group_cols);
    res.perm[j] = j;
  }
  return res;
}

// Rows per task of GPTQ's and LDLQ's sweeps: fixed, so that every row goes through the same
// arithmetic (the same single-threaded BLAS shapes) whatever the thread count.
constexpr int64_t kScalarRowsPerTask = 128;

StatusOr<GptqPlan> PrepareGptq(const double* w, int64_t m, int64_t n, const double* h,
                               const ScalarRoundingConfig& config) {
  const char* what = "gptq";
  QCAL_RETURN_IF_ERROR(ValidateScalarRounding(w, m, n, h, config, what));
  QCAL_ASSIGN_OR_RETURN(Prepared prep, Prepare(w, m, n, h, config.damp, config.act_order, what));
  GptqPlan plan;
  plan.res = InitScalarResult(w, m, n, config.quant, prep.perm, config.num_threads);
  plan.w = std::move(prep.w);
  plan.h = std::move(prep.h);
  plan.lazy_block = EffectiveLazyBlock(config.lazy_block, config.quant, n);
  return plan;
}

void FinishGptqCodes(const std::vector<int32_t>& codes_perm, ScalarRoundingResult* res) {
  FinishScalarResult(codes_perm, res);
}

void SetScalarParams(ScalarRoundingResult* res, int64_t row, int64_t group,
                     const ScalarQuantParams<double>& p) {
  SetParams(res, row, group, p);
}

namespace {

// GPTQ's sweep over plan->w with R = chol(H⁻¹) upper (only R's upper triangle and diagonal are
// read), filling plan->res's codes and Ŵ.
void GptqSweep(const double* R, GptqPlan* plan, int64_t m, int64_t n, int num_threads,
               const ScalarQuantConfig& qc) {
  ScalarRoundingResult& res = plan->res;
  std::vector<double>& W = plan->w;  // The running weights.
  std::vector<int32_t> codes(m * n);
  const int32_t cmin = ScalarCodeMin(qc), cmax = ScalarCodeMax(qc);
  const bool grouped = qc.granularity == QuantGranularity::kPerGroup;
  const int64_t g = grouped ? std::min(qc.group_size, n) : n;
  const int64_t B = plan->lazy_block;

  // Rows evolve independently (row r's updates need only its own errors and the shared R), so
  // the sweep runs in fixed tasks of kScalarRowsPerTask rows, each on one thread with
  // single-threaded BLAS: a task's in-block rank-1 updates stay in cache (the whole-matrix
  // version streamed m × B doubles per column), and the bits do not depend on the thread count.
  PinBlasToOneThread();
  auto run_task = [&](int64_t task) {
    const int64_t r0 = task * kScalarRowsPerTask, rc = std::min(kScalarRowsPerTask, m - r0);
    double* Wt = &W[r0 * n];
    std::vector<double> err(rc * B);  // [rc, block], the scaled errors (w - q) / R_ii.
    for (int64_t i1 = 0; i1 < n; i1 += B) {
      const int64_t i2 = std::min(i1 + B, n), bw = i2 - i1;
      std::fill(err.begin(), err.end(), 0.0);
      for (int64_t i = i1; i < i2; ++i) {
        if (grouped && i % g == 0) {
          const int64_t len = std::min(g, n - i);
          for (int64_t r = 0; r < rc; ++r) {
            SetParams(&res, r0 + r, i / g, ComputeScalarQuantParams(&Wt[r * n + i], len, qc));
          }
        }
        const double d = R[i * n + i];
        for (int64_t r = 0; r < rc; ++r) {
          const ScalarQuantParams<double> p = ParamsAt(res, r0 + r, grouped ? i / g : 0);
          const double wv = Wt[r * n + i];
          const int32_t code = ScalarQuantizeCode(wv, p, cmin, cmax);
          codes[(r0 + r) * n + i] = code;
          err[r * bw + (i - i1)] = (wv - ScalarDequantizeCode(code, p)) / d;
        }
        if (i + 1 < i2) {  // W[:, i+1:i2] -= err[:, i] ⊗ R[i, i+1:i2] (rank-1, in-block).
          cblas_dger(CblasRowMajor, static_cast<int>(rc), static_cast<int>(i2 - i - 1), -1.0,
                     &err[i - i1], static_cast<int>(bw), &R[i * n + i + 1], 1, &Wt[i + 1],
                     static_cast<int>(n));
        }
      }
      if (i2 < n) {  // W[:, i2:] -= Err · R[i1:i2, i2:].
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rc),
                    static_cast<int>(n - i2), static_cast<int>(bw), -1.0, err.data(),
                    static_cast<int>(bw), &R[i1 * n + i2], static_cast<int>(n), 1.0, &Wt[i2],
                    static_cast<int>(n));
      }
    }
  };
  qcal::ParallelTasks((m + kScalarRowsPerTask - 1) / kScalarRowsPerTask, num_threads, run_task);
  W = {};  // the running weights are spent
  FinishScalarResult(codes, &res);
}

bool ExactlySymmetric(const double* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) {
      if (!(h[i * n + j] == h[j * n + i])) return false;
    }
  }
  return true;
}

}  // namespace

namespace {
// Seconds since `t`, and `t` moved to now (consecutive phases of one rounding).
double Lap(std::chrono::steady_clock::time_point* t) {
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - *t).count();
  *t = now;
  return s;
}
}  // namespace

StatusOr<ScalarRoundingResult> Gptq(const double* w, int64_t m, int64_t n, const double* h,
                                    const ScalarRoundingConfig& config) {
  const char* what = "gptq";
  auto t = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(GptqPlan plan, PrepareGptq(w, m, n, h, config));
  // R is computed in the damped Hessian's own storage (one n² matrix at the peak, not two).
  StatusOr<std::vector<double>> rinv = InverseCholeskyUpper(std::move(plan.h), n);
  if (!rinv.ok()) return Annotate(rinv.status(), what);
  const double factor = Lap(&t);
  GptqSweep(rinv->data(), &plan, m, n, config.num_threads, config.quant);
  *rinv = {};
  plan.res.times.factor = factor;
  plan.res.times.round = Lap(&t);
  if (config.refine_sweeps > 0) {
    QCAL_RETURN_IF_ERROR(Annotate(RefineRounding(w, h, config.refine_sweeps, config.damp,
                                                 config.lazy_block, config.num_threads,
                                                 config.quant, &plan.res)
                                      .status(),
                                  what));
    plan.res.times.refine = Lap(&t);
  }
  return std::move(plan.res);  // moved, not copied
}

StatusOr<ScalarRoundingResult> GptqInPlace(const double* w, int64_t m, int64_t n, double* h,
                                           const ScalarRoundingConfig& config) {
  const char* what = "gptq";
  QCAL_RETURN_IF_ERROR(ValidateScalarRounding(w, m, n, h, config, what));
  if (!ExactlySymmetric(h, n)) return Gptq(w, m, n, h, config);
  auto t = std::chrono::steady_clock::now();
  GptqPlan plan;
  const std::vector<int64_t> perm = GptqOrder(h, n, config.act_order);
  plan.w = PermutedWeights(w, m, n, h, perm);
  plan.res = InitScalarResult(w, m, n, config.quant, perm, config.num_threads);
  plan.lazy_block = EffectiveLazyBlock(config.lazy_block, config.quant, n);

  // H → the damped Hp = P H Pᵀ (processing order, dead diagonals 1) in place, as PrepareGptq
  // makes it in a copy; the undamped diagonal is kept to restore H afterwards.
  std::vector<double> diag(n);
  for (int64_t i = 0; i < n; ++i) diag[i] = h[i * n + i];
  std::vector<int64_t> to_processing(n);
  for (int64_t k = 0; k < n; ++k) to_processing[perm[k]] = k;
  PermuteSymmetricInPlace(h, n, to_processing, config.num_threads);
  for (int64_t k = 0; k < n; ++k) {
    if (diag[perm[k]] == 0.0) h[k * n + k] = 1.0;
  }
  auto restore = [&] {  // from Hp's strict lower triangle (kept by the factorization) and diag
    MirrorLowerToUpper(h, n, config.num_threads);
    for (int64_t k = 0; k < n; ++k) h[k * n + k] = diag[perm[k]];
    PermuteSymmetricInPlace(h, n, perm, config.num_threads);
  };
  if (StatusOr<double> added = DampHessian(h, n, config.damp); !added.ok()) {
    restore();
    return Annotate(added.status(), what);
  }
  if (Status f = InverseCholeskyUpperKeepingLower(h, n); !f.ok()) {
    if (f.code() == absl::StatusCode::kFailedPrecondition) restore();
    return Annotate(f, what);
  }
  const double factor = Lap(&t);
  GptqSweep(h, &plan, m, n, config.num_threads, config.quant);
  restore();
  plan.res.times.factor = factor;
  plan.res.times.round = Lap(&t);
  if (config.refine_sweeps > 0) {
    QCAL_RETURN_IF_ERROR(Annotate(RefineRounding(w, h, config.refine_sweeps, config.damp,
                                                 config.lazy_block, config.num_threads,
                                                 config.quant, &plan.res)
                                      .status(),
                                  what));
    plan.res.times.refine = Lap(&t);
  }
  return std::move(plan.res);
}

StatusOr<ScalarRoundingResult> Ldlq(const double* w, int64_t m, int64_t n, const double* h,
                                    const ScalarRoundingConfig& config) {
  const char* what = "ldlq";
  QCAL_RETURN_IF_ERROR(ValidateScalarRounding(w, m, n, h, config, what));
  const ScalarQuantConfig& qc = config.quant;
  QCAL_ASSIGN_OR_RETURN(Prepared prep, Prepare(w, m, n, h, config.damp, config.act_order, what));
  ScalarRoundingResult res = InitScalarResult(w, m, n, qc, prep.perm, config.num_threads);
  StatusOr<BlockLdl> ldl = BlockLdlDecompose(std::move(prep.h), n, 1, LdlForm::kLtDL);
  if (!ldl.ok()) return Annotate(ldl.status(), what);
  const std::vector<double>& L = ldl->L;  // U[j][k] = L[k][j] for j < k.

  const std::vector<double>& W = prep.w;
  std::vector<int32_t> codes(m * n);
  const int32_t cmin = ScalarCodeMin(qc), cmax = ScalarCodeMax(qc);
  const bool grouped = qc.granularity == QuantGranularity::kPerGroup;
  const int64_t g = grouped ? std::min(qc.group_size, n) : n;
  const int64_t B = EffectiveLazyBlock(config.lazy_block, qc, n);

  // In fixed row tasks as GPTQ above (the whole-matrix version's rank-1 update per column
  // streamed m × B doubles from memory: the 20× a dense GEMM at 28672 × 8192), with per-task
  // targets and errors instead of two [m, n] fp64 buffers.
  PinBlasToOneThread();
  auto run_task = [&](int64_t task) {
    const int64_t r0 = task * kScalarRowsPerTask, rc = std::min(kScalarRowsPerTask, m - r0);
    const double* Wt = &W[r0 * n];
    std::vector<double> X(Wt, Wt + rc * n);  // Targets X = W + (W − Ŵ)U, accumulated lazily.
    std::vector<double> E(rc * n, 0.0);      // W − Ŵ.
    std::vector<double> u(B), state(g);
    for (int64_t b0 = 0; b0 < n; b0 += B) {
      const int64_t b1 = std::min(b0 + B, n), bw = b1 - b0;
      if (b0 > 0) {  // X[:, b0:b1] += E[:, :b0] · U[:b0, b0:b1] = E[:, :b0] · L[b0:b1, :b0]ᵀ.
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rc),
                    static_cast<int>(bw), static_cast<int>(b0), 1.0, E.data(),
                    static_cast<int>(n), &L[b0 * n], static_cast<int>(n), 1.0, &X[b0],
                    static_cast<int>(n));
      }
      for (int64_t k = b0; k < b1; ++k) {
        if (grouped && k % g == 0) {
          // The group's current targets: feedback recursion with zero error on its own columns.
          const int64_t len = std::min(g, n - k);
          for (int64_t r = 0; r < rc; ++r) {
            const double* xr = &X[r * n];
            const double* wr = &Wt[r * n];
            for (int64_t c = 0; c < len; ++c) {
              const double* lrow = &L[(k + c) * n + k];
              double s = xr[k + c];
              for (int64_t i = 0; i < c; ++i) s += (wr[k + i] - state[i]) * lrow[i];
              state[c] = s;
            }
            SetParams(&res, r0 + r, k / g, ComputeScalarQuantParams(state.data(), len, qc));
          }
        }
        for (int64_t r = 0; r < rc; ++r) {
          const ScalarQuantParams<double> p = ParamsAt(res, r0 + r, grouped ? k / g : 0);
          const int32_t code = ScalarQuantizeCode(X[r * n + k], p, cmin, cmax);
          codes[(r0 + r) * n + k] = code;
          E[r * n + k] = Wt[r * n + k] - ScalarDequantizeCode(code, p);
        }
        const int64_t rest = b1 - k - 1;
        if (rest > 0) {  // X[:, k+1:b1] += E[:, k] ⊗ U[k, k+1:b1] (rank-1, in-block).
          for (int64_t c = 0; c < rest; ++c) u[c] = L[(k + 1 + c) * n + k];
          cblas_dger(CblasRowMajor, static_cast<int>(rc), static_cast<int>(rest), 1.0, &E[k],
                     static_cast<int>(n), u.data(), 1, &X[k + 1], static_cast<int>(n));
        }
      }
    }
  };
  qcal::ParallelTasks((m + kScalarRowsPerTask - 1) / kScalarRowsPerTask, config.num_threads,
                      run_task);
  FinishScalarResult(codes, &res);
  if (config.refine_sweeps > 0) {
    QCAL_RETURN_IF_ERROR(Annotate(RefineRounding(w, h, config.refine_sweeps, config.damp,
                                                 config.lazy_block, config.num_threads, qc, &res)
                                      .status(),
                                  what));
  }
  return res;
}

namespace {

// Rows per task of BlockLDLQ's sweep: fixed, so that every row goes through the same arithmetic
// (the same single-threaded sgemm shapes) whatever the thread count.
constexpr int64_t kBlockLdlqRowsPerTask = 128;
constexpr int64_t kJointRowsPerTask = 32;

// x[0:len] += Σ_t e[t] · u[t·ld : t·ld + len] for t < g: the in-block feedback of one row, fp32.
// Cloned for AVX2 without FMA (the same bits as the baseline build).
__attribute__((target_clones("avx2", "default"))) void InBlockFeedback(
    float* __restrict x, int64_t len, const float* __restrict e, int64_t g,
    const float* __restrict u, int64_t ld) {
  for (int64_t t = 0; t < g; ++t) {
    const float et = e[t];
    const float* __restrict ut = u + t * ld;
    for (int64_t j = 0; j < len; ++j) x[j] += et * ut[j];
  }
}

// BlockLDLQ's rounding sweep once the g-block factor of the damped Hessian is known. W is the
// prepared [m, n] weight (dead columns zeroed). Consumes the factor (its fp64 L is freed once an
// fp32 copy exists).
//
// Every row evolves on its own: its targets X[r, :] = W[r, :] + E[r, :]·U need only its own
// errors E = W − Ŵ and the shared U = Lᵀ − I. So the rows are cut into fixed tasks of
// kBlockLdlqRowsPerTask rows, and each task runs the whole sweep for its rows on one thread:
// per lazy block, one single-threaded sgemm brings in the feedback of all earlier blocks
// (X[:, b0:b1] += E[:, :b0] · U[:b0, b0:b1]), then for each g columns a batched codebook search and
// a rank-g update of the rest of the block. No synchronisation between tasks; no BLAS thread pool
// competing with the searches; per-task buffers [rows, n] in fp32 instead of two [m, n] in fp64.
// The feedback is fp32 (as the reference implementation's on GPU): its relative error, about
// 1e-7·√n of the accumulated terms, moves a target by far less than the codebook's spacing, so it
// changes a rounding only for targets within that distance of a decision boundary. The errors E
// themselves are computed in fp64 from W and the decoded points.
VectorRoundingResult BlockLdlqSweep(const double* W, int64_t m, int64_t n, BlockLdl&& ldl,
                                    const VectorCodebook& cb, double scale,
                                    const VectorRoundingConfig& config) {
  const int64_t g = cb.dim();
  const int cw = cb.code_words();

  VectorRoundingResult res;
  res.rows = m;
  res.cols = n;
  res.dim = static_cast<int>(g);
  res.code_words = cw;
  res.scale = scale;
  res.codes.assign(m * (n / g) * cw, 0);

  const int64_t B = ((std::max<int64_t>(1, config.lazy_block) + g - 1) / g) * g;
  // Lf[j, k] = U[k, j] = L[j, k] for k < j in an earlier lazy block (the cross-block sgemm reads
  // row j from column 0); inside a lazy block the transposed panels Ut[blk][i][j] = L[b0 + j, b0 +
  // i] (i < j) make the rank-g update contiguous.
  std::vector<float> Lf(n * n, 0.0f);
  const int64_t blocks = (n + B - 1) / B;
  std::vector<float> Ut(blocks * B * B, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t b0 = (j / B) * B;
    for (int64_t k = 0; k < b0; ++k) Lf[j * n + k] = static_cast<float>(ldl.L[j * n + k]);
    float* ut = &Ut[(j / B) * B * B];
    for (int64_t i = b0; i < j; ++i) ut[(i - b0) * B + (j - b0)] = static_cast<float>(ldl.L[j * n + i]);
  }
  ldl = BlockLdl();

  PinBlasToOneThread();  // each task's sgemm runs on its own thread (and its bits do not depend
                         // on a BLAS thread split)
  // Joint codebooks (trellis tiles) spend their time in the searches, not the sgemm: smaller
  // tasks spread a small layer's tiles over more threads. Fixed per codebook, so the bits do not
  // depend on the thread count.
  const int64_t rows_per_task =
      cb.joint_vectors() > 1 ? kJointRowsPerTask : kBlockLdlqRowsPerTask;
  const int64_t tasks = (m + rows_per_task - 1) / rows_per_task;
  std::mutex progress_mu;
  int64_t rows_done = 0;
  auto run_task = [&](int64_t task) {
    const int64_t r0 = task * rows_per_task;
    const int64_t rc = std::min(rows_per_task, m - r0);
    // X: the targets of these rows; once g columns are rounded their X is never read again, so
    // their error E = W − Ŵ is stored in their place (the cross-block sgemm reads it from there).
    std::vector<float> X(rc * n);
    for (int64_t i = 0; i < rc * n; ++i) X[i] = static_cast<float>(W[r0 * n + i]);
    std::vector<float> in(rc * g), out(rc * g);
    std::vector<uint32_t> codes(rc * cw);
    for (int64_t b0 = 0; b0 < n; b0 += B) {
      const int64_t b1 = std::min(b0 + B, n), bw = b1 - b0;
      if (b0 > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rc),
                    static_cast<int>(bw), static_cast<int>(b0), 1.0f, X.data(),
                    static_cast<int>(n), &Lf[b0 * n], static_cast<int>(n), 1.0f, &X[b0],
                    static_cast<int>(n));
      }
      const float* ut = &Ut[(b0 / B) * B * B];
      for (int64_t k = b0; k < b1; k += g) {
        for (int64_t r = 0; r < rc; ++r) {
          const float* x = &X[r * n + k];
          for (int64_t j = 0; j < g; ++j) {
            in[r * g + j] = static_cast<float>(static_cast<double>(x[j]) / scale);
          }
        }
        cb.Quantize(in.data(), rc, out.data(), codes.data());
        const int64_t kb = k / g;
        for (int64_t r = 0; r < rc; ++r) {
          const int64_t row = r0 + r;
          std::copy(codes.begin() + r * cw, codes.begin() + (r + 1) * cw,
                    res.codes.begin() + (row * (n / g) + kb) * cw);
          for (int64_t j = 0; j < g; ++j) {
            const double q = scale * static_cast<double>(out[r * g + j]);
            X[r * n + k + j] = static_cast<float>(W[row * n + k + j] - q);  // E
          }
          // X[r, k+g:b1] += E[r, k:k+g] · U[k:k+g, k+g:b1].
          if (k + g < b1) {
            InBlockFeedback(&X[r * n + k + g], b1 - k - g, &X[r * n + k], g,
                            &ut[(k - b0) * B + (k + g - b0)], B);
          }
        }
      }
    }
    if (config.progress) {
      std::lock_guard<std::mutex> lock(progress_mu);
      rows_done += rc;
      config.progress(rows_done, m);
    }
  };

  qcal::ParallelTasks(tasks, config.num_threads, run_task);

  // Ŵ from the codes, one joint unit of rows at a time (one row for the lattices), so the only
  // buffer is [joint, n] floats.
  res.w_hat.resize(m * n);
  const int64_t joint = cb.joint_vectors();
  std::vector<float> points(joint * n);
  for (int64_t r0 = 0; r0 < m; r0 += joint) {
    const int64_t rows = std::min(joint, m - r0);
    DecodeMatrix(cb, &res.codes[r0 * (n / g) * cw], rows, n, points.data());
    for (int64_t i = 0; i < rows * n; ++i) {
      res.w_hat[r0 * n + i] = scale * static_cast<double>(points[i]);
    }
  }
  return res;
}

Status ValidateBlockLdlq(const double* w, int64_t m, int64_t n, const double* h,
                         const VectorCodebook& cb, const VectorRoundingConfig& config,
                         const char* what) {
  QCAL_RETURN_IF_ERROR(ValidateVectorRounding(w, m, n, cb, config.num_threads, what));
  QCAL_RETURN_IF_ERROR(CheckHessian(h, n, what));
  if (!(config.damp >= 0.0) || !std::isfinite(config.damp)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": damp = ", config.damp, " must be >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<VectorRoundingResult> BlockLdlq(const double* w, int64_t m, int64_t n, const double* h,
                                         const VectorCodebook& cb,
                                         const VectorRoundingConfig& config) {
  const char* what = "block ldlq";
  QCAL_RETURN_IF_ERROR(ValidateBlockLdlq(w, m, n, h, cb, config, what));
  QCAL_ASSIGN_OR_RETURN(const double scale, ResolveScale(w, m * n, cb, config.scale, what));
  auto t = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(Prepared prep, Prepare(w, m, n, h, config.damp, false, what));
  StatusOr<BlockLdl> ldl = BlockLdlDecompose(std::move(prep.h), n, cb.dim(), LdlForm::kLtDL);
  if (!ldl.ok()) return Annotate(ldl.status(), what);
  const double factor = Lap(&t);
  VectorRoundingResult res =
      BlockLdlqSweep(prep.w.data(), m, n, std::move(*ldl), cb, scale, config);
  res.times.factor = factor;
  res.times.round = Lap(&t);
  QCAL_RETURN_IF_ERROR(RefineAfterBlockLdlq(prep.w.data(), h, cb, config, &res));
  res.times.refine = Lap(&t);
  return res;
}

Status CheckHessianValues(size_t values, int64_t cols, const char* what) {
  if (static_cast<int64_t>(values) == cols * cols) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": the Hessian holds ", values,
                                                 " values, not cols*cols = ", cols * cols));
}

const double* ZeroDeadColumns(const double* w, int64_t rows, int64_t cols, const double* h,
                              std::vector<double>* copy) {
  const double* out = w;
  for (int64_t j = 0; j < cols; ++j) {
    if (h[j * cols + j] != 0.0) continue;
    if (out == w) copy->assign(w, w + rows * cols);
    for (int64_t r = 0; r < rows; ++r) (*copy)[r * cols + j] = 0.0;
    out = copy->data();
  }
  return out;
}

StatusOr<VectorRoundingResult> BlockLdlqConsumingHessian(const double* w, int64_t m, int64_t n,
                                                         std::vector<double> h,
                                                         const VectorCodebook& cb,
                                                         const VectorRoundingConfig& config) {
  const char* what = "block ldlq";
  QCAL_RETURN_IF_ERROR(CheckHessianValues(h.size(), n, what));
  QCAL_RETURN_IF_ERROR(ValidateBlockLdlq(w, m, n, h.data(), cb, config, what));
  QCAL_ASSIGN_OR_RETURN(const double scale, ResolveScale(w, m * n, cb, config.scale, what));
  // Prepare() without act order, in place: dead inputs (zero diagonal) get diagonal 1 and zero
  // weight columns; then damping. Only a weight copy is made, and only when a column is dead.
  // The sweeps need the undamped H after the factorization has consumed it.
  auto t = std::chrono::steady_clock::now();
  std::vector<double> h_undamped;
  if (config.refine_sweeps > 0) h_undamped = h;
  std::vector<double> w_dead;
  const double* W = ZeroDeadColumns(w, m, n, h.data(), &w_dead);
  for (int64_t j = 0; j < n; ++j) {
    if (h[j * n + j] == 0.0) h[j * n + j] = 1.0;
  }
  auto added = DampHessian(h.data(), n, config.damp);
  if (!added.ok()) return Annotate(added.status(), what);
  StatusOr<BlockLdl> ldl = BlockLdlDecompose(std::move(h), n, cb.dim(), LdlForm::kLtDL);
  if (!ldl.ok()) return Annotate(ldl.status(), what);
  const double factor = Lap(&t);
  VectorRoundingResult res = BlockLdlqSweep(W, m, n, std::move(*ldl), cb, scale, config);
  res.times.factor = factor;
  res.times.round = Lap(&t);
  QCAL_RETURN_IF_ERROR(RefineAfterBlockLdlq(W, h_undamped.data(), cb, config, &res));
  res.times.refine = Lap(&t);
  return res;
}

Status RefineAfterBlockLdlq(const double* w, const double* h, const VectorCodebook& cb,
                            const VectorRoundingConfig& config, VectorRoundingResult* res) {
  if (config.refine_sweeps <= 0) return Status();
  return Annotate(RefineRounding(w, h, config.refine_sweeps, config.damp, config.lazy_block,
                                 config.num_threads, cb, res)
                      .status(),
                  "block ldlq");
}

StatusOr<VectorRoundingResult> NearestVectorRounding(const double* w, int64_t m, int64_t n,
                                                     const VectorCodebook& cb,
                                                     const VectorRoundingConfig& config) {
  const char* what = "nearest vector rounding";
  QCAL_RETURN_IF_ERROR(ValidateVectorRounding(w, m, n, cb, config.num_threads, what));
  QCAL_ASSIGN_OR_RETURN(const double scale, ResolveScale(w, m * n, cb, config.scale, what));
  const int64_t g = cb.dim();
  const int cw = cb.code_words();
  VectorRoundingResult res;
  res.rows = m;
  res.cols = n;
  res.dim = static_cast<int>(g);
  res.code_words = cw;
  res.scale = scale;
  res.w_hat.resize(m * n);
  res.codes.resize(m * (n / g) * cw);
  std::vector<float> in(m * n), out(m * n);
  if (cb.joint_vectors() == 1) {
    // Row-major [m, n] is already [m·n/g, g] vectors.
    for (int64_t i = 0; i < m * n; ++i) in[i] = static_cast<float>(w[i] / scale);
    QuantizeVectors(cb, in.data(), m * n / g, out.data(), res.codes.data(), config.num_threads);
    for (int64_t i = 0; i < m * n; ++i) res.w_hat[i] = scale * static_cast<double>(out[i]);
    return res;
  }
  // Joint codebooks: column block by column block ([m, g] each, tiles of consecutive rows), the
  // codes scattered into [m, n / g, cw].
  const int64_t blocks = n / g;
  std::vector<uint32_t> codes(m * cw);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < g; ++j) in[r * g + j] = static_cast<float>(w[r * n + b * g + j] / scale);
    }
    QuantizeVectors(cb, in.data(), m, out.data(), codes.data(), config.num_threads);
    for (int64_t r = 0; r < m; ++r) {
      std::copy(&codes[r * cw], &codes[(r + 1) * cw], &res.codes[(r * blocks + b) * cw]);
      for (int64_t j = 0; j < g; ++j) {
        res.w_hat[r * n + b * g + j] = scale * static_cast<double>(out[r * g + j]);
      }
    }
  }
  return res;
}

}  // namespace qcal::kernels
