// Tests for incoherence processing (kernels/incoherence.h): QuIP# Algorithms 2, 3 and 4.
//
// Random inputs are fresh per run; the seed is printed and can be pinned with QCAL_TEST_SEED.
// Tolerances (fp64): 1e-12 relative to the largest entry for transform∘inverse, agreement with
// dense products and the activation path; 1e-9 relative for proxy-loss invariance (a trace of
// m·n² products); bit-identical for same-seed reruns. fp32 activation path: 1e-5 relative to the
// output's largest entry.
#include "kernels/incoherence.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/hadamard.h"
#include "kernels/rounding.h"
#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

uint64_t Seed() { return qcal::testing::ProcessSeed(); }
std::mt19937_64 Rng(uint64_t salt) { return qcal::testing::SeededRng(salt); }

// Seeds for U and V derived from the test seed (distinct per salt).
uint64_t TransformSeed(uint64_t salt) { return Rng(salt + 1000)(); }

std::vector<double> Gaussian(int64_t size, uint64_t salt, double sigma = 1.0) {
  std::mt19937_64 rng = Rng(salt);
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<double> v(size);
  for (double& x : v) x = normal(rng);
  return v;
}

double MaxAbs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// ‖a − b‖_max / ‖b‖_max.
double RelMaxErr(const std::vector<double>& a, const std::vector<double>& b) {
  return MaxAbsDiff(a, b) / MaxAbs(b);
}

// C = A·B for row-major A [r, k], B [k, c].
std::vector<double> MatMul(const std::vector<double>& a, const std::vector<double>& b, int64_t r,
                           int64_t k, int64_t c) {
  std::vector<double> out(r * c, 0.0);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t l = 0; l < k; ++l) {
      const double x = a[i * k + l];
      for (int64_t j = 0; j < c; ++j) out[i * c + j] += x * b[l * c + j];
    }
  return out;
}

std::vector<double> Transpose(const std::vector<double>& a, int64_t r, int64_t c) {
  std::vector<double> t(r * c);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  return t;
}

// Dense T (d×d row-major) built independently of the fast transforms, from hadamard.h's
// documented definitions: T = (H_d/√d)·diag(s) with H_d = H_{2^k} ⊗ H_m (Sylvester H_{2^k}),
// or, for kRfft, the real form of F·diag(p) on interleaved (re, im) pairs.
std::vector<double> DenseTransform(const RandomizedTransform& t) {
  const int64_t d = t.dim();
  std::vector<double> out(d * d, 0.0);
  if (t.plan.IsHadamard()) {
    const int64_t m = t.plan.m, p2 = t.plan.pow2;
    std::vector<int8_t> hm(1, 1);
    if (m > 1) {
      StatusOr<HadamardMatrix> h = GetHadamardMatrix(static_cast<int>(m));
      EXPECT_TRUE(h.ok()) << h.status();
      hm = h->entries;
    }
    const double scale = 1.0 / std::sqrt(double(d));
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) {
        const int64_t a = i / m, b = i % m, a2 = j / m, b2 = j % m;
        EXPECT_LT(a, p2);
        const int sylvester = (__builtin_popcountll(uint64_t(a & a2)) & 1) ? -1 : 1;
        out[i * d + j] = sylvester * hm[b * m + b2] * t.signs[j] * scale;
      }
  } else {
    const int64_t half = d / 2;
    const double pi = std::acos(-1.0);
    for (int64_t j = 0; j < half; ++j)
      for (int64_t k = 0; k < half; ++k) {
        const double ang = -2.0 * pi * double((j * k) % half) / double(half);
        const std::complex<double> c = std::polar(1.0 / std::sqrt(double(half)), ang) * t.phases[k];
        out[(2 * j) * d + 2 * k] = c.real();
        out[(2 * j + 1) * d + 2 * k] = c.imag();
        out[(2 * j) * d + 2 * k + 1] = -c.imag();
        out[(2 * j + 1) * d + 2 * k + 1] = c.real();
      }
  }
  return out;
}

// A symmetric positive definite "Hessian" with a spread spectrum: X Xᵀ/k + a few spikes + ridge.
std::vector<double> RandomHessian(int64_t n, uint64_t salt) {
  const int64_t k = n + 16;
  std::vector<double> x = Gaussian(n * k, salt);
  std::vector<double> h(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += x[i * k + l] * x[j * k + l];
      h[i * n + j] = h[j * n + i] = s / double(k);
    }
  for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 3)) h[i * n + i] += 50.0;
  for (int64_t i = 0; i < n; ++i) h[i * n + i] += 1e-3;
  return h;
}

struct Shape {
  int64_t m, n;
};

std::string PlanText(int64_t d) { return DescribeHadamardPlan(PlanHadamard(d)); }

IncoherenceTransforms MakeTransforms(int64_t m, int64_t n, uint64_t salt) {
  StatusOr<IncoherenceTransforms> t =
      MakeIncoherenceTransforms(m, n, TransformSeed(2 * salt), TransformSeed(2 * salt + 1));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

// Shapes covering every construction: pow2, pow2·m (172, 4·172, 12·2^k), rfft (202, 110), and
// the stories260K linear-layer shapes (dim 64, hidden 172, kv 32).
const std::vector<Shape>& TestShapes() {
  static const std::vector<Shape> shapes = {
      {64, 64},  {256, 128}, {32, 64},  {64, 172}, {172, 64},  {688, 96},
      {96, 688}, {384, 48},  {202, 64}, {64, 202}, {202, 110}, {110, 384},
  };
  return shapes;
}

TEST(IncoherenceTest, TestSizesCoverEveryConstruction) {
  EXPECT_EQ(PlanHadamard(64).kind, HadamardKind::kPow2);
  EXPECT_EQ(PlanHadamard(172).kind, HadamardKind::kPow2TimesM);
  EXPECT_EQ(PlanHadamard(688).kind, HadamardKind::kPow2TimesM);
  EXPECT_EQ(PlanHadamard(688).m, 172);
  EXPECT_EQ(PlanHadamard(384).kind, HadamardKind::kPow2TimesM);
  EXPECT_EQ(PlanHadamard(384).m, 12);
  EXPECT_EQ(PlanHadamard(96).m, 12);
  EXPECT_EQ(PlanHadamard(48).m, 12);
  EXPECT_EQ(PlanHadamard(202).kind, HadamardKind::kRfft);
  EXPECT_EQ(PlanHadamard(110).kind, HadamardKind::kRfft);
}

// Ŵ = U W Vᵀ and Ĥ = V H Vᵀ against dense products with independently built U and V.
TEST(IncoherenceTest, ProcessMatchesDenseProducts) {
  QCAL_SEED_TRACE();
  uint64_t salt = 0;
  for (const Shape& s : TestShapes()) {
    if (s.m * s.n > 64 * 1024) continue;  // Dense n³ references: keep them small.
    ++salt;
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    const std::vector<double> w = Gaussian(s.m * s.n, salt);
    const std::vector<double> h = RandomHessian(s.n, salt + 100);
    const uint64_t seed_u = TransformSeed(2 * salt), seed_v = TransformSeed(2 * salt + 1);
    StatusOr<IncoherenceResult> r =
        IncoherenceProcess(w.data(), s.m, s.n, h.data(), seed_u, seed_v);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->transforms.u.plan.kind, PlanHadamard(s.m).kind);
    EXPECT_EQ(r->transforms.v.plan.kind, PlanHadamard(s.n).kind);
    const std::vector<double> u = DenseTransform(r->transforms.u);
    const std::vector<double> v = DenseTransform(r->transforms.v);
    const std::vector<double> vt = Transpose(v, s.n, s.n);
    const std::vector<double> w_ref = MatMul(MatMul(u, w, s.m, s.m, s.n), vt, s.m, s.n, s.n);
    const std::vector<double> h_ref = MatMul(MatMul(v, h, s.n, s.n, s.n), vt, s.n, s.n, s.n);
    EXPECT_LE(RelMaxErr(r->w_hat, w_ref), 1e-12);
    EXPECT_LE(RelMaxErr(r->h_hat, h_ref), 1e-12);

    // Same as hadamard.h's seeded dispatcher applied as documented (rows with V, columns with U).
    std::vector<double> w_disp = w;
    ASSERT_TRUE(RandomizedOrthogonalTransformMatrix(w_disp.data(), s.m, s.n, MatrixAxis::kRows,
                                                    seed_v, TransformDirection::kForward)
                    .ok());
    ASSERT_TRUE(RandomizedOrthogonalTransformMatrix(w_disp.data(), s.m, s.n, MatrixAxis::kColumns,
                                                    seed_u, TransformDirection::kForward)
                    .ok());
    EXPECT_EQ(0, std::memcmp(w_disp.data(), r->w_hat.data(), w_disp.size() * sizeof(double)));
  }
}

// tr(E H Eᵀ) = tr(Ê Ĥ Êᵀ) with Ê = U E Vᵀ; and a quantized Ŵ_q mapped back with RecoverWeights
// has the same proxy loss in W-space as in the rotated space.
TEST(IncoherenceTest, ProxyLossIsPreserved) {
  QCAL_SEED_TRACE();
  uint64_t salt = 50;
  for (const Shape& s : TestShapes()) {
    ++salt;
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    const IncoherenceTransforms t = MakeTransforms(s.m, s.n, salt);
    const std::vector<double> h = RandomHessian(s.n, salt + 100);
    const std::vector<double> zero(s.m * s.n, 0.0);

    // Arbitrary perturbation E.
    const std::vector<double> e = Gaussian(s.m * s.n, salt + 200, 0.1);
    StatusOr<IncoherenceResult> r = IncoherenceProcess(e.data(), h.data(), t);
    ASSERT_TRUE(r.ok()) << r.status();
    const double loss = ProxyLoss(zero.data(), e.data(), h.data(), s.m, s.n);
    const double loss_hat = ProxyLoss(zero.data(), r->w_hat.data(), r->h_hat.data(), s.m, s.n);
    ASSERT_GT(loss, 0.0);
    EXPECT_LE(std::abs(loss_hat - loss) / loss, 1e-9) << loss << " vs " << loss_hat;

    // Quantize in the rotated space (round to a coarse grid), map back, compare losses.
    const std::vector<double> w = Gaussian(s.m * s.n, salt + 300);
    StatusOr<IncoherenceResult> rw = IncoherenceProcess(w.data(), h.data(), t);
    ASSERT_TRUE(rw.ok()) << rw.status();
    std::vector<double> w_hat_q = rw->w_hat;
    for (double& x : w_hat_q) x = 0.25 * std::nearbyint(x / 0.25);
    StatusOr<std::vector<double>> w_q = RecoverWeights(t, w_hat_q.data());
    ASSERT_TRUE(w_q.ok()) << w_q.status();
    const double q_loss = ProxyLoss(w.data(), w_q->data(), h.data(), s.m, s.n);
    const double q_loss_hat =
        ProxyLoss(rw->w_hat.data(), w_hat_q.data(), rw->h_hat.data(), s.m, s.n);
    ASSERT_GT(q_loss, 0.0);
    EXPECT_LE(std::abs(q_loss_hat - q_loss) / q_loss, 1e-9) << q_loss << " vs " << q_loss_hat;
    std::printf(
        "[ proxy    ] %-24s x %-24s tr(EHE^T) %.12e rel.diff %.1e; quantized %.6e rel.diff "
        "%.1e\n",
        PlanText(s.m).c_str(), PlanText(s.n).c_str(), loss, std::abs(loss_hat - loss) / loss,
        q_loss, std::abs(q_loss_hat - q_loss) / q_loss);
  }
}

TEST(IncoherenceTest, InverseRestoresWeightsHessianAndVectors) {
  QCAL_SEED_TRACE();
  uint64_t salt = 100;
  for (const Shape& s : TestShapes()) {
    ++salt;
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    const IncoherenceTransforms t = MakeTransforms(s.m, s.n, salt);
    const std::vector<double> w = Gaussian(s.m * s.n, salt);
    std::vector<double> a = w;
    ASSERT_TRUE(TransformWeights(t, a.data()).ok());
    double norm_w = 0, norm_a = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      norm_w += w[i] * w[i];
      norm_a += a[i] * a[i];
    }
    EXPECT_LE(std::abs(norm_a - norm_w) / norm_w, 1e-12);  // U, V orthogonal.
    EXPECT_GT(MaxAbsDiff(a, w), 0.1);
    ASSERT_TRUE(RestoreWeights(t, a.data()).ok());
    EXPECT_LE(RelMaxErr(a, w), 1e-12);

    const std::vector<double> h = RandomHessian(s.n, salt + 7);
    std::vector<double> hh = h;
    ASSERT_TRUE(TransformHessian(t.v, hh.data()).ok());
    ASSERT_TRUE(RestoreHessian(t.v, hh.data()).ok());
    EXPECT_LE(RelMaxErr(hh, h), 1e-12);

    const int64_t batch = 3;
    const std::vector<double> x = Gaussian(batch * s.n, salt + 9);
    std::vector<double> xx = x;
    ASSERT_TRUE(TransformInputs(t, xx.data(), batch).ok());
    ASSERT_TRUE(ApplyTransform(t.v, xx.data(), batch, TransformDirection::kInverse).ok());
    EXPECT_LE(RelMaxErr(xx, x), 1e-12);
    const std::vector<double> y = Gaussian(batch * s.m, salt + 11);
    std::vector<double> yy = y;
    ASSERT_TRUE(RestoreOutputs(t, yy.data(), batch).ok());
    ASSERT_TRUE(ApplyTransform(t.u, yy.data(), batch, TransformDirection::kForward).ok());
    EXPECT_LE(RelMaxErr(yy, y), 1e-12);
  }
}

// Algorithm 2: y = W x equals Uᵀ(Ŵ(V x)).
TEST(IncoherenceTest, ActivationPathMatchesDenseForward) {
  QCAL_SEED_TRACE();
  uint64_t salt = 150;
  const int64_t batch = 5;
  for (const Shape& s : TestShapes()) {
    ++salt;
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    const std::vector<double> w = Gaussian(s.m * s.n, salt);
    const std::vector<double> x = Gaussian(batch * s.n, salt + 1);
    StatusOr<IncoherenceResult> r =
        IncoherenceProcess(w.data(), s.m, s.n, nullptr, TransformSeed(salt), TransformSeed(~salt));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->h_hat.empty());
    // Y = X Wᵀ [batch, m].
    const std::vector<double> y_ref = MatMul(x, Transpose(w, s.m, s.n), batch, s.n, s.m);
    ASSERT_GT(MaxAbs(y_ref), 0.0);

    std::vector<double> xh = x;
    ASSERT_TRUE(TransformInputs(r->transforms, xh.data(), batch).ok());
    std::vector<double> y = MatMul(xh, Transpose(r->w_hat, s.m, s.n), batch, s.n, s.m);
    ASSERT_TRUE(RestoreOutputs(r->transforms, y.data(), batch).ok());
    EXPECT_LE(RelMaxErr(y, y_ref), 1e-12);

    // float path: same algebra in single precision.
    std::vector<float> xf(x.begin(), x.end());
    std::vector<float> wf(r->w_hat.begin(), r->w_hat.end());
    ASSERT_TRUE(TransformInputs(r->transforms, xf.data(), batch).ok());
    std::vector<float> yf(batch * s.m, 0.0f);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < s.m; ++i) {
        float acc = 0.0f;
        for (int64_t j = 0; j < s.n; ++j) acc += wf[i * s.n + j] * xf[b * s.n + j];
        yf[b * s.m + i] = acc;
      }
    ASSERT_TRUE(RestoreOutputs(r->transforms, yf.data(), batch).ok());
    EXPECT_LE(RelMaxErr(std::vector<double>(yf.begin(), yf.end()), y_ref), 1e-5);
  }
}

TEST(IncoherenceTest, FloatWeightsMatchDouble) {
  QCAL_SEED_TRACE();
  for (const Shape& s : {Shape{64, 172}, Shape{202, 64}}) {
    const IncoherenceTransforms t = MakeTransforms(s.m, s.n, 7);
    const std::vector<double> w = Gaussian(s.m * s.n, 8);
    std::vector<double> wd = w;
    std::vector<float> wf(w.begin(), w.end());
    ASSERT_TRUE(TransformWeights(t, wd.data()).ok());
    ASSERT_TRUE(TransformWeights(t, wf.data()).ok());
    EXPECT_LE(RelMaxErr(std::vector<double>(wf.begin(), wf.end()), wd), 1e-5);
    ASSERT_TRUE(RestoreWeights(t, wf.data()).ok());
    EXPECT_LE(RelMaxErr(std::vector<double>(wf.begin(), wf.end()), w), 1e-5);
  }
}

TEST(IncoherenceTest, SameSeedIsBitIdenticalAndSeedsDiffer) {
  QCAL_SEED_TRACE();
  for (const Shape& s : {Shape{172, 64}, Shape{202, 688}}) {
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    const std::vector<double> w = Gaussian(s.m * s.n, 1);
    const std::vector<double> h = RandomHessian(s.n, 2);
    const uint64_t su = TransformSeed(3), sv = TransformSeed(4);
    StatusOr<IncoherenceResult> a = IncoherenceProcess(w.data(), s.m, s.n, h.data(), su, sv);
    StatusOr<IncoherenceResult> b = IncoherenceProcess(w.data(), s.m, s.n, h.data(), su, sv);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(0, std::memcmp(a->w_hat.data(), b->w_hat.data(), w.size() * sizeof(double)));
    EXPECT_EQ(0, std::memcmp(a->h_hat.data(), b->h_hat.data(), h.size() * sizeof(double)));
    EXPECT_EQ(a->transforms.u.signs, b->transforms.u.signs);
    EXPECT_EQ(a->transforms.u.phases, b->transforms.u.phases);
    EXPECT_EQ(a->transforms.v.signs, b->transforms.v.signs);
    EXPECT_TRUE(a->transforms.u.has_seed);
    EXPECT_EQ(a->transforms.u.seed, su);
    EXPECT_EQ(a->transforms.v.seed, sv);

    StatusOr<IncoherenceResult> c =
        IncoherenceProcess(w.data(), s.m, s.n, h.data(), su + 1, sv + 1);
    ASSERT_TRUE(c.ok());
    const auto& tu = a->transforms.u;
    const auto& tc = c->transforms.u;
    if (tu.plan.IsHadamard()) {
      EXPECT_NE(tu.signs, tc.signs);
    } else {
      EXPECT_NE(tu.phases, tc.phases);
    }
    EXPECT_NE(a->transforms.v.signs, c->transforms.v.signs);
    EXPECT_GT(MaxAbsDiff(a->w_hat, c->w_hat), 0.1);
  }
}

// A checkpoint stores signs (or phases); rebuilding from them reproduces the transform exactly.
TEST(IncoherenceTest, StoredSignsAndPhasesReproduceTransforms) {
  QCAL_SEED_TRACE();
  const IncoherenceTransforms t = MakeTransforms(202, 172, 21);
  ASSERT_EQ(t.u.kind(), HadamardKind::kRfft);
  ASSERT_EQ(t.v.kind(), HadamardKind::kPow2TimesM);
  for (int8_t s : t.v.signs) ASSERT_TRUE(s == 1 || s == -1);
  EXPECT_EQ(t.v.signs, RandomSigns(172, t.v.seed));
  IncoherenceTransforms loaded;
  StatusOr<RandomizedTransform> u = RandomizedTransformFromPhases(202, t.u.phases);
  StatusOr<RandomizedTransform> v = RandomizedTransformFromSigns(t.v.signs);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->has_seed);
  loaded.u = *u;
  loaded.v = *v;
  const std::vector<double> w = Gaussian(202 * 172, 22);
  std::vector<double> a = w, b = w;
  ASSERT_TRUE(TransformWeights(t, a.data()).ok());
  ASSERT_TRUE(TransformWeights(loaded, b.data()).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double)));
}

// Planted outliers: μ_W falls from ~sqrt(mn)-ish to the Lemma 3.1 scale.
TEST(IncoherenceTest, WeightIncoherenceDropsWithPlantedOutliers) {
  QCAL_SEED_TRACE();
  uint64_t salt = 300;
  for (const Shape& s :
       {Shape{256, 688}, Shape{202, 172}, Shape{64, 172}, Shape{32, 64}, Shape{110, 202}}) {
    ++salt;
    SCOPED_TRACE(PlanText(s.m) + " by " + PlanText(s.n));
    std::vector<double> w = Gaussian(s.m * s.n, salt);
    std::mt19937_64 rng = Rng(salt + 1);
    for (int k = 0; k < 4; ++k) {
      const int64_t i = static_cast<int64_t>(rng() % uint64_t(s.m * s.n));
      w[i] = 100.0 * (w[i] >= 0 ? 1.0 : -1.0) * (1.0 + std::abs(w[i]));
    }
    StatusOr<double> before = WeightIncoherence(w.data(), s.m, s.n);
    ASSERT_TRUE(before.ok()) << before.status();
    StatusOr<IncoherenceResult> r =
        IncoherenceProcess(w.data(), s.m, s.n, nullptr, TransformSeed(salt), TransformSeed(~salt));
    ASSERT_TRUE(r.ok()) << r.status();
    StatusOr<double> after = WeightIncoherence(r->w_hat.data(), s.m, s.n);
    ASSERT_TRUE(after.ok()) << after.status();
    // Lemma 3.1 with failure probability δ = 1e-6.
    const double bound = 2.0 * std::log(4.0 * double(s.m) * double(s.n) / 1e-6);
    std::printf(
        "[ mu_W     ] %4lldx%-4lld before %8.2f after %6.2f (Lemma 3.1 bound, delta=1e-6: "
        "%.1f)\n",
        static_cast<long long>(s.m), static_cast<long long>(s.n), *before, *after, bound);
    EXPECT_LT(*after, *before / 4.0);
    EXPECT_LE(*after, bound);
    EXPECT_GE(*after, 1.0);
  }
}

// H with a few dominant coordinate directions: its eigenvectors are ≈ e_i (μ_H ≈ sqrt(n)); after
// the RHT/RFFT they are spread out.
TEST(IncoherenceTest, HessianIncoherenceDropsForDominantCoordinates) {
  QCAL_SEED_TRACE();
  uint64_t salt = 400;
  for (int64_t n : {1024, 688, 256, 202, 172}) {
    for (bool distinct_bulk : {true, false}) {
      ++salt;
      SCOPED_TRACE(PlanText(n) + (distinct_bulk ? " distinct bulk" : " flat bulk"));
      std::mt19937_64 rng = Rng(salt);
      std::uniform_real_distribution<double> unif(0.0, 1.0);
      // Small noise: G Gᵀ / n scaled by eps. With a distinct (gapped) bulk the eigenvectors stay
      // ≈ e_i everywhere; with a flat bulk only the spikes' do.
      const double eps = distinct_bulk ? 1e-7 : 1e-2;
      const std::vector<double> g = Gaussian(n * n, salt + 1);
      std::vector<double> h(n * n, 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
          double sum = 0;
          for (int64_t l = 0; l < n; ++l) sum += g[i * n + l] * g[j * n + l];
          h[i * n + j] = h[j * n + i] = eps * sum / double(n);
        }
      for (int64_t i = 0; i < n; ++i) h[i * n + i] += distinct_bulk ? 1.0 + unif(rng) : 1.0;
      for (int k = 0; k < 4; ++k) h[(rng() % n) * (n + 1)] += 1e4 * (1.0 + k);
      StatusOr<double> before = HessianIncoherence(h.data(), n);
      ASSERT_TRUE(before.ok()) << before.status();
      StatusOr<RandomizedTransform> v = MakeRandomizedTransform(n, TransformSeed(salt));
      ASSERT_TRUE(v.ok()) << v.status();
      ASSERT_TRUE(TransformHessian(*v, h.data()).ok());
      StatusOr<double> after = HessianIncoherence(h.data(), n);
      ASSERT_TRUE(after.ok()) << after.status();
      const double bound = std::sqrt(2.0 * std::log(2.0 * double(n) * double(n) / 1e-6));
      std::printf(
          "[ mu_H     ] %-22s %-13s before %6.2f (sqrt n = %5.2f) after %5.2f (Lemma 3.1 "
          "bound, delta=1e-6: %.2f)\n",
          PlanText(n).c_str(), distinct_bulk ? "distinct bulk" : "flat bulk", *before,
          std::sqrt(double(n)), *after, bound);
      EXPECT_GT(*before, 0.9 * std::sqrt(double(n)));
      EXPECT_LE(*after, bound);
      if (distinct_bulk || n >= 512) {
        EXPECT_LT(*after, *before / 4.0);
      }
    }
  }
}

TEST(IncoherenceTest, MeasuresOnKnownMatrices) {
  QCAL_SEED_TRACE();
  std::vector<double> ones(6 * 8, -0.5);
  EXPECT_NEAR(*WeightIncoherence(ones.data(), 6, 8), 1.0, 1e-15);
  std::vector<double> spike(6 * 8, 0.0);
  spike[13] = 3.0;
  EXPECT_NEAR(*WeightIncoherence(spike.data(), 6, 8), std::sqrt(48.0), 1e-12);
  std::vector<float> spike_f(spike.begin(), spike.end());
  EXPECT_NEAR(*WeightIncoherence(spike_f.data(), 6, 8), std::sqrt(48.0), 1e-12);
  // Huge entries do not overflow the Frobenius norm.
  std::vector<double> big(4 * 4, 1e300);
  EXPECT_NEAR(*WeightIncoherence(big.data(), 4, 4), 1.0, 1e-12);

  // Diagonal H with distinct entries: Q = permutation, μ_H = sqrt(n).
  const int64_t n = 64;
  std::vector<double> d(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) d[i * n + i] = 1.0 + double(i);
  EXPECT_NEAR(*HessianIncoherence(d.data(), n), 8.0, 1e-12);
  // V D Vᵀ with a Hadamard V: eigenvectors are V's columns, all entries ±1/sqrt(n): μ_H = 1.
  StatusOr<RandomizedTransform> v = MakeRandomizedTransform(n, TransformSeed(5));
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(TransformHessian(*v, d.data()).ok());
  EXPECT_NEAR(*HessianIncoherence(d.data(), n), 1.0, 1e-10);
}

TEST(IncoherenceTest, RejectsInvalidInput) {
  QCAL_SEED_TRACE();
  std::vector<double> w(63 * 64, 1.0);
  // Odd dimension: no orthogonal transform.
  StatusOr<IncoherenceResult> odd = IncoherenceProcess(w.data(), 63, 64, nullptr, 1, 2);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(odd.status().message()).find("U (out_features)"), std::string::npos)
      << odd.status();
  EXPECT_EQ(MakeRandomizedTransform(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IncoherenceProcess(nullptr, 64, 64, nullptr, 1, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<double> bad(64 * 64, 0.0);
  bad[77] = std::nan("");
  EXPECT_EQ(IncoherenceProcess(bad.data(), 64, 64, nullptr, 1, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IncoherenceProcess(w.data(), 64, 64, bad.data(), 1, 2).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Stored state that does not fit.
  EXPECT_FALSE(RandomizedTransformFromSigns(std::vector<int8_t>(202, 1)).ok());  // rfft size
  std::vector<int8_t> signs(64, 1);
  signs[3] = 0;
  EXPECT_FALSE(RandomizedTransformFromSigns(signs).ok());
  EXPECT_FALSE(RandomizedTransformFromPhases(64, std::vector<std::complex<double>>(32, 1.0)).ok());
  EXPECT_FALSE(
      RandomizedTransformFromPhases(202, std::vector<std::complex<double>>(100, 1.0)).ok());
  EXPECT_FALSE(
      RandomizedTransformFromPhases(202, std::vector<std::complex<double>>(101, 2.0)).ok());
  EXPECT_TRUE(RandomizedTransformFromPhases(202, std::vector<std::complex<double>>(101, 1.0)).ok());

  // Buffer / transform size mismatches leave the buffer untouched.
  StatusOr<RandomizedTransform> t64 = MakeRandomizedTransform(64, 9);
  ASSERT_TRUE(t64.ok());
  std::vector<double> a(32 * 48, 1.5);
  EXPECT_FALSE(
      ApplyTransformMatrix(*t64, a.data(), 32, 48, MatrixAxis::kRows, TransformDirection::kForward)
          .ok());
  for (double x : a) ASSERT_EQ(x, 1.5);
  RandomizedTransform broken = *t64;
  broken.signs.pop_back();
  EXPECT_FALSE(ApplyTransform(broken, a.data(), 1, TransformDirection::kForward).ok());
  IncoherenceTransforms pair = MakeTransforms(64, 64, 3);
  EXPECT_FALSE(TransformInputs(pair, a.data(), -1).ok());
  EXPECT_TRUE(TransformInputs(pair, static_cast<double*>(nullptr), 0).ok());
  EXPECT_FALSE(RestoreOutputs(pair, static_cast<double*>(nullptr), 2).ok());

  // Measures.
  std::vector<double> zeros(16, 0.0);
  EXPECT_FALSE(WeightIncoherence(zeros.data(), 4, 4).ok());
  EXPECT_FALSE(WeightIncoherence(static_cast<const double*>(nullptr), 4, 4).ok());
  EXPECT_FALSE(HessianIncoherence(bad.data(), 64).ok());
  EXPECT_FALSE(HessianIncoherence(zeros.data(), 0).ok());
}

}  // namespace
}  // namespace qcal::kernels
