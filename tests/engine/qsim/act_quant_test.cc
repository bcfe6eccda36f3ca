// Simulated activation / KV-cache quantizers and the online Hadamard (engine/qsim/act_quant.h)
// against hand-computed values and, bit for bit, against the CPU reference kernels
// (kernels/scalar_quant.h, kernels/hadamard.h).
#include <cmath>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernels/hadamard.h"
#include "kernels/scalar_quant.h"
#include "common/safetensors.h"
#include "tests/test_util.h"
#include "engine/quant/scalar_linear.h"
#include "engine/qsim/act_quant.h"

namespace qcal {
namespace {

using qsim::FakeQuantGrid;

at::Tensor FromVector(const std::vector<float>& v, std::vector<int64_t> shape) {
  return at::from_blob(const_cast<float*>(v.data()), shape, at::kFloat).clone();
}
std::vector<float> ToVector(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// Random activations with a few large outliers (so clipping and the grid edges are exercised).
at::Tensor Activations(std::vector<int64_t> shape, uint64_t seed) {
  at::Tensor x = at::randn(shape, at::TensorOptions().dtype(at::kFloat)) * 0.7;
  std::mt19937_64 rng(seed);
  at::Tensor flat = x.view({-1});
  for (int i = 0; i < 5; ++i) flat[rng() % flat.numel()] = 20.0 * ((rng() & 1) ? 1 : -1);
  return x;
}

TEST(FakeQuantTest, PerTokenSymmetricHandComputed) {
  // Token 0: max 7, clip 1 → s = 1: codes 1, −2, 0 (0.5 ties to even), 7.
  // Token 1: clip applies to the max: s = 4/7; 3.9/s = 6.825 → 7; -4/s = −7.
  const at::Tensor x = FromVector({1.0f, -2.0f, 0.5f, 7.0f, 3.9f, -4.0f, 0.0f, 1.0f}, {2, 4});
  const std::vector<float> got = ToVector(qsim::FakeQuantizeLastDim(x, {4, true, 1.0}));
  const float s1 = static_cast<float>(4.0 / 7.0);
  const std::vector<float> want = {1, -2, 0, 7, 7 * s1, -7 * s1, 0, 2 * s1};  // 1/s1 = 1.75 → 2
  EXPECT_EQ(got, want);
  // Clip 0.9 (QuaRot's): s = float(0.9·7/7); 7/s = 7.78 → 8 → clamped to 7; 0.5/s = 0.556 → 1.
  const float s = static_cast<float>(0.9 * 7.0 / 7.0);
  const std::vector<float> clipped = ToVector(qsim::FakeQuantizeLastDim(x, {4, true, 0.9}));
  EXPECT_EQ(clipped[0], 1 * s);
  EXPECT_EQ(clipped[1], -2 * s);
  EXPECT_EQ(clipped[2], 1 * s);
  EXPECT_EQ(clipped[3], 7 * s);
}

TEST(FakeQuantTest, AsymmetricHandComputed) {
  // lo −1, hi 3.5 → s = 4.5/15 = 0.3, z = round(1/0.3) = 3; codes 0, 3, 10, 15.
  const at::Tensor x = FromVector({-1.0f, 0.0f, 2.0f, 3.5f}, {1, 4});
  const std::vector<float> got = ToVector(qsim::FakeQuantizeLastDim(x, {4, false, 1.0}));
  const float s = static_cast<float>(4.5 / 15.0);
  EXPECT_EQ(got, (std::vector<float>{-3 * s, 0, 7 * s, 12 * s}));
  // All zeros dequantize to zeros, symmetric and asymmetric.
  const at::Tensor z = at::zeros({3, 5});
  EXPECT_TRUE(at::equal(qsim::FakeQuantizeLastDim(z, {4, true, 0.9}), z));
  EXPECT_TRUE(at::equal(qsim::FakeQuantizeLastDim(z, {4, false, 0.95}), z));
}

TEST(FakeQuantTest, MatchesScalarKernelBitForBit) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  for (int bits : {2, 3, 4, 8}) {
    for (bool symmetric : {true, false}) {
      for (double clip : {1.0, 0.95, 0.9, 0.5}) {
        const at::Tensor x = Activations({37, 172}, seed + bits);
        kernels::ScalarQuantConfig c;
        c.bits = bits;
        c.symmetric = symmetric;
        c.clip_ratio = clip;
        c.granularity = kernels::QuantGranularity::kPerToken;
        const std::vector<float> xv = ToVector(x);
        auto ref = kernels::QuantizeScalar(xv.data(), 37, 172, c);
        ASSERT_TRUE(ref.ok()) << ref.status();
        const std::vector<float> got =
            ToVector(qsim::FakeQuantizeLastDim(x, {bits, symmetric, clip}));
        ASSERT_EQ(got, ref->values) << bits << " bits, symmetric " << symmetric << ", clip "
                                    << clip;
        // Not the identity: quantization changed the values.
        EXPECT_NE(got, xv);
      }
    }
  }
}

TEST(FakeQuantTest, StaticParamsMatchKernel) {
  for (bool symmetric : {true, false}) {
    const FakeQuantGrid g{8, symmetric, 0.9};
    kernels::ScalarQuantConfig c;
    c.bits = 8;
    c.symmetric = symmetric;
    const auto ref = kernels::ScalarQuantParamsFromRange<float>(-3.0, 5.0, 0.9, c);
    const qsim::FixedQuantParams p = qsim::ParamsForRange(g, -3.0, 5.0);
    EXPECT_EQ(p.scale, ref.scale);
    EXPECT_EQ(p.zero, ref.zero);
    // Values beyond the calibrated range saturate; inside, code·s.
    const at::Tensor x = FromVector({-10.0f, 0.0f, 1.0f, 10.0f}, {4});
    const std::vector<float> got = ToVector(qsim::FakeQuantizeFixed(x, g, p));
    for (int i = 0; i < 4; ++i) {
      const float xi = ToVector(x)[i];
      const int32_t code = kernels::ScalarQuantizeCode<float>(
          xi, {ref.scale, ref.zero, 0.9}, kernels::ScalarCodeMin(c), kernels::ScalarCodeMax(c));
      EXPECT_EQ(got[i], kernels::ScalarDequantizeCode<float>(code, {ref.scale, ref.zero, 0.9}));
    }
    if (symmetric) {
      EXPECT_EQ(got[3], 127 * p.scale);  // 10 > 0.9·5: saturates at qmax
      EXPECT_EQ(got[0], -128 * p.scale);
    }
  }
}

TEST(ActivationQuantizerTest, GranularitiesAndStatic) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  const at::Tensor x = Activations({3, 10, 64}, seed);
  ActivationQuantSpec spec;
  spec.bits = 4;
  auto per_token = qsim::ActivationQuantizer::Create(spec);
  ASSERT_TRUE(per_token.ok());
  EXPECT_TRUE(at::equal((*per_token)->Apply(x), qsim::FakeQuantizeLastDim(x, {4, true, 0.9})));
  // Dynamic per tensor: one scale per sequence.
  spec.granularity = "per_tensor";
  auto per_tensor = qsim::ActivationQuantizer::Create(spec);
  ASSERT_TRUE(per_tensor.ok());
  const at::Tensor y = (*per_tensor)->Apply(x);
  for (int64_t b = 0; b < 3; ++b) {
    const at::Tensor one = qsim::FakeQuantizeLastDim(x[b].reshape({1, -1}), {4, true, 0.9});
    EXPECT_TRUE(at::equal(y[b].reshape({1, -1}), one)) << b;
  }
  EXPECT_FALSE(at::equal(y, (*per_token)->Apply(x)));
  // Static per tensor from an observed range.
  qsim::RangeObserver obs;
  obs.Observe(x);
  EXPECT_EQ(obs.count(), x.numel());
  EXPECT_EQ(obs.hi(), x.max().item<double>());
  spec.is_static = true;
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(spec).ok());  // static needs a range
  auto fixed = qsim::ActivationQuantizer::CreateStatic(spec, obs.lo(), obs.hi());
  ASSERT_TRUE(fixed.ok());
  const qsim::FixedQuantParams p = qsim::ParamsForRange({4, true, 0.9}, obs.lo(), obs.hi());
  EXPECT_EQ((*fixed)->static_params().scale, p.scale);
  EXPECT_TRUE(at::equal((*fixed)->Apply(x), qsim::FakeQuantizeFixed(x, {4, true, 0.9}, p)));
  // Bad specs.
  ActivationQuantSpec off;
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(off).ok());  // 16 bits = not quantized
  ActivationQuantSpec bad;
  bad.bits = 4;
  bad.granularity = "per_channel";
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(bad).ok());
  bad.granularity = "per_token";
  bad.clip = 1.5;
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(bad).ok());
}

// Humming's rule, written out per element with float32 scalars (volatile: no contraction, no
// reassociation): the same values as HummingFakeQuantizeLastDim bit for bit.
std::vector<float> HummingRow(const std::vector<float>& row, int bits) {
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  float mx = 1e-30f, mn = -1e-30f;
  for (float v : row) {
    mx = std::max(mx, v);
    mn = std::min(mn, v);
  }
  volatile float pos = mx / static_cast<float>(qmax + 0.49);
  volatile float neg = -mn / static_cast<float>(qmax + 1.49);
  const float s = std::max(static_cast<float>(pos), static_cast<float>(neg));
  volatile float inv = 1.0f / s;
  std::vector<float> out;
  for (float v : row) {
    volatile float p = v * inv;
    out.push_back(std::nearbyint(static_cast<float>(p)) * s);
  }
  return out;
}

TEST(HummingRuleTest, MatchesTheScalarRuleAndUsesBothEndsOfTheCodes) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  const at::Tensor x = Activations({4, 9, 64}, seed);
  for (int bits : {4, 8}) {
    const at::Tensor y = qsim::HummingFakeQuantizeLastDim(x, bits);
    const at::Tensor rows = x.reshape({-1, 64}), yrows = y.reshape({-1, 64});
    for (int64_t r = 0; r < rows.size(0); ++r) {
      EXPECT_EQ(ToVector(yrows[r]), HummingRow(ToVector(rows[r]), bits)) << bits << " " << r;
    }
  }
  // Hand-computed: a row whose max is 7.49 and min -8.49 has s = 1 and keeps the codes
  // 7 and -8; the qcal rule (s = max|x| / 7) maps -8.49 to -7 · 8.49 / 7 instead.
  const at::Tensor h = FromVector({7.49f, -8.49f, 0.5f, 1.5f, -0.5f, 2.5f, 0.0f, 3.2f}, {1, 8});
  EXPECT_EQ(ToVector(qsim::HummingFakeQuantizeLastDim(h, 4)),
            (std::vector<float>{7, -8, 0, 2, -0, 2, 0, 3}));
  // An all-zero row stays zero (s = 1e-30 / 7.49).
  EXPECT_EQ(at::count_nonzero(qsim::HummingFakeQuantizeLastDim(at::zeros({2, 16}), 4)).item<int64_t>(),
            0);
  // The quantizer built from a recipe spec with rule humming computes it; the default rule
  // does not.
  ActivationQuantSpec spec;
  spec.bits = 4;
  spec.clip = 1.0;
  spec.rule = "humming";
  auto humming = qsim::ActivationQuantizer::Create(spec);
  ASSERT_TRUE(humming.ok()) << humming.status();
  EXPECT_TRUE((*humming)->humming());
  EXPECT_TRUE(at::equal((*humming)->Apply(x), qsim::HummingFakeQuantizeLastDim(x, 4)));
  spec.rule = "qcal";
  EXPECT_FALSE(at::equal((*qsim::ActivationQuantizer::Create(spec))->Apply(x),
                         qsim::HummingFakeQuantizeLastDim(x, 4)));
  // Humming has no clipping ratio, no static or per-tensor scales, no other widths.
  spec.rule = "humming";
  spec.clip = 0.9;
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(spec).ok());
  spec.clip = 1.0;
  spec.granularity = "per_tensor";
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(spec).ok());
  spec.granularity = "per_token";
  spec.bits = 3;
  EXPECT_FALSE(qsim::ActivationQuantizer::Create(spec).ok());
}

TEST(IntKvQuantizerTest, PerGroupMatchesKernelAndIsCausal) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  const int64_t b = 2, kvh = 4, s = 9, d = 16;
  const at::Tensor k = Activations({b, kvh, s, d}, seed);
  for (int64_t group : {0, 8, 4}) {
    qsim::IntKvQuantizer::Options o;  // QuaRot: int4 asymmetric, clip 0.95
    o.group = group;
    auto q = qsim::IntKvQuantizer::Create(o, d);
    ASSERT_TRUE(q.ok()) << q.status();
    const at::Tensor got = (*q)->Apply(k, qsim::KvRole::kKey);
    ASSERT_EQ(got.sizes(), k.sizes());
    kernels::ScalarQuantConfig c;
    c.bits = 4;
    c.symmetric = false;
    c.clip_ratio = 0.95;
    c.granularity = kernels::QuantGranularity::kPerGroup;
    c.group_size = group == 0 ? d : group;
    const std::vector<float> kv = ToVector(k);
    auto ref = kernels::QuantizeScalar(kv.data(), b * kvh * s, d, c);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(ToVector(got), ref->values) << "group " << group;
    // Causal: the first 5 tokens quantize the same alone.
    const at::Tensor prefix = k.narrow(2, 0, 5).contiguous();
    EXPECT_TRUE(at::equal((*q)->Apply(prefix, qsim::KvRole::kValue), got.narrow(2, 0, 5)));
    // Queries pass through.
    EXPECT_TRUE(at::equal((*q)->Apply(k, qsim::KvRole::kQuery), k));
  }
  qsim::IntKvQuantizer::Options o;
  o.group = 5;
  EXPECT_FALSE(qsim::IntKvQuantizer::Create(o, d).ok());
}

TEST(IntKvQuantizerTest, PerTokenAndStaticPerTensor) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  const int64_t b = 2, kvh = 3, s = 7, d = 8;
  const at::Tensor v = Activations({b, kvh, s, d}, seed);
  qsim::IntKvQuantizer::Options o;
  o.grid = {8, true, 1.0};
  o.granularity = qsim::IntKvQuantizer::Granularity::kPerToken;
  auto q = qsim::IntKvQuantizer::Create(o, d);
  ASSERT_TRUE(q.ok());
  const at::Tensor got = (*q)->Apply(v, qsim::KvRole::kValue);
  // Per token = one set over all heads of a token.
  const at::Tensor tokens = v.transpose(1, 2).reshape({b * s, kvh * d}).contiguous();
  const at::Tensor want = qsim::FakeQuantizeLastDim(tokens, o.grid);
  EXPECT_TRUE(at::equal(got.transpose(1, 2).reshape({b * s, kvh * d}), want));

  // Static: keys and values have their own fixed parameters.
  qsim::RecordingKvQuantizer rec;
  EXPECT_TRUE(at::equal(rec.Apply(v, qsim::KvRole::kKey), v));
  rec.Apply(v * 3, qsim::KvRole::kValue);
  const qsim::KvStaticRanges r = rec.ranges();
  EXPECT_EQ(r.hi[0], v.max().item<double>());
  EXPECT_EQ(r.hi[1], (v * 3).max().item<double>());
  o.granularity = qsim::IntKvQuantizer::Granularity::kPerTensor;
  o.ranges = r;
  auto st = qsim::IntKvQuantizer::Create(o, d);
  ASSERT_TRUE(st.ok());
  const qsim::FixedQuantParams pk = qsim::ParamsForRange(o.grid, r.lo[0], r.hi[0]);
  EXPECT_TRUE(at::equal((*st)->Apply(v, qsim::KvRole::kKey),
                        qsim::FakeQuantizeFixed(v, o.grid, pk)));
  EXPECT_FALSE(at::equal((*st)->Apply(v, qsim::KvRole::kKey),
                         (*st)->Apply(v, qsim::KvRole::kValue)));
}

TEST(IntKvQuantizerTest, FactoryFollowsTheRecipe) {
  LlamaConfig config;
  config.head_dim = 8;
  KvCacheSpec spec;  // 16 bits: no quantizer
  auto none = qsim::MakeKvQuantizer(spec, config, 0, nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  spec.bits = 4;
  auto q = qsim::MakeKvQuantizer(spec, config, 0, nullptr);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)->Describe(), "int4 asym clip 0.95 per_group(8)");
  spec.granularity = "per_tensor";
  EXPECT_FALSE(qsim::MakeKvQuantizer(spec, config, 0, nullptr).ok());  // must be static
  spec.is_static = true;
  EXPECT_FALSE(qsim::MakeKvQuantizer(spec, config, 0, nullptr).ok());  // needs ranges
  qsim::KvStaticRanges ranges;
  ranges.lo[0] = ranges.lo[1] = -1;
  ranges.hi[0] = ranges.hi[1] = 1;
  EXPECT_TRUE(qsim::MakeKvQuantizer(spec, config, 0, &ranges).ok());
}

TEST(OnlineHadamardTest, MatchesKernelAndFusesExactly) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  for (int64_t n : {8, 16, 172, 64 * 172}) {
    auto h = qsim::OnlineHadamard::Create(n);
    ASSERT_TRUE(h.ok()) << n;
    EXPECT_EQ((*h)->transposed_matrix().defined(), n <= qsim::OnlineHadamard::kDenseLimit);
    const at::Tensor x = at::randn({3, n});
    at::Tensor ref = x.clone();
    ASSERT_TRUE(HadamardTransform(ref.data_ptr<float>(), n, 3).ok());
    const at::Tensor got = (*h)->Apply(x);
    EXPECT_LT((got - ref).abs().max().item<double>(), 1e-5) << n;
    EXPECT_NEAR(got.norm().item<double>(), x.norm().item<double>(), 1e-4 * x.norm().item<double>());
    EXPECT_LT(((*h)->ApplyInverse(got) - x).abs().max().item<double>(), 1e-5) << n;
    // x·Wᵀ = (x·Tᵀ)·(W·Tᵀ)ᵀ.
    const at::Tensor w = at::randn({5, n});
    auto fused = qsim::FuseInputHadamard(w, **h);
    ASSERT_TRUE(fused.ok());
    const at::Tensor y = at::matmul(x, w.t());
    EXPECT_LT((at::matmul(got, fused->t()) - y).abs().max().item<double>(),
              1e-4 * y.abs().max().item<double>()) << n;
  }
  EXPECT_FALSE(qsim::OnlineHadamard::Create(22).ok());  // 2·11: no Hadamard matrix
}

// The block-diagonal R4 (rotation.r4_block): the dense block-diagonal matrix of Sylvester
// H_b / √b, built here independently (H_2b = [[H_b, H_b], [H_b, -H_b]]), is what Apply,
// ApplyInverse, FuseInputHadamard and RotateHessian compute.
TEST(OnlineHadamardTest, BlockDiagonalIsTheSylvesterBlocks) {
  at::manual_seed(testing::TestSeed());
  for (auto [n, b] : {std::pair<int64_t, int64_t>{172, 4}, {64, 64}, {11008, 256}}) {
    SCOPED_TRACE(n);
    auto h = qsim::OnlineHadamard::CreateBlockDiagonal(n, b);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ((*h)->dim(), n);
    EXPECT_EQ((*h)->block(), b);
    at::Tensor sylvester = at::ones({1, 1}, at::kDouble);
    while (sylvester.size(0) < b) {
      sylvester = at::cat({at::cat({sylvester, sylvester}, 1), at::cat({sylvester, -sylvester}, 1)});
    }
    sylvester = sylvester / std::sqrt(static_cast<double>(b));
    const at::Tensor t = at::block_diag(std::vector<at::Tensor>(n / b, sylvester));  // [n, n]
    const at::Tensor x = at::randn({3, n});
    const at::Tensor want = at::matmul(x.to(at::kDouble), t.t());  // x·Tᵀ
    EXPECT_LT(((*h)->Apply(x).to(at::kDouble) - want).abs().max().item<double>(), 1e-5);
    EXPECT_LT(((*h)->ApplyDifferentiable(x).to(at::kDouble) - want).abs().max().item<double>(),
              1e-5);
    EXPECT_LT(((*h)->ApplyInverse((*h)->Apply(x)) - x).abs().max().item<double>(), 1e-5);
    const at::Tensor w = at::randn({5, n});
    auto fused = qsim::FuseInputHadamard(w, **h);
    ASSERT_TRUE(fused.ok());
    EXPECT_LT((fused->to(at::kDouble) - at::matmul(w.to(at::kDouble), t.t())).abs().max()
                  .item<double>(),
              1e-5);
    if (n <= 256) {
      const at::Tensor a = at::randn({n, n}, at::kDouble);
      const at::Tensor hess = at::matmul(a, a.t());
      auto rotated = qsim::RotateHessian(hess, **h);
      ASSERT_TRUE(rotated.ok());
      EXPECT_LT((*rotated - at::matmul(at::matmul(t, hess), t.t())).abs().max().item<double>(),
                1e-9 * hess.abs().max().item<double>());
    }
  }
  EXPECT_FALSE(qsim::OnlineHadamard::CreateBlockDiagonal(172, 8).ok());   // 8 does not divide
  EXPECT_FALSE(qsim::OnlineHadamard::CreateBlockDiagonal(172, 6).ok());   // not a power of two
  EXPECT_FALSE(qsim::OnlineHadamard::CreateBlockDiagonal(16384, 8192).ok());  // above the limit
}

// The autograd-friendly form equals Apply for dense and Kronecker-factored sizes (11008 =
// 64·172, 14336 = 512·28, 8192 = 2^13), and its gradient is the transposed transform.
TEST(OnlineHadamardTest, DifferentiableFormMatchesApplyAndItsGradient) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  for (int64_t n : {172, 64 * 172, 512 * 28, 8192}) {
    auto h = qsim::OnlineHadamard::Create(n);
    ASSERT_TRUE(h.ok()) << n;
    const at::Tensor x = at::randn({2, 3, n}).requires_grad_(true);
    const at::Tensor y = (*h)->ApplyDifferentiable(x);
    const at::Tensor ref = (*h)->Apply(x.detach());
    EXPECT_LT((y.detach() - ref).abs().max().item<double>(), 1e-5 * ref.abs().max().item<double>() + 1e-6)
        << n;
    const at::Tensor g = at::randn({2, 3, n});
    y.backward(g);
    // d(x·Tᵀ)/dx applied to g is g·T.
    const at::Tensor want = (*h)->ApplyInverse(g);
    EXPECT_LT((x.grad() - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>())
        << n;
  }
}

TEST(ActQuantLinearTest, RotationQuantizationAndDenseWeight) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  const at::Tensor w = at::randn({6, 172});
  const at::Tensor x = Activations({2, 5, 172}, seed);
  auto h = qsim::OnlineHadamard::Create(172);
  ASSERT_TRUE(h.ok());
  auto fused = qsim::FuseInputHadamard(w, **h);
  ASSERT_TRUE(fused.ok());
  // Rotation only: the float function of the original weight.
  qsim::ActQuantLinear rotated(std::make_unique<model::DenseLinear>(*fused), *h, nullptr);
  const at::Tensor y = at::matmul(x, w.t());
  EXPECT_LT((rotated.Forward(x) - y).abs().max().item<double>(), 1e-4 * y.abs().max().item<double>());
  EXPECT_LT((rotated.DenseWeight() - w).abs().max().item<double>(), 1e-5);
  // With a quantizer: inner(Q(x·Tᵀ)); the observer sees the rotated input.
  ActivationQuantSpec spec;
  spec.bits = 4;
  auto q = qsim::ActivationQuantizer::Create(spec);
  ASSERT_TRUE(q.ok());
  auto observer = std::make_shared<qsim::RangeObserver>();
  qsim::ActQuantLinear quantized(std::make_unique<model::DenseLinear>(*fused), *h, *q, observer);
  const at::Tensor want = at::matmul((*q)->Apply((*h)->Apply(x)), fused->t());
  EXPECT_TRUE(at::equal(quantized.Forward(x), want));
  EXPECT_EQ(observer->hi(), (*h)->Apply(x).max().item<double>());
  EXPECT_EQ(&quantized.stored(), &quantized.inner());
  // Rotation flattens the outliers: smaller 4-bit error after the Hadamard (QuaRot's point).
  const at::Tensor xr = (*h)->Apply(x);
  const double err_plain = (qsim::FakeQuantizeLastDim(x, {4, true, 1.0}) - x).norm().item<double>();
  const double err_rot = (qsim::FakeQuantizeLastDim(xr, {4, true, 1.0}) - xr).norm().item<double>();
  EXPECT_LT(err_rot, err_plain);
}

TEST(PackedInt4Test, ScalarQuantLinearRoundTripsPackedCodes) {
  for (bool symmetric : {true, false}) {
    for (int bits : {2, 3, 4}) {
      quant::ScalarLinearData d;
      d.in_features = 5;  // odd: the last byte of a row holds one code
      d.out_features = 3;
      d.bits = bits;
      d.symmetric = symmetric;
      d.pack_int4 = true;
      kernels::ScalarQuantConfig c;
      c.bits = bits;
      c.symmetric = symmetric;
      const int32_t lo = kernels::ScalarCodeMin(c), hi = kernels::ScalarCodeMax(c);
      for (int i = 0; i < 15; ++i) d.codes.push_back(lo + (i * 7) % (hi - lo + 1));
      d.codes[0] = lo;
      d.codes[1] = hi;
      d.scales = {0.5f, 0.25f, 2.0f};
      d.zeros = symmetric ? std::vector<int32_t>{0, 0, 0} : std::vector<int32_t>{1, 0, hi};
      auto layer = quant::ScalarQuantLinear::Create(d);
      ASSERT_TRUE(layer.ok()) << layer.status();
      EXPECT_FALSE((*layer)->GptqExportable());
      const std::string dir = qcal::testing::MakeTempDir("packed");
      SafetensorsWriter w;
      ASSERT_TRUE((*layer)->AppendTensors("p", &w).ok());
      ASSERT_TRUE(w.Write(dir + "/model.safetensors").ok());
      auto ckpt = CheckpointReader::Open(dir);
      ASSERT_TRUE(ckpt.ok());
      auto f = (*ckpt)->Find("p.codes_int4");
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(f->second->shape, (std::vector<int64_t>{3, 3}));
      EXPECT_FALSE((*ckpt)->Has("p.codes"));
      EXPECT_FALSE((*ckpt)->Has("p.qweight"));
      // Row 0: codes 0 and 1 share byte 0, low nibble first.
      const uint8_t byte0 = (*ckpt)->Find("p.codes_int4")->first->Data(*f->second)[0];
      EXPECT_EQ(byte0, static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4)));
      auto loaded = quant::ScalarQuantLinear::Load(**ckpt, "p");
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      EXPECT_EQ((*loaded)->data().codes, d.codes);
      EXPECT_TRUE((*loaded)->data().pack_int4);
      EXPECT_TRUE(at::equal((*loaded)->DenseWeight(), (*layer)->DenseWeight()));
    }
  }
  quant::ScalarLinearData eight;
  eight.in_features = 2;
  eight.out_features = 1;
  eight.bits = 8;
  eight.pack_int4 = true;
  eight.codes = {1, 2};
  eight.scales = {1.0f};
  eight.zeros = {0};
  EXPECT_FALSE(quant::ScalarQuantLinear::Create(eight).ok());
}

}  // namespace
}  // namespace qcal
