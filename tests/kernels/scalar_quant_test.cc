// Tests for kernels/scalar_quant.h: exact codes / scales / zero points on hand-made inputs, the
// symmetric vs asymmetric ranges, groups (ragged), per-token activations, clip ratio and the
// clip search (never worse than no clipping), round-trips and determinism.
//
// Tolerances: hand-made inputs are chosen so every scale is a power of two times a small integer
// and all arithmetic is exact, so those checks are exact (EXPECT_EQ). Random inputs are checked
// against the RTN error bound |x - q| <= scale/2 (with a 1e-12 relative slack for the division
// x / scale) and clip-search errors against the unclipped error with no slack.
#include "kernels/scalar_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

// Box-Muller from mt19937_64 (bit-reproducible everywhere for a seed).
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

ScalarQuantConfig Cfg(int bits, bool sym, QuantGranularity g, int64_t group = 128) {
  ScalarQuantConfig c;
  c.bits = bits;
  c.symmetric = sym;
  c.granularity = g;
  c.group_size = group;
  return c;
}

TEST(ScalarQuantTest, SymmetricPerTensorHandExample) {
  // max|x| = 7, 4-bit symmetric: qmax = 7, scale = 1, codes in [-8, 7].
  const std::vector<double> x = {7, -7, 3.5, 2.5, -2.5, 1.2, 0.49, -0.5};
  auto q = QuantizeScalar(x.data(), 1, 8, Cfg(4, true, QuantGranularity::kPerTensor));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->param_rows, 1);
  EXPECT_EQ(q->param_cols, 1);
  EXPECT_EQ(q->scales[0], 1.0);
  EXPECT_EQ(q->zeros[0], 0);
  // Ties round to even: 3.5 -> 4, 2.5 -> 2, -2.5 -> -2, -0.5 -> -0.
  EXPECT_EQ(q->codes, (std::vector<int32_t>{7, -7, 4, 2, -2, 1, 0, 0}));
  EXPECT_EQ(q->values, (std::vector<double>{7, -7, 4, 2, -2, 1, 0, 0}));
}

TEST(ScalarQuantTest, SymmetricClipRatioUsesTheFullSignedRange) {
  // clip 0.5: scale = 0.5·7/7 = 0.5; ±7 map to ±14 and clamp to 7 and -8 (the extra negative
  // level of the two's-complement range).
  const std::vector<float> x = {7, -7, 3.5f, 2.5f, -2.5f, 1.2f, 0.49f, -0.5f};
  ScalarQuantConfig c = Cfg(4, true, QuantGranularity::kPerTensor);
  c.clip_ratio = 0.5;
  auto q = QuantizeScalar(x.data(), 1, 8, c);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->scales[0], 0.5f);
  EXPECT_EQ(q->clip_ratios[0], 0.5);
  EXPECT_EQ(q->codes, (std::vector<int32_t>{7, -8, 7, 5, -5, 2, 1, -1}));
  EXPECT_EQ(q->values, (std::vector<float>{3.5f, -4, 3.5f, 2.5f, -2.5f, 1, 0.5f, -0.5f}));
}

TEST(ScalarQuantTest, AsymmetricHandExamples) {
  // 3-bit asymmetric: qmax = 7. [-1, 6] -> scale 1, zero 1.
  {
    const std::vector<double> x = {-1, 0, 1, 2, 5, 6};
    auto q = QuantizeScalar(x.data(), 1, 6, Cfg(3, false, QuantGranularity::kPerChannel));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->scales[0], 1.0);
    EXPECT_EQ(q->zeros[0], 1);
    EXPECT_EQ(q->codes, (std::vector<int32_t>{0, 1, 2, 3, 6, 7}));
    EXPECT_EQ(q->values, x);
  }
  // All positive: the range is extended to include 0, so lo = 0, scale = 7/7, zero = 0.
  {
    const std::vector<double> x = {2, 3, 4.5, 7};
    auto q = QuantizeScalar(x.data(), 1, 4, Cfg(3, false, QuantGranularity::kPerChannel));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->scales[0], 1.0);
    EXPECT_EQ(q->zeros[0], 0);
    EXPECT_EQ(q->codes, (std::vector<int32_t>{2, 3, 4, 7}));
  }
  // All negative: hi = 0, [-14, 0] in 3 bits -> scale 2, zero 7.
  {
    const std::vector<double> x = {-14, -7, -2, 0};
    auto q = QuantizeScalar(x.data(), 1, 4, Cfg(3, false, QuantGranularity::kPerChannel));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->scales[0], 2.0);
    EXPECT_EQ(q->zeros[0], 7);
    // -7/2 = -3.5 rounds to -4 (ties to even), + 7 = 3.
    EXPECT_EQ(q->codes, (std::vector<int32_t>{0, 3, 6, 7}));
    EXPECT_EQ(q->values, (std::vector<double>{-14, -8, -2, 0}));
  }
}

TEST(ScalarQuantTest, AllZeroSetsDequantizeToZero) {
  const std::vector<double> x(6, 0.0);
  for (bool sym : {true, false}) {
    auto q = QuantizeScalar(x.data(), 2, 3, Cfg(4, sym, QuantGranularity::kPerChannel));
    ASSERT_TRUE(q.ok()) << q.status();
    for (double v : q->values) EXPECT_EQ(v, 0.0);
    if (sym) {
      EXPECT_EQ(q->scales[0], 1.0);
      EXPECT_EQ(q->zeros[0], 0);
    } else {  // GPTQ's fallback range [-1, 1]: scale 2/15, zero round(7.5) = 8.
      EXPECT_EQ(q->scales[0], 2.0 / 15.0);
      EXPECT_EQ(q->zeros[0], 8);
      for (int32_t c : q->codes) EXPECT_EQ(c, 8);
    }
  }
}

TEST(ScalarQuantTest, SymmetricVsAsymmetricRanges) {
  // Same data, 2 bits: symmetric uses codes {-2..1} around 0, asymmetric {0..3} over [lo, hi].
  const std::vector<double> x = {0, 1, 2, 3};
  auto s = QuantizeScalar(x.data(), 1, 4, Cfg(2, true, QuantGranularity::kPerTensor));
  auto a = QuantizeScalar(x.data(), 1, 4, Cfg(2, false, QuantGranularity::kPerTensor));
  ASSERT_TRUE(s.ok() && a.ok());
  // Symmetric: qmax = 1, scale = 3, codes round(x/3) = {0, 0, 1, 1}.
  EXPECT_EQ(s->scales[0], 3.0);
  EXPECT_EQ(s->codes, (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(ScalarCodeMin(Cfg(2, true, QuantGranularity::kPerTensor)), -2);
  EXPECT_EQ(ScalarCodeMax(Cfg(2, true, QuantGranularity::kPerTensor)), 1);
  // Asymmetric: qmax = 3, scale = 1, zero = 0: exact.
  EXPECT_EQ(a->scales[0], 1.0);
  EXPECT_EQ(a->zeros[0], 0);
  EXPECT_EQ(a->codes, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(a->values, x);
  EXPECT_EQ(ScalarCodeMin(Cfg(2, false, QuantGranularity::kPerTensor)), 0);
  EXPECT_EQ(ScalarCodeMax(Cfg(2, false, QuantGranularity::kPerTensor)), 3);
}

TEST(ScalarQuantTest, PerGroupWithRaggedLastGroup) {
  // [2, 5], groups of 2 -> 3 groups (the last 1 wide). 3-bit symmetric: qmax = 3.
  const std::vector<double> x = {3, -1, 6,  2, 1.5,  //
                                 0, 0,  -6, 5, 0.75};
  auto q = QuantizeScalar(x.data(), 2, 5, Cfg(3, true, QuantGranularity::kPerGroup, 2));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->param_rows, 2);
  EXPECT_EQ(q->param_cols, 3);
  EXPECT_EQ(q->group_cols, 2);
  EXPECT_EQ(q->scales, (std::vector<double>{1, 2, 0.5, 1, 2, 0.25}));
  EXPECT_EQ(q->zeros, (std::vector<int32_t>(6, 0)));
  // Row 1: 5/2 = 2.5 -> 2 (even); 0.75/0.25 = 3.
  EXPECT_EQ(q->codes, (std::vector<int32_t>{3, -1, 3, 1, 3,  //
                                            0, 0, -3, 2, 3}));
  EXPECT_EQ(q->values, (std::vector<double>{3, -1, 6, 2, 1.5,  //
                                            0, 0, -6, 4, 0.75}));
  EXPECT_EQ(q->params(1, 4).scale, 0.25);
  EXPECT_EQ(q->params(0, 3).scale, 2.0);
}

TEST(ScalarQuantTest, GroupSizeLargerThanColsIsOneGroup) {
  const std::vector<double> x = {1, -2, 3};
  auto q = QuantizeScalar(x.data(), 1, 3, Cfg(4, true, QuantGranularity::kPerGroup, 128));
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->param_cols, 1);
  EXPECT_EQ(q->scales[0], 3.0 / 7.0);
}

TEST(ScalarQuantTest, PerTokenActivationsRandom) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t tokens = 37, hidden = 96;
  std::vector<float> x(tokens * hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    const double row_scale = std::exp(2.0 * gauss());  // Tokens of very different magnitude.
    for (int64_t j = 0; j < hidden; ++j)
      x[t * hidden + j] = static_cast<float>(row_scale * gauss());
  }
  for (bool sym : {true, false}) {
    SCOPED_TRACE(sym ? "symmetric" : "asymmetric");
    auto q = QuantizeScalar(x.data(), tokens, hidden, Cfg(8, sym, QuantGranularity::kPerToken));
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_EQ(q->param_rows, tokens);
    ASSERT_EQ(q->param_cols, 1);
    bool any_nonzero = false;
    for (int64_t t = 0; t < tokens; ++t) {
      float lo = 0, hi = 0;
      for (int64_t j = 0; j < hidden; ++j) {
        lo = std::min(lo, x[t * hidden + j]);
        hi = std::max(hi, x[t * hidden + j]);
      }
      const double expect_scale = sym ? std::max(-lo, hi) / 127.0 : (double(hi) - lo) / 255.0;
      EXPECT_EQ(q->scales[t], static_cast<float>(expect_scale)) << "token " << t;
      for (int64_t j = 0; j < hidden; ++j) {
        const double err = std::fabs(double(q->values[t * hidden + j]) - x[t * hidden + j]);
        EXPECT_LE(err, 0.5 * q->scales[t] * (1 + 1e-4))
            << t << "," << j;  // float rounding of (c-z)·s
        any_nonzero |= q->values[t * hidden + j] != 0.0f;
      }
    }
    EXPECT_TRUE(any_nonzero);
  }
}

TEST(ScalarQuantTest, PerChannelRtnErrorBoundAndRoundTrip) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 24, cols = 200;
  std::vector<double> x(rows * cols);
  for (auto& v : x) v = gauss();
  for (int bits : {2, 3, 4, 8}) {
    for (bool sym : {true, false}) {
      for (QuantGranularity g : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup,
                                 QuantGranularity::kPerTensor}) {
        SCOPED_TRACE(::testing::Message()
                     << "bits " << bits << " sym " << sym << " gran " << static_cast<int>(g));
        auto q = QuantizeScalar(x.data(), rows, cols, Cfg(bits, sym, g, 64));
        ASSERT_TRUE(q.ok()) << q.status();
        std::vector<double> back(rows * cols);
        DequantizeScalar(*q, back.data());
        EXPECT_EQ(back, q->values);  // Bit-exact from (codes, scales, zeros).
        const ScalarQuantConfig c = Cfg(bits, sym, g, 64);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < cols; ++j) {
            const auto p = q->params(r, j);
            const int32_t code = q->codes[r * cols + j];
            ASSERT_GE(code, ScalarCodeMin(c));
            ASSERT_LE(code, ScalarCodeMax(c));
            const double err = std::fabs(q->values[r * cols + j] - x[r * cols + j]);
            ASSERT_LE(err, 0.5 * p.scale * (1 + 1e-12)) << r << "," << j;
          }
        }
      }
    }
  }
}

TEST(ScalarQuantTest, HalfScalesAreExactInFp16AndKeepTheErrorBound) {
  EXPECT_EQ(RoundScaleToHalf(0.1), static_cast<double>(HalfToFloat(FloatToHalf(0.1f))));
  EXPECT_EQ(RoundScaleToHalf(1e-9), 0x1.0p-14);  // below the normal half range
  EXPECT_EQ(RoundScaleToHalf(1e9), 65504.0);
  EXPECT_EQ(RoundScaleToHalf(0.375), 0.375);     // already a half
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 16, cols = 96;
  std::vector<double> x(rows * cols);
  for (auto& v : x) v = 0.02 * gauss();  // weight-sized values
  for (bool sym : {true, false}) {
    for (bool clip : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "sym " << sym << " clip " << clip);
      ScalarQuantConfig c = Cfg(4, sym, QuantGranularity::kPerGroup, 32);
      c.clip_search = clip;
      c.f16_scales = true;
      auto q = QuantizeScalar(x.data(), rows, cols, c);
      ASSERT_TRUE(q.ok()) << q.status();
      c.f16_scales = false;
      auto q32 = QuantizeScalar(x.data(), rows, cols, c);
      ASSERT_TRUE(q32.ok());
      bool any_differs = false;
      for (size_t k = 0; k < q->scales.size(); ++k) {
        const double s = q->scales[k];
        // The scale is a half value, and fp32 dequantization in an fp16-scale format is exact.
        EXPECT_EQ(s, static_cast<double>(HalfToFloat(FloatToHalf(static_cast<float>(s))))) << k;
        any_differs |= s != q32->scales[k];
      }
      EXPECT_TRUE(any_differs);  // the rounding did something, so the test can fail
      for (int64_t i = 0; i < rows * cols; ++i) {
        const auto p = q->params(i / cols, i % cols);
        const float f32 = static_cast<float>(p.scale) *
                          static_cast<float>(q->codes[i] - p.zero);
        ASSERT_EQ(static_cast<double>(f32), q->values[i]) << i;
        // The half rounding of the scale (up to 2^-11 of it, either way) can move the grid's
        // far end by up to qmax·2^-11 steps, so the bound is half a step plus that.
        const double qmax = static_cast<double>(ScalarCodeMax(c));
        if (!clip) {
          ASSERT_LE(std::fabs(q->values[i] - x[i]), (0.5 + qmax * 0x1p-11) * p.scale * (1 + 1e-12))
              << i;
        }
      }
    }
  }
}

// Heavy-tailed rows: a few large outliers make clipping worthwhile.
std::vector<double> HeavyTailed(Gaussian& gauss, int64_t n) {
  std::vector<double> x(n);
  for (auto& v : x) {
    v = gauss();
    if ((gauss.Bits() & 63) == 0) v *= 8.0;
  }
  return x;
}

TEST(ScalarQuantTest, ClipSearchNeverWorseThanNoClipAndIsTheArgmin) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 32, cols = 256;
  const std::vector<double> x = HeavyTailed(gauss, rows * cols);
  for (double norm : {2.0, 2.4}) {
    for (bool sym : {true, false}) {
      for (int bits : {2, 3, 4}) {
        SCOPED_TRACE(::testing::Message() << "norm " << norm << " sym " << sym << " bits " << bits);
        ScalarQuantConfig plain = Cfg(bits, sym, QuantGranularity::kPerChannel);
        ScalarQuantConfig search = plain;
        search.clip_search = true;
        search.clip_search_norm = norm;
        auto a = QuantizeScalar(x.data(), rows, cols, plain);
        auto b = QuantizeScalar(x.data(), rows, cols, search);
        ASSERT_TRUE(a.ok() && b.ok());
        int clipped = 0;
        for (int64_t r = 0; r < rows; ++r) {
          double ea = 0, eb = 0;
          for (int64_t j = 0; j < cols; ++j) {
            ea += std::pow(std::fabs(a->values[r * cols + j] - x[r * cols + j]), norm);
            eb += std::pow(std::fabs(b->values[r * cols + j] - x[r * cols + j]), norm);
          }
          EXPECT_LE(eb, ea) << "row " << r;
          clipped += b->clip_ratios[r] < 1.0;
          // The chosen ratio is one of 1 - i/100, i < 80, and no other ratio is strictly better.
          const double ratio = b->clip_ratios[r];
          const double i_exact = (1.0 - ratio) * 100.0;
          EXPECT_NEAR(i_exact, std::round(i_exact), 1e-9);
          EXPECT_LT(std::round(i_exact), 80);
          for (int i = 0; i < 80; ++i) {
            ScalarQuantConfig fixed = plain;
            fixed.clip_ratio = 1.0 - i / 100.0;
            const auto p = ComputeScalarQuantParams(&x[r * cols], cols, fixed);
            double e = 0;
            for (int64_t j = 0; j < cols; ++j) {
              const double v =
                  ScalarDequantizeCode(ScalarQuantizeCode(x[r * cols + j], p, ScalarCodeMin(plain),
                                                          ScalarCodeMax(plain)),
                                       p);
              e += std::pow(std::fabs(v - x[r * cols + j]), norm);
            }
            EXPECT_GE(e, eb * (1 - 1e-12)) << "row " << r << " ratio " << fixed.clip_ratio;
          }
        }
        if (bits <= 3) {
          EXPECT_GT(clipped, 0) << "heavy tails should make clipping pay off";
        }
      }
    }
  }
}

// The search stops summing a candidate's error once it reaches the best so far. It must choose
// exactly what the plain search chooses: the first grid point (1 - i/grid) whose full error,
// summed in index order, is smallest. Rows here are longer than the stopping check's stride and
// not a multiple of it, and some rows make many grid points tie exactly.
TEST(ScalarQuantTest, ClipSearchChoosesTheFirstExactArgmin) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 12, cols = 1000;
  std::vector<double> x = HeavyTailed(gauss, rows * cols);
  for (int64_t j = 0; j < cols; ++j) {
    x[0 * cols + j] = 0.25;                      // constant: every ratio's error is tied
    x[1 * cols + j] = (j % 5) - 2.0;             // five levels
    x[2 * cols + j] = j == 7 ? 40.0 : (j % 2 ? 1.0 : -1.0);  // one outlier
    x[3 * cols + j] = std::ldexp(gauss(), -20);  // tiny
  }
  for (double norm : {2.0, 2.4, 1.0}) {
    for (bool sym : {true, false}) {
      for (int bits : {2, 4, 8}) {
        SCOPED_TRACE(::testing::Message() << "norm " << norm << " sym " << sym << " bits " << bits);
        ScalarQuantConfig search = Cfg(bits, sym, QuantGranularity::kPerChannel);
        search.clip_search = true;
        search.clip_search_norm = norm;
        const int32_t cmin = ScalarCodeMin(search), cmax = ScalarCodeMax(search);
        for (int64_t r = 0; r < rows; ++r) {
          const double* row = &x[r * cols];
          double lo = 0, hi = 0;
          for (int64_t j = 0; j < cols; ++j) {
            lo = std::min(lo, row[j]);
            hi = std::max(hi, row[j]);
          }
          const int steps = static_cast<int>(search.clip_search_max_shrink * search.clip_search_grid);
          ScalarQuantParams<double> want{};
          double want_err = 0;
          for (int i = 0; i < steps; ++i) {
            const double ratio = 1.0 - static_cast<double>(i) / search.clip_search_grid;
            const auto p = ScalarQuantParamsFromRange<double>(lo, hi, ratio, search);
            double e = 0;
            for (int64_t j = 0; j < cols; ++j) {
              const double d =
                  ScalarDequantizeCode(ScalarQuantizeCode(row[j], p, cmin, cmax), p) - row[j];
              e += norm == 2.0 ? d * d : std::pow(std::fabs(d), norm);
            }
            if (i == 0 || e < want_err) {
              want_err = e;
              want = p;
            }
          }
          const auto got = ComputeScalarQuantParams(row, cols, search);
          EXPECT_EQ(got.clip_ratio, want.clip_ratio) << "row " << r;
          EXPECT_EQ(got.scale, want.scale) << "row " << r;
          EXPECT_EQ(got.zero, want.zero) << "row " << r;
        }
      }
    }
  }
}

TEST(ScalarQuantTest, ClipSearchPerGroupAndPerTensor) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 8, cols = 300;
  const std::vector<double> x = HeavyTailed(gauss, rows * cols);
  for (QuantGranularity g : {QuantGranularity::kPerGroup, QuantGranularity::kPerTensor}) {
    ScalarQuantConfig plain = Cfg(3, true, g, 128);
    plain.clip_search_norm = 2.0;
    ScalarQuantConfig search = plain;
    search.clip_search = true;
    auto a = QuantizeScalar(x.data(), rows, cols, plain);
    auto b = QuantizeScalar(x.data(), rows, cols, search);
    ASSERT_TRUE(a.ok() && b.ok());
    double ea = 0, eb = 0;
    for (int64_t i = 0; i < rows * cols; ++i) {
      ea += (a->values[i] - x[i]) * (a->values[i] - x[i]);
      eb += (b->values[i] - x[i]) * (b->values[i] - x[i]);
    }
    EXPECT_LE(eb, ea);
  }
}

TEST(ScalarQuantTest, RejectsBadInput) {
  const std::vector<double> x = {1, 2, 3, 4};
  ScalarQuantConfig c = Cfg(1, true, QuantGranularity::kPerChannel);
  EXPECT_EQ(QuantizeScalar(x.data(), 1, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Cfg(17, false, QuantGranularity::kPerChannel);
  EXPECT_EQ(QuantizeScalar(x.data(), 1, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Cfg(4, true, QuantGranularity::kPerGroup, 0);
  EXPECT_EQ(QuantizeScalar(x.data(), 1, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Cfg(4, true, QuantGranularity::kPerChannel);
  c.clip_ratio = 0.0;
  EXPECT_EQ(QuantizeScalar(x.data(), 1, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  c.clip_ratio = 1.5;
  EXPECT_EQ(QuantizeScalar(x.data(), 1, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Cfg(4, true, QuantGranularity::kPerChannel);
  EXPECT_EQ(QuantizeScalar(x.data(), 0, 4, c).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<double> bad = {1, NAN, 3, 4};
  auto s = QuantizeScalar(bad.data(), 2, 2, c);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.status().message()).find("row 0, col 1"), std::string::npos)
      << s.status();
  // Asymmetric 1-bit is a valid grid {0, 1}.
  c = Cfg(1, false, QuantGranularity::kPerChannel);
  EXPECT_TRUE(QuantizeScalar(x.data(), 1, 4, c).ok());
}

TEST(ScalarQuantTest, SameInputSameBits) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g1(seed), g2(seed);
  std::vector<float> a(64 * 64), b(64 * 64);
  for (auto& v : a) v = static_cast<float>(g1());
  for (auto& v : b) v = static_cast<float>(g2());
  ASSERT_EQ(a, b);  // Same seed -> same data.
  ScalarQuantConfig c = Cfg(3, false, QuantGranularity::kPerGroup, 24);
  c.clip_search = true;
  auto qa = QuantizeScalar(a.data(), 64, 64, c);
  auto qb = QuantizeScalar(b.data(), 64, 64, c);
  ASSERT_TRUE(qa.ok() && qb.ok());
  EXPECT_EQ(qa->codes, qb->codes);
  EXPECT_EQ(qa->scales, qb->scales);
  EXPECT_EQ(qa->zeros, qb->zeros);
  EXPECT_EQ(qa->values, qb->values);
}

// Rows are split into fixed tasks of at least 2^16 weights (16 rows of 4096 here: 5 tasks for 70
// rows, the last one ragged) and run on 1, 2 or 5 threads: every parameter and code is the same,
// and each row is exactly what the search alone chooses for that row (a task that skipped or
// repeated rows would leave zeros or shift them).
TEST(ScalarQuantTest, ThreadCountDoesNotChangeABit) {
  const int64_t rows = 70, cols = 4096;
  Gaussian g(testing::TestSeed());
  std::vector<double> w(rows * cols);
  for (auto& v : w) v = g();
  for (const QuantGranularity gran : {QuantGranularity::kPerChannel, QuantGranularity::kPerGroup}) {
    ScalarQuantConfig c = Cfg(4, gran == QuantGranularity::kPerChannel, gran, 1000);
    c.clip_search = true;
    auto one = QuantizeScalar(w.data(), rows, cols, c, 1);
    ASSERT_TRUE(one.ok()) << one.status();
    for (int threads : {2, 5}) {
      auto many = QuantizeScalar(w.data(), rows, cols, c, threads);
      ASSERT_TRUE(many.ok()) << many.status();
      EXPECT_EQ(one->codes, many->codes) << threads << " threads";
      EXPECT_EQ(one->scales, many->scales) << threads << " threads";
      EXPECT_EQ(one->zeros, many->zeros) << threads << " threads";
      EXPECT_EQ(one->clip_ratios, many->clip_ratios) << threads << " threads";
      EXPECT_EQ(one->values, many->values) << threads << " threads";
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < one->param_cols; ++k) {
        const int64_t c0 = k * one->group_cols;
        const auto p = ComputeScalarQuantParams(&w[r * cols + c0],
                                                std::min(one->group_cols, cols - c0), c);
        ASSERT_EQ(one->scales[r * one->param_cols + k], p.scale) << "row " << r << " group " << k;
        ASSERT_EQ(one->zeros[r * one->param_cols + k], p.zero) << "row " << r << " group " << k;
      }
    }
  }
}

}  // namespace
}  // namespace qcal::kernels
