// The exact fixed-point Hessian accumulator (engine/calib/hessian.h): order independence (any
// split, any merge order, digit reductions), agreement with a plain fp64 reference, range and
// overflow errors, and the cache format.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "common/safetensors.h"
#include "kernels/fixed_point.h"
#include "kernels/hessian_fixed.h"
#include "tests/test_util.h"
#include "engine/calib/calibration.h"
#include "engine/calib/hessian.h"

namespace qcal::calib {
namespace {

using Fixed = Fixed128;

// Σ_seq double(fp32 xᵀx per sequence), symmetrised: the old fp64 accumulation.
at::Tensor ReferenceMean(const at::Tensor& x) {
  at::Tensor sum = at::zeros({x.size(-1), x.size(-1)}, at::kDouble);
  for (int64_t s = 0; s < x.size(0); ++s) sum.add_(at::mm(x[s].t(), x[s]).to(at::kDouble));
  return (sum + sum.t()) / (2.0 * x.size(0) * x.size(1));
}

double MaxRelative(const at::Tensor& a, const at::Tensor& ref) {
  return (a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
}

TEST(HessianFixedTest, SplitsAndMergeOrdersGiveIdenticalBits) {
  model::SetComputeThreads(1);
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  // Heavy-tailed activations (a few outlier channels, as in LLMs) over 12 sequences.
  const int64_t n = 72;  // not a multiple of the 64-wide tiles
  at::Tensor x = at::randn({12, 16, n});
  x.select(2, 5).mul_(300.0);
  x.select(2, 40).mul_(1e-6);
  HessianAccumulator whole(n);
  ASSERT_TRUE(whole.Add(x).ok());
  EXPECT_EQ(whole.count(), 12 * 16);

  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 5; ++trial) {
    // Random contiguous split into 1..5 parts, merged in a random order.
    const int parts = 1 + static_cast<int>(rng() % 5);
    std::vector<int64_t> cuts = {0, 12};
    while (static_cast<int>(cuts.size()) < parts + 1) cuts.push_back(rng() % 13);
    std::sort(cuts.begin(), cuts.end());
    std::vector<HessianAccumulator> accs;
    for (size_t p = 0; p + 1 < cuts.size(); ++p) {
      accs.emplace_back(n);
      ASSERT_TRUE(accs.back().Add(x.narrow(0, cuts[p], cuts[p + 1] - cuts[p])).ok());
    }
    std::shuffle(accs.begin(), accs.end(), rng);
    HessianAccumulator merged(n);
    for (const auto& a : accs) ASSERT_TRUE(merged.Merge(a).ok());
    EXPECT_EQ(merged.count(), whole.count());
    ASSERT_EQ(merged.packed().size(), whole.packed().size());
    EXPECT_TRUE(std::equal(merged.packed().begin(), merged.packed().end(), whole.packed().begin()))
        << "trial " << trial << ": " << parts << " parts";
    at::Tensor a = merged.Mean(), b = whole.Mean();
    EXPECT_EQ(std::memcmp(a.data_ptr<double>(), b.data_ptr<double>(), a.numel() * 8), 0);

    // The same through the digit reduction used by AllReduceHessians: limbs summed in int64.
    const size_t m = whole.packed().size();
    std::vector<int64_t> total(4 * m, 0), limbs(4 * m);
    for (const auto& acc : accs) {
      HessianAccumulator::SplitDigits(acc.packed().data(), m, limbs.data());
      for (size_t i = 0; i < limbs.size(); ++i) total[i] += limbs[i];
    }
    std::vector<Fixed> combined(m);
    ASSERT_TRUE(HessianAccumulator::CombineDigits(total.data(), m, combined.data()).ok());
    EXPECT_TRUE(std::equal(combined.begin(), combined.end(), whole.packed().begin()));
  }
}

TEST(HessianFixedTest, AgreesWithAnFp64ReferenceAndIsExactlySymmetric) {
  model::SetComputeThreads(1);
  at::manual_seed(testing::TestSeed());
  at::Tensor x = at::randn({8, 32, 96});
  x.select(2, 3).mul_(1000.0);
  HessianAccumulator acc(96);
  ASSERT_TRUE(acc.Add(x).ok());
  const at::Tensor mean = acc.Mean();
  const at::Tensor ref = ReferenceMean(x);
  const double rel = MaxRelative(mean, ref);
  std::printf("max |fixed - fp64| / max |fp64| = %.3g\n", rel);
  // The accumulator's fp32 products come from its own tile GEMMs (upper triangle only), the
  // reference's from at::mm: two fp32 summation orders over 32 tokens (about 1e-11 of the
  // largest entry here, which column 3 (×1000) dominates).
  EXPECT_LT(rel, 1e-9);
  // Against exact (fp64) products of the same fp32 inputs: fp32 GEMM error only (about 2e-8).
  EXPECT_LT(MaxRelative(mean, ReferenceMean(x.to(at::kDouble))), 1e-6);
  EXPECT_TRUE(at::equal(mean, mean.t()));
  EXPECT_TRUE(at::equal(acc.sum() / static_cast<double>(acc.count()), mean));
  // Double inputs: products in fp64, same rounding to fixed point.
  HessianAccumulator dacc(96);
  ASSERT_TRUE(dacc.Add(x.to(at::kDouble)).ok());
  at::Tensor rows = x.to(at::kDouble).reshape({-1, 96});
  EXPECT_LT(MaxRelative(dacc.Mean(), at::mm(rows.t(), rows) / rows.size(0)), 1e-12);
}

TEST(HessianFixedTest, TinyValuesRoundToTheGridAndHugeOnesAreErrors) {
  // One row [a, b]: H = [[a², ab], [ab, b²]]; entries below 2^-51 contribute 0.
  const double tiny = std::ldexp(1.0, -27);  // tiny² = 2^-54 < 2^-51
  HessianAccumulator acc(2);
  ASSERT_TRUE(acc.Add(at::tensor({1.0f, static_cast<float>(tiny)}).reshape({1, 1, 2})).ok());
  const at::Tensor s = acc.sum();
  EXPECT_EQ(s[0][0].item<double>(), 1.0);
  EXPECT_EQ(s[0][1].item<double>(), tiny);  // 2^-27 is on the 2^-50 grid
  EXPECT_EQ(s[1][1].item<double>(), 0.0);   // 2^-54 is not: rounds to 0
  // Products beyond the range (or not finite) are OutOfRange, never a wrap.
  HessianAccumulator big(2);
  const Status st = big.Add(at::tensor({1e19f, 1.0f}).reshape({1, 1, 2}));
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  HessianAccumulator nan(2);
  EXPECT_EQ(nan.Add(at::tensor({NAN, 1.0f}).reshape({1, 1, 2})).code(),
            absl::StatusCode::kOutOfRange);
  // Sums that leave 128 bits overflow too: 2^72 per product, 2^(123) per entry after 2^50.
  HessianAccumulator sum(1);
  const at::Tensor row = at::full({1, 1, 1}, std::ldexp(1.0f, 36));
  Status last;
  for (int i = 0; i < 20 && last.ok(); ++i) last = sum.Add(row);
  EXPECT_EQ(last.code(), absl::StatusCode::kOutOfRange) << last;
  EXPECT_FALSE(HessianAccumulator(3).Merge(HessianAccumulator(2)).ok());
}

// One-token sequences: each product is a single fp32 multiply, so the exact packed sums can be
// computed here independently (round(p · 2^50), ties to even, summed in 128 bits) and compared
// bit for bit. The values mix magnitudes from 2^-40 to 2^14 (so entries take both the vectorised
// conversion and its scalar fallback for |p| >= 2^12, within one 4-wide chunk too), exact ties
// on the 2^-50 grid, signs and a width and sequence count that leave tails (n % 4, seqs % 8).
TEST(HessianFixedTest, ConversionMatchesAnIndependentExactSum) {
  model::SetComputeThreads(2);
  std::mt19937_64 rng(testing::TestSeed());
  const int64_t seqs = 19, n = 151;
  at::Tensor x = at::empty({seqs, 1, n});
  float* v = x.data_ptr<float>();
  std::uniform_real_distribution<double> expo(-40.0, 7.0), mant(1.0, 2.0);
  for (int64_t k = 0; k < seqs * n; ++k) {
    const int64_t c = k % n;
    double a;
    if (c % 10 == 3) {
      a = (rng() % 2 ? 3.0 : 5.0) * std::ldexp(1.0, -26);  // products k·2^-52: grid ties
    } else if (c % 10 == 7) {
      a = std::ldexp(1.0, -25 - static_cast<int>(rng() % 3));
    } else if (c % 37 == 5) {
      a = 100.0 * mant(rng);  // squares and cross products past 2^12
    } else {
      a = std::ldexp(mant(rng), static_cast<int>(std::floor(expo(rng))));
    }
    v[k] = static_cast<float>(rng() % 2 ? a : -a);
  }
  HessianAccumulator acc(n);
  ASSERT_TRUE(acc.Add(x).ok());
  int64_t ties = 0, large = 0;
  for (int64_t i = 0, idx = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j, ++idx) {
      Fixed want = 0;
      for (int64_t s = 0; s < seqs; ++s) {
        const float p = v[s * n + i] * v[s * n + j];
        const double d = std::ldexp(static_cast<double>(p), kHessianFracBits);
        const double r = std::nearbyint(d);  // default rounding: to nearest, ties to even
        ties += std::fabs(d - std::trunc(d)) == 0.5;
        large += std::fabs(p) >= 4096.0f;
        want += 2 * static_cast<Fixed>(r);  // exact: |r| < 2^80 here
      }
      ASSERT_EQ(acc.packed()[idx], want) << "entry (" << i << ", " << j << ")";
    }
  }
  std::printf("%lld products exactly halfway on the grid, %lld of magnitude >= 2^12\n",
              static_cast<long long>(ties), static_cast<long long>(large));
  EXPECT_GT(ties, 100);
  EXPECT_GT(large, 20);
}

// The CPU fast path (this accumulator: tiled, grouped, vectorized rounding) and the plain
// reference that the GPU kernels are tested against (kernels/hessian_fixed.h) give the same
// integers when the fp32 products are exact, and the shared rounding and digit helpers of
// kernels/fixed_point.h agree with this accumulator's: the chain GPU == reference == CPU path.
TEST(HessianFixedTest, FastPathEqualsTheKernelsReferenceBitForBit) {
  model::SetComputeThreads(2);
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> k(-64, 64);
  const int64_t seqs = 11, t = 128, n = 300;  // products are multiples of 1/256 below 2^12: exact
  at::Tensor x = at::empty({seqs, t, n});
  float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<float>(k(rng)) / 16.0f;
  HessianAccumulator acc(n);
  ASSERT_TRUE(acc.Add(x).ok());
  std::vector<kernels::Fixed128> ref(kernels::HessianPackedSize(n), 0);
  ASSERT_TRUE(kernels::AccumulateHessianFixedReference(p, seqs, t, n, ref.data()).ok());
  ASSERT_EQ(acc.packed().size(), ref.size());
  EXPECT_TRUE(std::equal(ref.begin(), ref.end(), acc.packed().begin()));
  EXPECT_NE(ref[0], 0);
  // Rounding (ties to even, every magnitude range) and digits agree with FromSum / SplitDigits.
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> vals = {0.0, 0x1p-51, 3 * 0x1p-51, -3 * 0x1p-51, 0x1p-52, 1.5, -1.75,
                              0x1p3 + 0x1p-49, -(0x1p3 + 0x1p-49), 0x1p12 + 0x1p-40, 7e12,
                              -7e12, 123456.789, -0x1p20 - 0x1p-30, 0x1p40, -0x1p60};
  for (int i = 0; i < 2000; ++i) vals.push_back(u(rng) * std::pow(10.0, (i % 40) - 20));
  for (double v : vals) {
    at::Tensor s = at::full({1, 1}, v, at::kDouble);
    auto h = HessianAccumulator::FromSum(s, 1);
    ASSERT_TRUE(h.ok());
    kernels::Fixed128 q = 0, portable = 0;
    ASSERT_TRUE(kernels::ToFixed128(v, &q));
    ASSERT_TRUE(kernels::ToFixed128Portable(v, &portable));
    ASSERT_TRUE(q == portable) << v;  // the host instruction and the device's exact steps
    ASSERT_TRUE(h->packed()[0] == 2 * q) << v;  // FromSum rounds both triangles: 2·q(v)
    int64_t a[4], b[4];
    HessianAccumulator::SplitDigits(&h->packed()[0], 1, a);
    kernels::SplitFixedDigits(h->packed()[0], b);
    for (int l = 0; l < 4; ++l) ASSERT_EQ(a[l], b[l]);
    kernels::Fixed128 back = 0;
    ASSERT_TRUE(kernels::CombineFixedDigits(b, &back));
    ASSERT_TRUE(back == h->packed()[0]);
  }
  kernels::Fixed128 q = 0;
  for (double bad : {std::nan(""), 0x1p74, -0x1p74, HUGE_VAL}) {  // 0x1p74: 2^124 after scaling
    EXPECT_FALSE(kernels::ToFixed128(bad, &q)) << bad;
    EXPECT_FALSE(kernels::ToFixed128Portable(bad, &q)) << bad;
  }
  // Both sides of 2^62 and of 2^123 after scaling, where the paths change.
  for (double v : {0x1p12, 0x1p12 - 0x1p-40, -0x1p12, 0x1p12 + 0x1p-40, 0x1p72, -0x1p72,
                   0x1.fffffffffffffp72}) {
    kernels::Fixed128 a = 0, b = 0;
    ASSERT_TRUE(kernels::ToFixed128(v, &a)) << v;
    ASSERT_TRUE(kernels::ToFixed128Portable(v, &b)) << v;
    EXPECT_TRUE(a == b) << v;
  }
}

TEST(HessianFixedTest, DigitsCarryAndDetectOverflow) {
  const Fixed max = static_cast<Fixed>((static_cast<unsigned __int128>(1) << 127) - 1);
  const Fixed min = -max - 1;
  const std::vector<Fixed> values = {
      0, 1, -1, max, min, static_cast<Fixed>(-123456789012345LL), static_cast<Fixed>(1) << 100};
  std::vector<int64_t> limbs(4 * values.size());
  HessianAccumulator::SplitDigits(values.data(), values.size(), limbs.data());
  std::vector<Fixed> back(values.size());
  ASSERT_TRUE(HessianAccumulator::CombineDigits(limbs.data(), values.size(), back.data()).ok());
  EXPECT_TRUE(back == values);
  // Three "ranks": 2^100 + 2^100 − 1 with carries through every digit.
  std::vector<Fixed> parts = {static_cast<Fixed>(1) << 100, static_cast<Fixed>(1) << 100, -1};
  std::vector<int64_t> l(12), sum(4, 0);
  HessianAccumulator::SplitDigits(parts.data(), 3, l.data());
  for (int r = 0; r < 3; ++r) {
    for (int d = 0; d < 4; ++d) sum[d] += l[4 * r + d];
  }
  Fixed total;
  ASSERT_TRUE(HessianAccumulator::CombineDigits(sum.data(), 1, &total).ok());
  EXPECT_TRUE(total == (static_cast<Fixed>(1) << 101) - 1);
  // max + 1 leaves the range.
  std::vector<Fixed> over = {max, 1};
  HessianAccumulator::SplitDigits(over.data(), 2, l.data());
  for (int d = 0; d < 4; ++d) sum[d] = l[d] + l[4 + d];
  EXPECT_EQ(HessianAccumulator::CombineDigits(sum.data(), 1, &total).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(HessianFixedTest, CacheRoundTripsExactlyAndOldFilesAreStale) {
  at::manual_seed(testing::TestSeed());
  const std::string dir = testing::MakeTempDir("hcache");
  BlockHessians h;
  const int64_t dims[4] = {8, 8, 8, 20};
  for (int k = 0; k < 4; ++k) {
    h.h[k] = HessianAccumulator(dims[k]);
    ASSERT_TRUE(h.h[k].Add(at::randn({3, 5, dims[k]}) * 7.0).ok());
  }
  ASSERT_TRUE(SaveBlockHessians(dir + "/b.safetensors", h, "key1").ok());
  auto back = LoadBlockHessians(dir + "/b.safetensors", "key1");
  ASSERT_TRUE(back.ok()) << back.status();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(back->h[k].packed() == h.h[k].packed());
    EXPECT_EQ(back->h[k].count(), 15);
    EXPECT_TRUE(at::equal(back->h[k].Mean(), h.h[k].Mean()));
  }
  // Mapped: nothing read into the accumulators; each mean made from the file is bit-identical,
  // through BlockHessians::Mean and through HessianMeans (what block tasks use).
  auto mapped = LoadBlockHessians(dir + "/b.safetensors", "key1", /*mapped=*/true);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_NE(mapped->stored, nullptr);
  HessianMeans means(&*mapped);
  const model::LinearKind first[4] = {model::LinearKind::kQ, model::LinearKind::kO,
                                      model::LinearKind::kGate, model::LinearKind::kDown};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(mapped->h[k].dim(), 0);
    EXPECT_EQ(mapped->stored->dim(kAllHessianKinds[k]), dims[k]);
    EXPECT_EQ(mapped->stored->count(kAllHessianKinds[k]), 15);
    const at::Tensor want = h.h[k].Mean();
    ASSERT_GT(want.abs().max().item<double>(), 0.0);
    EXPECT_TRUE(at::equal(mapped->Mean(kAllHessianKinds[k]), want)) << k;
    EXPECT_TRUE(at::equal(means.For(first[k]), want)) << k;
  }
  EXPECT_EQ(LoadBlockHessians(dir + "/b.safetensors", "key2").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(LoadBlockHessians(dir + "/none.safetensors", "key1").status().code(),
            absl::StatusCode::kNotFound);
  // The old format (fp64 sums only, no hessian_format): stale, recomputed.
  SafetensorsWriter old;
  old.SetMetadata("calibration_key", "key1");
  for (const char* kind : {"qkv", "o", "gate_up", "down"}) {
    std::vector<double> s(4, 1.0);
    int64_t c = 1;
    ASSERT_TRUE(old.Add(std::string(kind) + ".sum", DType::kF64, {2, 2}, s.data(), 32).ok());
    ASSERT_TRUE(old.Add(std::string(kind) + ".count", DType::kI64, {}, &c, 8).ok());
  }
  ASSERT_TRUE(old.Write(dir + "/old.safetensors").ok());
  auto stale = LoadBlockHessians(dir + "/old.safetensors", "key1");
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.status().message().find("format"), std::string::npos) << stale.status();
  // Format "2" (which also held an fp64 copy of the sums): stale too.
  SafetensorsWriter v2;
  v2.SetMetadata("calibration_key", "key1");
  v2.SetMetadata("hessian_format", "2");
  int64_t c = 1;
  ASSERT_TRUE(v2.Add("qkv.count", DType::kI64, {}, &c, 8).ok());
  ASSERT_TRUE(v2.Write(dir + "/v2.safetensors").ok());
  auto stale2 = LoadBlockHessians(dir + "/v2.safetensors", "key1");
  EXPECT_EQ(stale2.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale2.status().message().find("format '2'"), std::string::npos) << stale2.status();
}

TEST(HessianMeansTest, EachKindOnceAndItsSumsReleased) {
  BlockHessians h;
  const int64_t dims[4] = {6, 5, 6, 9};
  at::manual_seed(3);
  for (int k = 0; k < 4; ++k) {
    h.h[k] = HessianAccumulator(dims[k]);
    ASSERT_TRUE(h.h[k].Add(at::randn({2, 7, dims[k]}, at::kFloat)).ok());
  }
  std::vector<at::Tensor> expected;
  for (int k = 0; k < 4; ++k) expected.push_back(h.h[k].Mean());
  HessianMeans means(&h);
  const at::Tensor q = means.For(model::LinearKind::kQ);
  EXPECT_TRUE(at::equal(q, expected[0]));
  EXPECT_EQ(h.h[0].dim(), 0);           // released once its mean exists
  EXPECT_TRUE(h.h[0].packed().empty());
  EXPECT_TRUE(means.For(model::LinearKind::kV).is_same(q));  // the same kind: not recomputed
  EXPECT_EQ(h.h[1].dim(), 5);           // not asked for yet
  EXPECT_TRUE(at::equal(means.For(model::LinearKind::kO), expected[1]));
  EXPECT_TRUE(at::equal(means.For(model::LinearKind::kUp), expected[2]));
  EXPECT_TRUE(at::equal(means.For(model::LinearKind::kDown), expected[3]));
  EXPECT_EQ(h.h[3].dim(), 0);
  HessianMeans none(nullptr);
  EXPECT_FALSE(none.For(model::LinearKind::kQ).defined());
}

// Bands (sharded calibration): the owners' bands tile [0, n) in whole strips with about equal
// numbers of values, and a band accumulator's values are the whole accumulator's there, bit for
// bit, for the production strip height and a small one.
TEST(HessianBandTest, BandsTileTheTriangleAndHoldTheWholeAccumulatorsValues) {
  model::SetComputeThreads(2);
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  struct Case {
    int64_t n, strip;
  };
  for (const Case c : {Case{1300, kHessianStripRows}, Case{100, 16}, Case{64, 16}}) {
    at::Tensor x = at::randn({5, 24, c.n});
    x.select(2, 3).mul_(200.0);
    HessianAccumulator whole(c.n, c.strip);
    ASSERT_TRUE(whole.Add(x).ok());
    ASSERT_TRUE(whole.Add(x.narrow(0, 0, 2)).ok());  // a second call adds on
    const int64_t total = c.n * (c.n + 1) / 2;
    for (int size : {1, 2, 3, 4}) {
      int64_t next_row = 0;
      for (int r = 0; r < size; ++r) {
        const HessianRows band = HessianBandForRank(c.n, r, size, c.strip);
        EXPECT_EQ(band.begin, next_row) << c.n << " rank " << r << "/" << size;
        next_row = band.end;
        EXPECT_TRUE(band.begin % c.strip == 0);
        EXPECT_TRUE(band.end % c.strip == 0 || band.end == c.n);
        auto acc = HessianAccumulator::Band(c.n, band, c.strip);
        ASSERT_TRUE(acc.ok()) << acc.status();
        ASSERT_TRUE(acc->Add(x).ok());
        ASSERT_TRUE(acc->Add(x.narrow(0, 0, 2)).ok());
        EXPECT_EQ(acc->count(), whole.count());
        EXPECT_EQ(acc->is_band(), size > 1 && !(band.begin == 0 && band.end == c.n));
        const int64_t begin = acc->packed_begin();
        const int64_t size_vals = static_cast<int64_t>(acc->packed().size());
        // Balanced: no band holds more than its share plus one strip's values.
        EXPECT_LE(size_vals, total / size + c.strip * c.n) << c.n << " rank " << r << "/" << size;
        ASSERT_LE(begin + size_vals, total);
        EXPECT_TRUE(std::equal(acc->packed().begin(), acc->packed().end(),
                               whole.packed().begin() + begin))
            << "band [" << band.begin << ", " << band.end << ") of " << c.n << " differs";
        int64_t nonzero = 0;
        for (Fixed v : acc->packed()) nonzero += v != 0;
        EXPECT_EQ(nonzero, size_vals) << "random inputs give no zero sums";
      }
      EXPECT_EQ(next_row, c.n);
    }
  }
  // With more ranks than strips some bands are empty, and the bands still tile.
  EXPECT_EQ(HessianBandForRank(64, 0, 2).end, 64);
  EXPECT_EQ(HessianBandForRank(64, 1, 2).begin, 64);
  EXPECT_EQ(HessianBandForRank(64, 1, 2).end, 64);
  auto empty = HessianAccumulator::Band(64, HessianBandForRank(64, 1, 2));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->packed().empty());
  ASSERT_TRUE(empty->Add(at::randn({2, 8, 64})).ok());
  EXPECT_EQ(empty->count(), 16);
}

TEST(HessianBandTest, MisalignedBandsAndMixedMergesAreRefused) {
  EXPECT_EQ(HessianAccumulator::Band(1300, {100, 512}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HessianAccumulator::Band(1300, {0, 700}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HessianAccumulator::Band(1300, {512, 1400}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto a = HessianAccumulator::Band(1300, {0, 512});
  auto b = HessianAccumulator::Band(1300, {512, 1300});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->Merge(*b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Add(at::randn({1, 4, 1300}, at::kDouble)).code(),
            absl::StatusCode::kInvalidArgument)
      << "bands take fp32 products only";
  EXPECT_THROW(a->Mean(), c10::Error) << "a band has no fp64 form";
}

}  // namespace
}  // namespace qcal::calib
