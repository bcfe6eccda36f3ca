// Tests for kernels/rounding.h: GPTQ == LDLQ, LDLQ beats RTN and BlockLDLQ beats nearest
// rounding on synthetic Hessians with a decaying spectrum, BlockLDLQ satisfies its defining
// fixed-point equation, QuIP# Theorem 4.1 (and Lemma B.1) hold numerically on μ-incoherent
// Hessians, determinism, dead inputs, and errors.
//
// Tolerances:
//   * GPTQ vs LDLQ: identical integer codes, and max |Ŵ_gptq − Ŵ_ldlq| <= 1e-9 · max |W| (fp64;
//     the two are different floating-point evaluations of the same recursion).
//   * Fixed point Ŵ = Q(W + (W − Ŵ)U): every vector must match, except where the recomputed
//     target is within 1e-9 (squared distance) of being equidistant between the two points.
//   * Proxy-loss comparisons and the theorem's bound: strict inequalities, no slack.
#include "kernels/rounding.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kernels/codebook.h"
#include "kernels/linalg.h"
#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Random data (Box-Muller from mt19937_64: bit-reproducible for a seed).
// ---------------------------------------------------------------------------------------------
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : rng_(seed) {}
  double operator()() {
    const double u1 = (static_cast<double>(rng_() >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t Bits() { return rng_(); }

 private:
  std::mt19937_64 rng_;
};

std::vector<double> RandomMatrix(int64_t rows, int64_t cols, Gaussian& g) {
  std::vector<double> w(rows * cols);
  for (auto& v : w) v = g();
  return w;
}

// Haar-ish random orthogonal Q [n, n] (rows orthonormal) by modified Gram-Schmidt, done twice.
std::vector<double> RandomOrthogonal(int64_t n, Gaussian& g) {
  std::vector<double> q = RandomMatrix(n, n, g);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < n; ++i) {
      double* qi = &q[i * n];
      for (int64_t j = 0; j < i; ++j) {
        const double* qj = &q[j * n];
        double d = 0;
        for (int64_t k = 0; k < n; ++k) d += qi[k] * qj[k];
        for (int64_t k = 0; k < n; ++k) qi[k] -= d * qj[k];
      }
      double nn = 0;
      for (int64_t k = 0; k < n; ++k) nn += qi[k] * qi[k];
      nn = std::sqrt(nn);
      for (int64_t k = 0; k < n; ++k) qi[k] /= nn;
    }
  }
  return q;
}

// Normalized Sylvester Hadamard with random column signs and a random row permutation:
// orthogonal with every |entry| = 1/√n, i.e. μ = 1 (n a power of 2).
std::vector<double> RandomHadamard(int64_t n, Gaussian& g) {
  std::vector<double> h(n * n);
  const double s = 1.0 / std::sqrt(static_cast<double>(n));
  std::vector<int64_t> perm(n);
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  for (int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[g.Bits() % (i + 1)]);
  std::vector<double> sign(n);
  for (auto& v : sign) v = (g.Bits() & 1) ? 1.0 : -1.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      h[i * n + j] = ((__builtin_popcountll(perm[i] & j) & 1) ? -s : s) * sign[j];
    }
  }
  return h;
}

struct SyntheticHessian {
  int64_t n = 0;
  std::vector<double> h;       // Q diag(λ) Qᵀ, exactly symmetric.
  std::vector<double> lambda;  // Eigenvalues.
  double mu = 0;               // √n · max |Q_ij|: H is μ-incoherent (QuIP# Definition 2.1).
  double trace_sqrt = 0;       // tr(H^{1/2}) = Σ √λ_i.
};

// Eigenvalues λ_i = exp(-decay · i / n) (decaying spectrum; condition number e^decay), random
// eigenvector basis (Gram-Schmidt or randomized Hadamard).
SyntheticHessian MakeHessian(int64_t n, Gaussian& g, double decay, bool hadamard_basis) {
  SyntheticHessian s;
  s.n = n;
  const std::vector<double> q = hadamard_basis ? RandomHadamard(n, g) : RandomOrthogonal(n, g);
  s.lambda.resize(n);
  for (int64_t i = 0; i < n; ++i) s.lambda[i] = std::exp(-decay * i / static_cast<double>(n));
  // Eigenvectors are the columns of Qᵀ = rows of q: H = qᵀ diag(λ) q.
  std::vector<double> dq(n * n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) dq[i * n + j] = s.lambda[i] * q[i * n + j];
  }
  s.h.assign(n * n, 0.0);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, n, 1.0, q.data(), n, dq.data(), n, 0.0,
              s.h.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) s.h[j * n + i] = s.h[i * n + j];
  }
  double mx = 0;
  for (double v : q) mx = std::max(mx, std::fabs(v));
  s.mu = mx * std::sqrt(static_cast<double>(n));
  for (double l : s.lambda) s.trace_sqrt += std::sqrt(l);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Test-only codebooks (VectorCodebook).
// ---------------------------------------------------------------------------------------------

// The unbounded grid step·Z^dim; nearest (ties to even) or stochastic rounding per coordinate
// (round up with probability frac, from a seeded RNG: E[(Q(x)−x)(Q(x)−x)ᵀ] <= (step²/4)·I).
// Codes: one word per coordinate, the integer + 2^31.
class IntegerGridCodebook final : public VectorCodebook {
 public:
  IntegerGridCodebook(int dim, double step, bool stochastic = false, uint64_t seed = 0)
      : dim_(dim), step_(step), stochastic_(stochastic), rng_(seed) {}
  std::string name() const override { return stochastic_ ? "test_grid_stochastic" : "test_grid"; }
  int dim() const override { return dim_; }
  int code_words() const override { return dim_; }
  double bits_per_weight() const override { return 32.0; }
  double default_scale() const override { return 1.0; }
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < count * dim_; ++i) {
      const double t = static_cast<double>(x[i]) / step_;
      double k;
      if (stochastic_) {
        const double f = std::floor(t);
        const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
        k = (u < t - f) ? f + 1 : f;
      } else {
        k = std::nearbyint(t);
      }
      out[i] = static_cast<float>(k * step_);
      if (codes) codes[i] = static_cast<uint32_t>(static_cast<int64_t>(k) + (int64_t{1} << 31));
    }
  }
  void Decode(const uint32_t* codes, int64_t count, float* out) const override {
    for (int64_t i = 0; i < count * dim_; ++i) {
      out[i] = static_cast<float>((static_cast<int64_t>(codes[i]) - (int64_t{1} << 31)) * step_);
    }
  }

 private:
  int dim_;
  double step_;
  bool stochastic_;
  mutable std::mutex mu_;
  mutable std::mt19937_64 rng_;
};

// A bounded half-integer grid {±1/2, ±3/2, ...} with `levels` points per coordinate (levels even),
// dim coordinates: like QuIP#'s "halfint" grids. One word per vector (mixed-radix index).
class HalfIntGridCodebook final : public VectorCodebook {
 public:
  HalfIntGridCodebook(int dim, int levels) : dim_(dim), levels_(levels) {}
  std::string name() const override { return "test_halfint"; }
  int dim() const override { return dim_; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override { return std::log2(static_cast<double>(levels_)); }
  double default_scale() const override { return 1.0; }
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override {
    const double top = (levels_ - 1) / 2.0;
    for (int64_t v = 0; v < count; ++v) {
      uint32_t code = 0;
      for (int j = dim_ - 1; j >= 0; --j) {
        const double t = static_cast<double>(x[v * dim_ + j]);
        double k = std::floor(t) + 0.5;  // Nearest half-integer.
        k = std::min(std::max(k, -top), top);
        out[v * dim_ + j] = static_cast<float>(k);
        code = code * levels_ + static_cast<uint32_t>(k + top);
      }
      if (codes) codes[v] = code;
    }
  }
  void Decode(const uint32_t* codes, int64_t count, float* out) const override {
    const double top = (levels_ - 1) / 2.0;
    for (int64_t v = 0; v < count; ++v) {
      uint32_t c = codes[v];
      for (int j = 0; j < dim_; ++j) {
        out[v * dim_ + j] = static_cast<float>(static_cast<double>(c % levels_) - top);
        c /= levels_;
      }
    }
  }

 private:
  int dim_;
  int levels_;
};

// A non-lattice VQ codebook: `size` random Gaussian points in dim dimensions, exact nearest search
// (first index on ties).
class RandomVqCodebook final : public VectorCodebook {
 public:
  RandomVqCodebook(int dim, int size, uint64_t seed) : dim_(dim), points_(dim * size) {
    Gaussian g(seed);
    for (auto& p : points_) p = static_cast<float>(g());
  }
  std::string name() const override { return "test_random_vq"; }
  int dim() const override { return dim_; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override {
    return std::log2(static_cast<double>(points_.size() / dim_)) / dim_;
  }
  double default_scale() const override { return 1.0; }
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override {
    const int64_t size = static_cast<int64_t>(points_.size()) / dim_;
    for (int64_t v = 0; v < count; ++v) {
      int64_t best = 0;
      double best_d = std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < size; ++c) {
        double d = 0;
        for (int j = 0; j < dim_; ++j) {
          const double e = static_cast<double>(x[v * dim_ + j]) - points_[c * dim_ + j];
          d += e * e;
        }
        if (d < best_d) {
          best_d = d;
          best = c;
        }
      }
      for (int j = 0; j < dim_; ++j) out[v * dim_ + j] = points_[best * dim_ + j];
      if (codes) codes[v] = static_cast<uint32_t>(best);
    }
  }
  void Decode(const uint32_t* codes, int64_t count, float* out) const override {
    for (int64_t v = 0; v < count; ++v) {
      for (int j = 0; j < dim_; ++j) out[v * dim_ + j] = points_[codes[v] * dim_ + j];
    }
  }

 private:
  int dim_;
  std::vector<float> points_;
};

ScalarRoundingConfig ScalarCfg(int bits, bool sym, QuantGranularity gran, int64_t group = 128) {
  ScalarRoundingConfig c;
  c.quant.bits = bits;
  c.quant.symmetric = sym;
  c.quant.granularity = gran;
  c.quant.group_size = group;
  return c;
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Basics.
// ---------------------------------------------------------------------------------------------

TEST(RoundingTest, ProxyLossMatchesNaiveSum) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 300, n = 40;  // > 256 rows: exercises the row chunking.
  const SyntheticHessian s = MakeHessian(n, g, 4.0, false);
  const std::vector<double> w = RandomMatrix(m, n, g), wh = RandomMatrix(m, n, g);
  double naive = 0;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        naive += (wh[r * n + i] - w[r * n + i]) * s.h[i * n + j] * (wh[r * n + j] - w[r * n + j]);
      }
    }
  }
  EXPECT_NEAR(ProxyLoss(w.data(), wh.data(), s.h.data(), m, n), naive, 1e-10 * naive);
  EXPECT_EQ(ProxyLoss(w.data(), w.data(), s.h.data(), m, n), 0.0);
}

TEST(RoundingTest, RoundToNearestMatchesQuantizeScalar) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 10, n = 70;
  const std::vector<double> w = RandomMatrix(m, n, g);
  const ScalarRoundingConfig c = ScalarCfg(3, false, QuantGranularity::kPerGroup, 32);
  auto r = RoundToNearest(w.data(), m, n, c.quant);
  auto q = QuantizeScalar(w.data(), m, n, c.quant);
  ASSERT_TRUE(r.ok() && q.ok());
  EXPECT_EQ(r->w_hat, q->values);
  EXPECT_EQ(r->codes, q->codes);
  EXPECT_EQ(r->param_cols, 3);
  EXPECT_EQ(r->g_idx[69], 2);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(r->w_hat[i * n + j], ScalarDequantizeCode(r->codes[i * n + j], r->params(i, j)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GPTQ == LDLQ (QuIP's equivalence).
// ---------------------------------------------------------------------------------------------

struct EquivCase {
  const char* name;
  int bits;
  bool sym;
  QuantGranularity gran;
  int64_t group;
  bool clip_search;
  bool act_order;
  int64_t lazy;
};

TEST(RoundingTest, GptqEqualsLdlq) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 40, n = 300;  // n not a multiple of the lazy block or of some group sizes.
  const SyntheticHessian s = MakeHessian(n, g, 8.0, false);
  // Non-isotropic weights: per-row scales so per-channel parameters differ.
  std::vector<double> w = RandomMatrix(m, n, g);
  for (int64_t r = 0; r < m; ++r) {
    const double sc = std::exp(0.5 * g());
    for (int64_t j = 0; j < n; ++j) w[r * n + j] *= sc;
  }
  const EquivCase cases[] = {
      {"per-channel sym 4b", 4, true, QuantGranularity::kPerChannel, 0, false, false, 128},
      {"per-channel sym 2b", 2, true, QuantGranularity::kPerChannel, 0, false, false, 128},
      {"per-channel asym 3b clip-search", 3, false, QuantGranularity::kPerChannel, 0, true, false,
       64},
      {"per-tensor sym 3b", 3, true, QuantGranularity::kPerTensor, 0, false, false, 128},
      {"per-channel act-order", 4, true, QuantGranularity::kPerChannel, 0, false, true, 128},
      {"per-group 64", 4, true, QuantGranularity::kPerGroup, 64, false, false, 128},
      {"per-group 48 ragged asym", 3, false, QuantGranularity::kPerGroup, 48, false, false, 128},
      {"per-group 128 clip act-order", 4, false, QuantGranularity::kPerGroup, 128, true, true, 128},
      {"per-group 200 > lazy", 4, true, QuantGranularity::kPerGroup, 200, false, false, 128},
  };
  const double wmax = MaxAbs(w);
  for (const EquivCase& c : cases) {
    SCOPED_TRACE(c.name);
    ScalarRoundingConfig cfg = ScalarCfg(c.bits, c.sym, c.gran, c.group);
    cfg.quant.clip_search = c.clip_search;
    cfg.act_order = c.act_order;
    cfg.lazy_block = c.lazy;
    auto a = Gptq(w.data(), m, n, s.h.data(), cfg);
    auto b = Ldlq(w.data(), m, n, s.h.data(), cfg);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    int64_t code_diff = 0;
    double max_diff = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      code_diff += a->codes[i] != b->codes[i];
      max_diff = std::max(max_diff, std::fabs(a->w_hat[i] - b->w_hat[i]));
    }
    EXPECT_EQ(code_diff, 0);
    EXPECT_LE(max_diff, 1e-9 * wmax);
    EXPECT_EQ(a->perm, b->perm);
    EXPECT_EQ(a->g_idx, b->g_idx);
    ASSERT_EQ(a->scales.size(), b->scales.size());
    for (size_t i = 0; i < a->scales.size(); ++i) {
      EXPECT_NEAR(a->scales[i], b->scales[i], 1e-12 * std::fabs(a->scales[i]));
    }
    EXPECT_EQ(a->zeros, b->zeros);
    // Ŵ rebuilds from (codes, parameters), and the adaptive result is not just RTN.
    auto rtn = RoundToNearest(w.data(), m, n, cfg.quant);
    ASSERT_TRUE(rtn.ok());
    EXPECT_NE(a->codes, rtn->codes);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(a->w_hat[r * n + j], ScalarDequantizeCode(a->codes[r * n + j], a->params(r, j)));
      }
    }
    std::printf("%-34s max|dW|/max|W| %.1e  proxy: gptq %.6e ldlq %.6e rtn %.6e\n", c.name,
                max_diff / wmax, ProxyLoss(w.data(), a->w_hat.data(), s.h.data(), m, n),
                ProxyLoss(w.data(), b->w_hat.data(), s.h.data(), m, n),
                ProxyLoss(w.data(), rtn->w_hat.data(), s.h.data(), m, n));
  }
}

TEST(RoundingTest, ResultDoesNotDependOnLazyBlock) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 16, n = 150;
  const SyntheticHessian s = MakeHessian(n, g, 6.0, false);
  const std::vector<double> w = RandomMatrix(m, n, g);
  for (QuantGranularity gran : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup}) {
    ScalarRoundingConfig cfg = ScalarCfg(3, true, gran, 32);
    cfg.lazy_block = 128;
    auto ref = Gptq(w.data(), m, n, s.h.data(), cfg);
    ASSERT_TRUE(ref.ok());
    for (int64_t lazy : {1, 7, 32, 1000}) {
      cfg.lazy_block = lazy;
      auto a = Gptq(w.data(), m, n, s.h.data(), cfg);
      auto b = Ldlq(w.data(), m, n, s.h.data(), cfg);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->codes, ref->codes) << "gptq lazy " << lazy;
      EXPECT_EQ(b->codes, ref->codes) << "ldlq lazy " << lazy;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Adaptive rounding beats nearest rounding on decaying-spectrum Hessians.
// ---------------------------------------------------------------------------------------------

TEST(RoundingTest, LdlqBeatsRtnOnDecayingSpectrum) {
  const uint64_t seed = testing::TestSeed();
  const int64_t m = 64, n = 256;
  for (int trial = 0; trial < 4; ++trial) {
    Gaussian g(seed + trial);
    const SyntheticHessian s = MakeHessian(n, g, 10.0, trial % 2 == 1);
    const std::vector<double> w = RandomMatrix(m, n, g);
    for (int bits : {2, 3, 4}) {
      for (QuantGranularity gran : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup}) {
        const ScalarRoundingConfig cfg = ScalarCfg(bits, true, gran, 64);
        auto ldlq = Ldlq(w.data(), m, n, s.h.data(), cfg);
        auto rtn = RoundToNearest(w.data(), m, n, cfg.quant);
        ASSERT_TRUE(ldlq.ok() && rtn.ok());
        const double l_ldlq = ProxyLoss(w.data(), ldlq->w_hat.data(), s.h.data(), m, n);
        const double l_rtn = ProxyLoss(w.data(), rtn->w_hat.data(), s.h.data(), m, n);
        std::printf("seed+%d %db %-11s LDLQ %.4e  RTN %.4e  ratio %.3f\n", trial, bits,
                    gran == QuantGranularity::kPerGroup ? "group-64" : "per-channel", l_ldlq, l_rtn,
                    l_ldlq / l_rtn);
        EXPECT_GT(l_ldlq, 0.0);
        EXPECT_LT(l_ldlq, l_rtn) << "trial " << trial << " bits " << bits;
      }
    }
  }
}

std::unique_ptr<VectorCodebook> MaybeE8p(std::string* why) {
  auto cb = MakeCodebook("e8p");
  if (!cb.ok()) {
    *why = std::string(cb.status().message());
    return nullptr;
  }
  return std::move(cb).value();
}

TEST(RoundingTest, BlockLdlqBeatsNearestWithTheSameCodebook) {
  const uint64_t seed = testing::TestSeed();
  const int64_t m = 64, n = 256;
  std::vector<std::unique_ptr<VectorCodebook>> books;
  books.push_back(std::make_unique<HalfIntGridCodebook>(8, 4));  // 2 bits/weight, dim 8.
  books.push_back(std::make_unique<HalfIntGridCodebook>(2, 4));  // 2 bits/weight, dim 2.
  books.push_back(std::make_unique<HalfIntGridCodebook>(1, 8));  // 3 bits, scalar (g = 1).
  books.push_back(std::make_unique<RandomVqCodebook>(2, 16, seed ^ 0x5eed));  // 2 bits, dim 2.
  std::string why;
  if (auto e8p = MaybeE8p(&why)) {
    books.push_back(std::move(e8p));
  } else {
    std::printf("E8P not available (%s): testing the test codebooks only\n", why.c_str());
  }
  for (int trial = 0; trial < 3; ++trial) {
    Gaussian g(seed + 100 + trial);
    const SyntheticHessian s = MakeHessian(n, g, 10.0, trial % 2 == 0);
    const std::vector<double> w = RandomMatrix(m, n, g);
    for (const auto& cb : books) {
      VectorRoundingConfig cfg;  // Default scale: RMS(W) / default_scale().
      auto blk = BlockLdlq(w.data(), m, n, s.h.data(), *cb, cfg);
      auto nea = NearestVectorRounding(w.data(), m, n, *cb, cfg);
      ASSERT_TRUE(blk.ok()) << blk.status();
      ASSERT_TRUE(nea.ok()) << nea.status();
      EXPECT_EQ(blk->scale, nea->scale);
      const double l_blk = ProxyLoss(w.data(), blk->w_hat.data(), s.h.data(), m, n);
      const double l_nea = ProxyLoss(w.data(), nea->w_hat.data(), s.h.data(), m, n);
      std::printf("seed+%d %-16s (dim %d) BlockLDLQ %.4e  nearest %.4e  ratio %.3f\n", 100 + trial,
                  cb->name().c_str(), cb->dim(), l_blk, l_nea, l_blk / l_nea);
      EXPECT_GT(l_blk, 0.0);
      EXPECT_LT(l_blk, l_nea) << cb->name() << " trial " << trial;
      // Codes decode to Ŵ / scale.
      std::vector<float> dec(m * n);
      cb->Decode(blk->codes.data(), m * n / cb->dim(), dec.data());
      for (int64_t i = 0; i < m * n; ++i) {
        ASSERT_EQ(blk->w_hat[i], blk->scale * static_cast<double>(dec[i]))
            << cb->name() << " " << i;
      }
    }
  }
}

// Ŵ = scale·Q((W + (W − Ŵ)U)/scale) with U = Lᵀ − I from the g-block LDL (the defining equation),
// recomputed independently with one dgemm.
void ExpectFixedPoint(const std::vector<double>& w, const VectorRoundingResult& r,
                      const std::vector<double>& h_damped, const VectorCodebook& cb) {
  const int64_t m = r.rows, n = r.cols, g = cb.dim();
  auto f = BlockLdlDecompose(h_damped.data(), n, g, LdlForm::kLtDL);
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<double> u(n * n);  // U = Lᵀ − I.
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) u[i * n + j] = f->L[j * n + i] - (i == j ? 1.0 : 0.0);
  }
  std::vector<double> e(m * n), x = w;
  for (int64_t i = 0; i < m * n; ++i) e[i] = w[i] - r.w_hat[i];
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0, e.data(), n, u.data(), n,
              1.0, x.data(), n);
  std::vector<float> in(m * n), out(m * n);
  for (int64_t i = 0; i < m * n; ++i) in[i] = static_cast<float>(x[i] / r.scale);
  cb.Quantize(in.data(), m * n / g, out.data(), nullptr);
  int64_t near_ties = 0;
  for (int64_t v = 0; v < m * n / g; ++v) {
    double da = 0, db = 0;
    bool same = true;
    for (int64_t j = 0; j < g; ++j) {
      const double a = out[v * g + j], b = r.w_hat[v * g + j] / r.scale, t = in[v * g + j];
      same &= r.scale * a == r.w_hat[v * g + j];  // Ŵ is stored as scale · point, exactly.
      da += (t - a) * (t - a);
      db += (t - b) * (t - b);
    }
    if (!same) {
      ++near_ties;
      ASSERT_LE(std::fabs(da - db), 1e-9) << "vector " << v << " is not the rounding of its target";
    }
  }
  EXPECT_LE(near_ties, 2);
}

TEST(RoundingTest, BlockLdlqSatisfiesItsFixedPointEquation) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 24, n = 96;
  const SyntheticHessian s = MakeHessian(n, g, 8.0, false);
  const std::vector<double> w = RandomMatrix(m, n, g);
  std::vector<double> hd = s.h;
  ASSERT_TRUE(DampHessian(hd.data(), n, 0.01).ok());
  const HalfIntGridCodebook c8(8, 4), c2(2, 4), c1(1, 8);
  const RandomVqCodebook vq(2, 16, seed);
  for (const VectorCodebook* cb :
       {static_cast<const VectorCodebook*>(&c8), static_cast<const VectorCodebook*>(&c2),
        static_cast<const VectorCodebook*>(&c1), static_cast<const VectorCodebook*>(&vq)}) {
    SCOPED_TRACE(cb->name() + " dim " + std::to_string(cb->dim()));
    for (int64_t lazy : {8, 128}) {
      VectorRoundingConfig cfg;
      cfg.lazy_block = lazy;
      auto r = BlockLdlq(w.data(), m, n, s.h.data(), *cb, cfg);
      ASSERT_TRUE(r.ok()) << r.status();
      ExpectFixedPoint(w, *r, hd, *cb);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// QuIP# Theorem 4.1 and Lemma B.1.
//
// Theorem 4.1: W ∈ R^{m×n} rounded by g-block LDLQ with a μ-incoherent H and a vector quantizer
// with E[(Q(x) − x)(Q(x) − x)ᵀ] ⪯ σ² I for every x ∈ R^g satisfies
//     E[tr((Ŵ − W) H (Ŵ − W)ᵀ)] <= (g m μ² σ² / n) · tr(H^{1/2})².
// The proof goes through E[proxy] <= m σ² tr(D) and Lemma B.1's tr(D) <= (g μ²/n) tr(H^{1/2})²
// (the lemma with n/g blocks of size g). Quantizers used here, on the unbounded grid Δ·Z^g:
//   * stochastic rounding per coordinate: covariance diag(p(1−p))Δ² ⪯ (Δ²/4) I -> σ² = Δ²/4;
//   * nearest rounding: deterministic, ‖Q(x) − x‖² <= gΔ²/4, so (Q(x)−x)(Q(x)−x)ᵀ ⪯ (gΔ²/4) I.
// ---------------------------------------------------------------------------------------------

struct TheoremCase {
  int g;
  bool stochastic;
  bool hadamard_basis;
};

TEST(RoundingTest, QuipSharpTheorem41BoundHolds) {
  const uint64_t seed = testing::TestSeed();
  const int64_t m = 32, n = 128;
  const int trials = 12;
  const double step = 0.25;  // Δ, about W's std / 4.
  for (const TheoremCase tc :
       {TheoremCase{1, true, false}, TheoremCase{1, true, true}, TheoremCase{8, true, false},
        TheoremCase{8, true, true}, TheoremCase{8, false, false}, TheoremCase{2, false, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "g " << tc.g << (tc.stochastic ? " stochastic" : " nearest")
                 << (tc.hadamard_basis ? " hadamard" : " orthogonal"));
    Gaussian g(seed + tc.g * 10 + tc.stochastic * 2 + tc.hadamard_basis);
    const SyntheticHessian s = MakeHessian(n, g, 6.0, tc.hadamard_basis);
    const double sigma2 = tc.stochastic ? step * step / 4.0 : tc.g * step * step / 4.0;
    const double bound = tc.g * m * s.mu * s.mu * sigma2 / n * s.trace_sqrt * s.trace_sqrt;
    // Lemma B.1 on the (undamped) H.
    auto f = BlockLdlDecompose(s.h.data(), n, tc.g, LdlForm::kLtDL);
    ASSERT_TRUE(f.ok());
    const double lemma = tc.g * s.mu * s.mu / n * s.trace_sqrt * s.trace_sqrt;
    EXPECT_LE(f->TraceD(), lemma);
    const IntegerGridCodebook cb(tc.g, step, tc.stochastic, seed ^ 0xabcdef);
    VectorRoundingConfig cfg;
    cfg.damp = 0.0;       // The theorem is about H itself.
    cfg.scale = 1.0;      // The grid step is absolute.
    cfg.num_threads = 1;  // One shared random stream: reproducible only single-threaded.
    double mean = 0;
    for (int t = 0; t < trials; ++t) {
      const std::vector<double> w = RandomMatrix(m, n, g);
      auto r = BlockLdlq(w.data(), m, n, s.h.data(), cb, cfg);
      ASSERT_TRUE(r.ok()) << r.status();
      const double loss = ProxyLoss(w.data(), r->w_hat.data(), s.h.data(), m, n);
      mean += loss / trials;
      if (!tc.stochastic) {  // Deterministic quantizer: the bound holds for every W.
        EXPECT_LE(loss, bound);
        EXPECT_LE(loss, m * sigma2 * f->TraceD());
      }
    }
    std::printf(
        "g %d %-10s %-10s mu %.3f  mean proxy %.4e  m*sigma2*tr(D) %.4e  bound %.4e  "
        "(mean/bound %.3f)  tr(D) %.4e <= lemma %.4e\n",
        tc.g, tc.stochastic ? "stochastic" : "nearest", tc.hadamard_basis ? "hadamard" : "orthog",
        s.mu, mean, m * sigma2 * f->TraceD(), bound, mean / bound, f->TraceD(), lemma);
    EXPECT_GT(mean, 0.0);
    EXPECT_LE(mean, bound);
    if (tc.hadamard_basis) {
      EXPECT_NEAR(s.mu, 1.0, 1e-12);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Determinism, dead inputs, errors.
// ---------------------------------------------------------------------------------------------

TEST(RoundingTest, SameSeedBitIdentical) {
  const uint64_t seed = testing::TestSeed();
  const int64_t m = 32, n = 192;
  auto run = [&](uint64_t sd) {
    Gaussian g(sd);
    const SyntheticHessian s = MakeHessian(n, g, 8.0, false);
    const std::vector<double> w = RandomMatrix(m, n, g);
    ScalarRoundingConfig cfg = ScalarCfg(3, false, QuantGranularity::kPerGroup, 64);
    cfg.act_order = true;
    cfg.quant.clip_search = true;
    auto a = Gptq(w.data(), m, n, s.h.data(), cfg);
    auto b = Ldlq(w.data(), m, n, s.h.data(), cfg);
    const IntegerGridCodebook cb(8, 0.3, /*stochastic=*/true, sd);
    VectorRoundingConfig vcfg;
    vcfg.num_threads = 1;
    auto c = BlockLdlq(w.data(), m, n, s.h.data(), cb, vcfg);
    EXPECT_TRUE(a.ok() && b.ok() && c.ok());
    std::vector<double> all = s.h;
    all.insert(all.end(), a->w_hat.begin(), a->w_hat.end());
    all.insert(all.end(), b->w_hat.begin(), b->w_hat.end());
    all.insert(all.end(), c->w_hat.begin(), c->w_hat.end());
    all.insert(all.end(), a->scales.begin(), a->scales.end());
    return all;
  };
  const std::vector<double> x = run(seed), y = run(seed);
  ASSERT_EQ(x.size(), y.size());
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(double)));
  EXPECT_NE(run(seed + 1), x);
}

TEST(RoundingTest, ScalarRoundingIsIndependentOfThreadCount) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  // GPTQ and LDLQ: 3 row tasks of 128 (the last ragged), 2 lazy blocks (the second ragged).
  const int64_t m = 300, n = 200;
  const SyntheticHessian s = MakeHessian(n, g, 6.0, false);
  const std::vector<double> w = RandomMatrix(m, n, g);
  for (QuantGranularity gran : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup}) {
    ScalarRoundingConfig cfg = ScalarCfg(3, false, gran, 48);
    cfg.act_order = gran == QuantGranularity::kPerGroup;
    cfg.refine_sweeps = 1;
    for (auto* round : {&Gptq, &Ldlq}) {
      cfg.num_threads = 1;
      auto a = (*round)(w.data(), m, n, s.h.data(), cfg);
      cfg.num_threads = 3;
      auto b = (*round)(w.data(), m, n, s.h.data(), cfg);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->codes, b->codes) << (round == &Gptq ? "gptq" : "ldlq");
      EXPECT_EQ(a->w_hat, b->w_hat);
      EXPECT_EQ(a->scales, b->scales);
      EXPECT_EQ(a->zeros, b->zeros);
    }
  }
  ScalarRoundingConfig bad = ScalarCfg(3, true, QuantGranularity::kPerChannel, 0);
  bad.num_threads = -2;
  EXPECT_EQ(Gptq(w.data(), m, n, s.h.data(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RoundingTest, VectorRoundingIsIndependentOfThreadCount) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  // BlockLDLQ: 5 row tasks (the last ragged) and 3 lazy blocks (cross-block feedback, a ragged
  // last block); nearest rounding: > 2 chunks of 256 vectors.
  const int64_t m = 600, n = 320;
  const SyntheticHessian s = MakeHessian(n, g, 6.0, false);
  const std::vector<double> w = RandomMatrix(m, n, g);
  const HalfIntGridCodebook c8(8, 4);
  const RandomVqCodebook vq(2, 16, seed);
  for (const VectorCodebook* cb :
       {static_cast<const VectorCodebook*>(&c8), static_cast<const VectorCodebook*>(&vq)}) {
    VectorRoundingConfig one, many;
    one.num_threads = 1;
    many.num_threads = 3;
    auto a = BlockLdlq(w.data(), m, n, s.h.data(), *cb, one);
    auto b = BlockLdlq(w.data(), m, n, s.h.data(), *cb, many);
    auto c = NearestVectorRounding(w.data(), m, n, *cb, one);
    auto d = NearestVectorRounding(w.data(), m, n, *cb, many);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
    EXPECT_EQ(a->w_hat, b->w_hat) << cb->name();
    EXPECT_EQ(a->codes, b->codes) << cb->name();
    EXPECT_EQ(c->w_hat, d->w_hat) << cb->name();
    EXPECT_EQ(c->codes, d->codes) << cb->name();
  }
  VectorRoundingConfig bad;
  bad.num_threads = -1;
  EXPECT_EQ(BlockLdlq(w.data(), m, n, s.h.data(), c8, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RoundingTest, BlockLdlqConsumingHessianEqualsCopyingBitForBit) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 300, n = 48;
  SyntheticHessian s = MakeHessian(n, g, 5.0, false);
  for (int64_t j = 0; j < n; ++j) s.h[7 * n + j] = s.h[j * n + 7] = 0.0;  // a dead input
  const std::vector<double> w = RandomMatrix(m, n, g);
  const HalfIntGridCodebook c8(8, 4);
  VectorRoundingConfig cfg;
  cfg.num_threads = 3;
  cfg.lazy_block = 16;
  auto copied = BlockLdlq(w.data(), m, n, s.h.data(), c8, cfg);
  auto consumed = BlockLdlqConsumingHessian(w.data(), m, n, s.h, c8, cfg);
  ASSERT_TRUE(copied.ok() && consumed.ok()) << copied.status() << consumed.status();
  EXPECT_EQ(copied->codes, consumed->codes);
  EXPECT_EQ(copied->w_hat, consumed->w_hat);
  EXPECT_EQ(copied->scale, consumed->scale);
  EXPECT_EQ(BlockLdlqConsumingHessian(w.data(), m, n, std::vector<double>(n), c8, cfg)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RoundingTest, GptqInPlaceEqualsGptqBitForBitAndRestoresH) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  struct Case {
    int64_t m, n;
    QuantGranularity gran;
    bool act_order;
    int refine;
  };
  // n = 600 spans three of the factorization's 256-wide tiles, the last ragged.
  for (const Case c : {Case{40, 600, QuantGranularity::kPerChannel, true, 0},
                       Case{33, 600, QuantGranularity::kPerGroup, true, 0},
                       Case{20, 96, QuantGranularity::kPerGroup, false, 1},
                       Case{17, 300, QuantGranularity::kPerTensor, true, 0}}) {
    SCOPED_TRACE(::testing::Message() << "m " << c.m << " n " << c.n << " act " << c.act_order);
    SyntheticHessian s = MakeHessian(c.n, g, 6.0, false);
    for (int64_t dead : {int64_t{5}, c.n - 2}) {
      for (int64_t j = 0; j < c.n; ++j) s.h[dead * c.n + j] = s.h[j * c.n + dead] = 0.0;
    }
    const std::vector<double> w = RandomMatrix(c.m, c.n, g);
    ScalarRoundingConfig cfg = ScalarCfg(3, false, c.gran);
    cfg.quant.group_size = 32;
    cfg.act_order = c.act_order;
    cfg.refine_sweeps = c.refine;
    cfg.num_threads = 2;
    auto copied = Gptq(w.data(), c.m, c.n, s.h.data(), cfg);
    std::vector<double> h = s.h;
    auto in_place = GptqInPlace(w.data(), c.m, c.n, h.data(), cfg);
    ASSERT_TRUE(copied.ok() && in_place.ok()) << copied.status() << in_place.status();
    EXPECT_EQ(copied->codes, in_place->codes);
    EXPECT_EQ(copied->w_hat, in_place->w_hat);
    EXPECT_EQ(copied->scales, in_place->scales);
    EXPECT_EQ(copied->zeros, in_place->zeros);
    EXPECT_EQ(copied->perm, in_place->perm);
    EXPECT_EQ(copied->g_idx, in_place->g_idx);
    EXPECT_TRUE(h == s.h) << "H not restored bit for bit";
    EXPECT_GT(ProxyLoss(w.data(), in_place->w_hat.data(), h.data(), c.m, c.n), 0.0);
  }
  // Not positive definite even after damping: the error, and H restored.
  const int64_t m = 8, n = 300;
  SyntheticHessian s = MakeHessian(n, g, 6.0, false);
  s.h[260 * n + 260] = -50.0;
  const std::vector<double> w = RandomMatrix(m, n, g);
  ScalarRoundingConfig cfg = ScalarCfg(4, true, QuantGranularity::kPerChannel);
  std::vector<double> h = s.h;
  auto bad = GptqInPlace(w.data(), m, n, h.data(), cfg);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  EXPECT_TRUE(h == s.h) << "H not restored after the failed factorization";
  // Not exactly symmetric: rounded by the copying form, H untouched.
  s = MakeHessian(n, g, 6.0, false);
  s.h[1 * n + 0] = std::nextafter(s.h[1 * n + 0], 1.0);
  h = s.h;
  auto copied = Gptq(w.data(), m, n, s.h.data(), cfg);
  auto in_place = GptqInPlace(w.data(), m, n, h.data(), cfg);
  ASSERT_TRUE(copied.ok() && in_place.ok());
  EXPECT_EQ(copied->codes, in_place->codes);
  EXPECT_TRUE(h == s.h);
}

TEST(RoundingTest, DeadInputsAreHandledLikeGptq) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 12, n = 40;
  SyntheticHessian s = MakeHessian(n, g, 4.0, false);
  for (int64_t dead : {3, 17}) {
    for (int64_t j = 0; j < n; ++j) s.h[dead * n + j] = s.h[j * n + dead] = 0.0;
  }
  const std::vector<double> w = RandomMatrix(m, n, g);
  ScalarRoundingConfig cfg = ScalarCfg(4, true, QuantGranularity::kPerChannel);
  auto a = Gptq(w.data(), m, n, s.h.data(), cfg);
  auto b = Ldlq(w.data(), m, n, s.h.data(), cfg);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->codes, b->codes);
  for (int64_t r = 0; r < m; ++r) {
    EXPECT_EQ(a->w_hat[r * n + 3], 0.0);
    EXPECT_EQ(a->w_hat[r * n + 17], 0.0);
  }
}

TEST(RoundingTest, Errors) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 4, n = 16;
  const std::vector<double> w = RandomMatrix(m, n, g);
  // Indefinite H, no damping: FailedPrecondition naming the problem.
  std::vector<double> h(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) h[i * n + i] = (i == 5) ? -1.0 : 1.0;
  ScalarRoundingConfig cfg = ScalarCfg(4, true, QuantGranularity::kPerChannel);
  cfg.damp = 0.0;
  for (auto fn : {&Gptq, &Ldlq}) {
    auto r = fn(w.data(), m, n, h.data(), cfg);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(std::string(r.status().message()).find("not positive definite"), std::string::npos)
        << r.status();
  }
  const HalfIntGridCodebook cb8(8, 4);
  VectorRoundingConfig vcfg;
  vcfg.damp = 0.0;
  auto r = BlockLdlq(w.data(), m, n, h.data(), cb8, vcfg);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // cols not a multiple of the codebook dim.
  std::vector<double> h12(12 * 12, 0.0);
  for (int i = 0; i < 12; ++i) h12[i * 12 + i] = 1.0;
  EXPECT_EQ(BlockLdlq(w.data(), 4, 12, h12.data(), cb8, VectorRoundingConfig{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NearestVectorRounding(w.data(), 4, 12, cb8, VectorRoundingConfig{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Per-token grids are for activations.
  std::vector<double> eye(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1.0;
  EXPECT_EQ(Gptq(w.data(), m, n, eye.data(), ScalarCfg(4, true, QuantGranularity::kPerToken))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Non-finite weights.
  std::vector<double> bad = w;
  bad[7] = NAN;
  EXPECT_EQ(Ldlq(bad.data(), m, n, eye.data(), ScalarCfg(4, true, QuantGranularity::kPerChannel))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Bad scale.
  vcfg = VectorRoundingConfig{};
  vcfg.scale = -1.0;
  EXPECT_EQ(BlockLdlq(w.data(), m, n, eye.data(), cb8, vcfg).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Refinement sweeps (RefineRounding).
// ---------------------------------------------------------------------------------------------

// A random PSD Hessian: the synthetic spectrum, or (rank_deficient) a Gram matrix of fewer
// samples than inputs plus a dead input, as real calibration Hessians can be.
std::vector<double> SweepHessian(int64_t n, Gaussian& g, int kind) {
  if (kind == 0) return MakeHessian(n, g, 6.0, false).h;
  if (kind == 1) return MakeHessian(n, g, 1.0, true).h;
  const int64_t samples = n / 2;
  const std::vector<double> x = RandomMatrix(samples, n, g);
  std::vector<double> h(n * n);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, samples, 1.0 / samples, x.data(), n,
              x.data(), n, 0.0, h.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) h[j * n + i] = h[i * n + j];
  }
  for (int64_t j = 0; j < n; ++j) h[3 * n + j] = h[j * n + 3] = 0.0;  // a dead input
  return h;
}

TEST(RoundingTest, RefineSweepsNeverIncreaseTheProxyLoss) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  auto e8p = MakeCodebook("e8p");
  auto rvq3 = MakeCodebook("rvq3_e8p_e8");
  ASSERT_TRUE(e8p.ok() && rvq3.ok());
  const HalfIntGridCodebook half(8, 4);
  double gain_vector = 0, gain_scalar = 0;
  int trials = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const int64_t m = 40 + 13 * trial, n = 64;
    const std::vector<double> h = SweepHessian(n, g, trial % 3);
    const std::vector<double> w = RandomMatrix(m, n, g);
    // Vector codebooks, at the default scale and at a deliberately poor one.
    for (const VectorCodebook* cb : {static_cast<const VectorCodebook*>(e8p->get()), static_cast<const VectorCodebook*>(rvq3->get()),
                                     static_cast<const VectorCodebook*>(&half)}) {
      for (double scale : {0.0, 0.5}) {
        VectorRoundingConfig cfg;
        cfg.scale = scale;
        cfg.lazy_block = 16;
        auto base = BlockLdlq(w.data(), m, n, h.data(), *cb, cfg);
        ASSERT_TRUE(base.ok()) << base.status();
        double prev = ProxyLoss(w.data(), base->w_hat.data(), h.data(), m, n);
        const double loss0 = prev;
        for (int sweeps : {1, 2, 5}) {
          cfg.refine_sweeps = sweeps;
          auto r = BlockLdlq(w.data(), m, n, h.data(), *cb, cfg);
          ASSERT_TRUE(r.ok()) << r.status();
          const double loss = ProxyLoss(w.data(), r->w_hat.data(), h.data(), m, n);
          EXPECT_LE(loss, prev * (1 + 1e-12)) << cb->name() << " trial " << trial << " sweeps "
                                              << sweeps << " scale " << scale;
          EXPECT_NEAR(r->refine.loss_before, loss0, 1e-9 * loss0);
          EXPECT_NEAR(r->refine.loss_after, loss, 1e-9 * loss0);
          EXPECT_LE(r->refine.sweeps, sweeps);
          // The codes still reproduce Ŵ.
          std::vector<float> pts(n);
          for (int64_t row = 0; row < m; ++row) {
            cb->Decode(&r->codes[row * (n / cb->dim()) * cb->code_words()], n / cb->dim(),
                       pts.data());
            for (int64_t j = 0; j < n; ++j) {
              ASSERT_EQ(r->w_hat[row * n + j], r->scale * static_cast<double>(pts[j]));
            }
          }
          prev = loss;
        }
        gain_vector += 1 - prev / loss0;
        ++trials;
      }
    }
    // Scalar grids: GPTQ and LDLQ, per channel and grouped, with and without act order.
    for (bool act_order : {false, true}) {
      for (QuantGranularity gran : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup}) {
        ScalarRoundingConfig cfg = ScalarCfg(2 + trial % 3, trial % 2 == 0, gran, 16);
        cfg.act_order = act_order;
        for (auto fn : {&Gptq, &Ldlq}) {
          auto base = fn(w.data(), m, n, h.data(), cfg);
          ASSERT_TRUE(base.ok()) << base.status();
          cfg.refine_sweeps = 4;
          auto r = fn(w.data(), m, n, h.data(), cfg);
          cfg.refine_sweeps = 0;
          ASSERT_TRUE(r.ok()) << r.status();
          const double loss0 = ProxyLoss(w.data(), base->w_hat.data(), h.data(), m, n);
          const double loss = ProxyLoss(w.data(), r->w_hat.data(), h.data(), m, n);
          EXPECT_LE(loss, loss0 * (1 + 1e-12)) << "scalar trial " << trial;
          EXPECT_EQ(r->scales, base->scales);
          for (int64_t row = 0; row < m; ++row) {
            for (int64_t j = 0; j < n; ++j) {
              ASSERT_EQ(r->w_hat[row * n + j],
                        ScalarDequantizeCode(r->codes[row * n + j], r->params(row, j)));
            }
          }
          gain_scalar += 1 - loss / loss0;
        }
      }
    }
  }
  // The sweeps do something: the mean reduction is positive for both kinds of codebook.
  std::printf("mean proxy-loss reduction: vector %.4f, scalar %.4f\n", gain_vector / trials,
              gain_scalar / 48);
  EXPECT_GT(gain_vector / trials, 0.01);
  EXPECT_GT(gain_scalar / 48, 0.001);
}

TEST(RoundingTest, RefineSweepsAreIndependentOfThreadCountAndHessianOwnership) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t m = 700, n = 48;
  const std::vector<double> h = SweepHessian(n, g, 2);
  const std::vector<double> w = RandomMatrix(m, n, g);
  auto e8p = MakeCodebook("e8p");
  ASSERT_TRUE(e8p.ok());
  VectorRoundingConfig one, many;
  one.num_threads = 1;
  many.num_threads = 3;
  one.refine_sweeps = many.refine_sweeps = 3;
  one.lazy_block = many.lazy_block = 16;
  auto a = BlockLdlq(w.data(), m, n, h.data(), **e8p, one);
  auto b = BlockLdlq(w.data(), m, n, h.data(), **e8p, many);
  auto c = BlockLdlqConsumingHessian(w.data(), m, n, h, **e8p, many);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_GT(a->refine.changed, 0);
  EXPECT_EQ(a->codes, b->codes);
  EXPECT_EQ(a->w_hat, b->w_hat);
  EXPECT_EQ(a->codes, c->codes);
  EXPECT_EQ(a->w_hat, c->w_hat);
  EXPECT_EQ(a->refine.changed, c->refine.changed);
  // Errors.
  VectorRoundingResult res = *a;
  EXPECT_EQ(RefineRounding(w.data(), h.data(), -1, 0.01, 16, 1, **e8p, &res).status().code(),
            absl::StatusCode::kInvalidArgument);
  res.codes.pop_back();
  EXPECT_EQ(RefineRounding(w.data(), h.data(), 1, 0.01, 16, 1, **e8p, &res).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace qcal::kernels
