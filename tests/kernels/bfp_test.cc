// Tests for kernels/bfp.h: hand examples (exponent choice, saturation, mantissa rounding),
// layouts (ragged blocks, column blocks), exact dequantization, error bounds, BFP16 vs BFP12 and
// the effect of the block size on data with outliers.
//
// Tolerances: BFP values are M·2^k, exact in float, so hand examples and round-trips are exact.
// The per-element error bound |x - q| <= 2^(E-p+2)/2 (unsaturated) or < 2^(E-p+2) (saturated)
// is exact too. Comparisons between formats are strict inequalities of the MSE over >= 64k
// random elements.
#include "kernels/bfp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

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

TEST(BfpTest, SharedExponentIsFloorLog2OfTheMaxMagnitude) {
  EXPECT_EQ(BfpSharedExponent(1.0f), 127);  // 2^0.
  EXPECT_EQ(BfpSharedExponent(1.999f), 127);
  EXPECT_EQ(BfpSharedExponent(2.0f), 128);
  EXPECT_EQ(BfpSharedExponent(0.75f), 126);  // 1.5 · 2^-1.
  EXPECT_EQ(BfpSharedExponent(7.9f), 129);   // 2^2.
  EXPECT_EQ(BfpSharedExponent(0.0f), 0);
  EXPECT_EQ(BfpSharedExponent(3.0e38f), 254);               // 2^127.
  EXPECT_EQ(BfpSharedExponent(std::ldexp(1.0f, -126)), 1);  // Smallest normal.
  EXPECT_EQ(BfpSharedExponent(std::ldexp(1.0f, -140)), 0);  // Subnormal: clamped to -127.
}

TEST(BfpTest, Bfp12HandExamples) {
  // Block {7.9, 1.0, -0.3}: E = 2, element scale 2^(2-2) = 1. 7.9 rounds to 8 and saturates
  // to 7; -0.3 rounds to 0.
  {
    const std::vector<float> x = {7.9f, 1.0f, -0.3f};
    auto q = BfpQuantize(x.data(), 1, 3, BfpFormat::Bfp12(3));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->exponents, (std::vector<uint8_t>{129}));
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{7, 1, 0}));
    EXPECT_EQ(q->values, (std::vector<float>{7, 1, 0}));
  }
  // Block {15, 3, -5, 1}: E = 3, scale 2. 15/2 = 7.5 -> 8 (tie to even) -> saturates to 7;
  // 3/2 = 1.5 -> 2 (tie to even); -5/2 = -2.5 -> -2 (tie to even); 1/2 = 0.5 -> 0.
  {
    const std::vector<float> x = {15, 3, -5, 1};
    auto q = BfpQuantize(x.data(), 1, 4, BfpFormat::Bfp12(4));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->exponents, (std::vector<uint8_t>{130}));
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{7, 2, -2, 0}));
    EXPECT_EQ(q->values, (std::vector<float>{14, 4, -4, 0}));
  }
  // Negative max: {-6, 2.6}: E = 2, scale 1: -6, 3.
  {
    const std::vector<float> x = {-6, 2.6f};
    auto q = BfpQuantize(x.data(), 1, 2, BfpFormat::Bfp12(2));
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{-6, 3}));
  }
}

TEST(BfpTest, Bfp16HandExamples) {
  // {1, -0.75, 0.01}: E = 0, scale 2^-6: 64, -48, 0.64 -> 1.
  {
    const std::vector<float> x = {1.0f, -0.75f, 0.01f};
    auto q = BfpQuantize(x.data(), 1, 3, BfpFormat::Bfp16(8));
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(q->exponents, (std::vector<uint8_t>{127}));
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{64, -48, 1}));
    EXPECT_EQ(q->values, (std::vector<float>{1.0f, -0.75f, 0.015625f}));
  }
  // Saturation: 1.999·64 = 127.94 -> 128 -> 127.
  {
    const std::vector<float> x = {1.999f, -1.999f};
    auto q = BfpQuantize(x.data(), 1, 2, BfpFormat::Bfp16(2));
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{127, -127}));
    EXPECT_EQ(q->values, (std::vector<float>{1.984375f, -1.984375f}));
  }
  // A zero block.
  {
    const std::vector<float> x = {0, -0.0f, 0};
    auto q = BfpQuantize(x.data(), 1, 3, BfpFormat::Bfp16(3));
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(q->exponents, (std::vector<uint8_t>{0}));
    EXPECT_EQ(q->mantissas, (std::vector<int8_t>{0, 0, 0}));
    for (float v : q->values) EXPECT_EQ(v, 0.0f);
  }
}

TEST(BfpTest, SignMagnitudeRoundTrip) {
  EXPECT_EQ(EncodeSignMagnitude(-7, 4), 0b1111);
  EXPECT_EQ(EncodeSignMagnitude(7, 4), 0b0111);
  EXPECT_EQ(EncodeSignMagnitude(-1, 4), 0b1001);
  EXPECT_EQ(EncodeSignMagnitude(0, 4), 0);
  EXPECT_EQ(EncodeSignMagnitude(-127, 8), 0xFF);
  for (int p = 2; p <= 8; ++p) {
    const int mmax = (1 << (p - 1)) - 1;
    for (int m = -mmax; m <= mmax; ++m) {
      const uint8_t bits = EncodeSignMagnitude(m, p);
      EXPECT_LT(bits, 1 << p);
      EXPECT_EQ(DecodeSignMagnitude(bits, p), m);
    }
  }
}

TEST(BfpTest, RaggedBlocksAndColumnAxis) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 7, cols = 13;
  std::vector<float> x(rows * cols), xt(rows * cols);
  for (auto& v : x) v = static_cast<float>(gauss());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  }
  const BfpFormat f = BfpFormat::Bfp12(4);
  auto along_rows = BfpQuantize(x.data(), rows, cols, f, BfpAxis::kAlongRows);
  ASSERT_TRUE(along_rows.ok());
  EXPECT_EQ(along_rows->exponent_rows, rows);
  EXPECT_EQ(along_rows->exponent_cols, 4);  // 4 + 4 + 4 + 1.
  // Each row equals the 1-D quantize-dequantize of that row.
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    ASSERT_TRUE(BfpQuantizeDequantize(row.data(), cols, f, row.data()).ok());  // In place.
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(row[c], along_rows->values[r * cols + c]);
  }
  // Column blocks of x == row blocks of xᵀ.
  auto along_cols = BfpQuantize(x.data(), rows, cols, f, BfpAxis::kAlongColumns);
  auto t = BfpQuantize(xt.data(), cols, rows, f, BfpAxis::kAlongRows);
  ASSERT_TRUE(along_cols.ok() && t.ok());
  EXPECT_EQ(along_cols->exponent_rows, 2);  // 4 + 3 rows.
  EXPECT_EQ(along_cols->exponent_cols, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(along_cols->values[r * cols + c], t->values[c * rows + r]);
      EXPECT_EQ(along_cols->mantissas[r * cols + c], t->mantissas[c * rows + r]);
    }
  }
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(along_cols->exponents[b * cols + c], t->exponents[c * 2 + b]);
    }
  }
}

TEST(BfpTest, DequantizeIsExactAndErrorIsBounded) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  const int64_t rows = 16, cols = 1000;
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = static_cast<float>(std::exp(3.0 * gauss()) * gauss());
  for (const BfpFormat f : {BfpFormat::Bfp12(16), BfpFormat::Bfp16(32), BfpFormat{7, 5}}) {
    SCOPED_TRACE(::testing::Message() << "block " << f.block_size << " p " << f.mantissa_bits);
    auto q = BfpQuantize(x.data(), rows, cols, f);
    ASSERT_TRUE(q.ok());
    std::vector<float> back(rows * cols);
    BfpDequantize(*q, back.data());
    EXPECT_EQ(back, q->values);
    const int p = f.mantissa_bits;
    const int mmax = (1 << (p - 1)) - 1;
    bool nonzero = false;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int e = q->exponents[r * q->exponent_cols + c / f.block_size] - kBfpExponentBias;
        const double scale = std::ldexp(1.0, e - p + 2);
        const int m = q->mantissas[r * cols + c];
        ASSERT_LE(std::abs(m), mmax);
        const double err = std::fabs(double(q->values[r * cols + c]) - x[r * cols + c]);
        if (std::abs(m) < mmax) {
          ASSERT_LE(err, 0.5 * scale);
        } else {
          ASSERT_LT(err, scale);
        }
        nonzero |= m != 0;
      }
    }
    EXPECT_TRUE(nonzero);
  }
}

double Mse(const std::vector<float>& x, const BfpFormat& f) {
  std::vector<float> out(x.size());
  EXPECT_TRUE(BfpQuantizeDequantize(x.data(), static_cast<int64_t>(x.size()), f, out.data()).ok());
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += (double(out[i]) - x[i]) * (double(out[i]) - x[i]);
  return s / static_cast<double>(x.size());
}

TEST(BfpTest, Bfp16IsMoreAccurateThanBfp12) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  std::vector<float> x(1 << 16);
  for (auto& v : x) v = static_cast<float>(gauss());
  for (int bs : {16, 32, 64, 128}) {
    const double e12 = Mse(x, BfpFormat::Bfp12(bs));
    const double e16 = Mse(x, BfpFormat::Bfp16(bs));
    std::printf("block %3d: BFP12 MSE %.3e, BFP16 MSE %.3e\n", bs, e12, e16);
    EXPECT_GT(e16, 0.0);
    EXPECT_LT(e16, e12);
    EXPECT_LT(e16, e12 / 100.0);  // 4 more mantissa bits: ~256x smaller.
  }
}

TEST(BfpTest, SmallerBlocksHelpWithOutliers) {
  const uint64_t seed = testing::TestSeed();
  Gaussian gauss(seed);
  std::vector<float> x(1 << 16);
  for (auto& v : x) {
    v = static_cast<float>(gauss());
    if ((gauss.Bits() & 127) == 0) v *= 100.0f;  // ~0.8% outliers.
  }
  for (int p : {4, 8}) {
    double prev = 0.0;
    for (int bs : {512, 128, 32, 8}) {
      const double e = Mse(x, BfpFormat{bs, p});
      std::printf("p %d block %3d: MSE %.3e\n", p, bs, e);
      if (prev > 0.0) {
        EXPECT_LT(e, prev) << "block " << bs;
      }
      prev = e;
    }
  }
}

TEST(BfpTest, RejectsBadInput) {
  const std::vector<float> x = {1, 2, 3};
  EXPECT_EQ(BfpQuantize(x.data(), 1, 3, BfpFormat{0, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BfpQuantize(x.data(), 1, 3, BfpFormat{4, 9}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BfpQuantize(x.data(), 1, 3, BfpFormat{4, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BfpQuantize(x.data(), 0, 3, BfpFormat{4, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<float> bad = {1, INFINITY, 3};
  EXPECT_EQ(BfpQuantize(bad.data(), 1, 3, BfpFormat{4, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_DOUBLE_EQ(BfpFormat::Bfp12(32).bits_per_element(), 4.25);
  EXPECT_DOUBLE_EQ(BfpFormat::Bfp16(16).bits_per_element(), 8.5);
}

}  // namespace
}  // namespace qcal::kernels
