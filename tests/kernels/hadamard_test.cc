// Tests for the CPU Hadamard / RHT / RFFT reference (kernels/hadamard.h).
//
// Random inputs are fresh per run; the seed is printed and can be pinned with QCAL_TEST_SEED.
// Tolerances: exact integer arithmetic for the ±1 matrices; 1e-12 in fp64 for orthogonality,
// inverse∘forward and agreement with dense products; fp32 results against fp64 within
// 1e-5·sqrt(log2 n) relative to the vector's RMS (fp32 rounding grows with the butterfly depth).
#include "kernels/hadamard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace qcal {
namespace {

uint64_t TestSeed() { return testing::ProcessSeed(); }

template <typename T>
std::vector<T> RandomVector(int64_t size, uint64_t salt) {
  std::mt19937_64 rng = testing::SeededRng(salt);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> v(size);
  for (auto& x : v) x = static_cast<T>(normal(rng));
  return v;
}

double Norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

bool AllZero(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return x == 0.0; });
}

// Dense matrix of a linear transform T on R^n: column j = T(e_j), via the column-axis API.
template <typename Fn>
std::vector<double> DenseOf(int64_t n, Fn apply_to_columns) {
  std::vector<double> m(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) m[i * n + i] = 1.0;
  apply_to_columns(m.data(), n);  // transforms every column of the row-major n×n matrix
  return m;
}

// max |M^T M - I| for a row-major n×n matrix.
double OrthogonalityError(const std::vector<double>& m, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += m[k * n + i] * m[k * n + j];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

std::vector<int64_t> SmallHadamardSizes() {
  std::vector<int64_t> sizes;
  for (int64_t n = 1; n <= 256; n *= 2) sizes.push_back(n);
  for (int m : HadamardFactorOrders()) {
    sizes.push_back(m);
    sizes.push_back(2 * m);
    if (4 * m <= 256) sizes.push_back(4 * m);
  }
  return sizes;
}

// ---------------------------------------------------------------------------------------------
// The ±1 matrices
// ---------------------------------------------------------------------------------------------

TEST(HadamardMatrixTest, EveryOrderSatisfiesHHtEqualsMI) {
  std::vector<int> orders = HadamardFactorOrders();
  for (int n = 1; n <= 256; n *= 2) orders.push_back(n);
  for (int order : orders) {
    SCOPED_TRACE("order " + std::to_string(order));
    auto h = GetHadamardMatrix(order);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_EQ(h->order, order);
    ASSERT_EQ(h->entries.size(), static_cast<size_t>(order) * order);
    for (int8_t v : h->entries) ASSERT_TRUE(v == 1 || v == -1);
    for (int i = 0; i < order; ++i) {
      for (int j = 0; j < order; ++j) {
        int64_t dot = 0, dot_t = 0;
        for (int k = 0; k < order; ++k) {
          dot += h->entries[i * order + k] * h->entries[j * order + k];    // H·H^T
          dot_t += h->entries[k * order + i] * h->entries[k * order + j];  // H^T·H
        }
        ASSERT_EQ(dot, i == j ? order : 0) << "H·H^T at (" << i << ", " << j << ")";
        ASSERT_EQ(dot_t, i == j ? order : 0) << "H^T·H at (" << i << ", " << j << ")";
      }
    }
    std::cout << "  H_" << order << ": " << h->construction << "\n";
  }
}

TEST(HadamardMatrixTest, ExpectedConstructions) {
  EXPECT_EQ(GetHadamardMatrix(12)->construction, "paley1 q=11");
  EXPECT_EQ(GetHadamardMatrix(28)->construction, "paley2 q=13");
  EXPECT_EQ(GetHadamardMatrix(52)->construction, "paley2 q=25 (GF(5^2))");
  EXPECT_EQ(GetHadamardMatrix(156)->construction, "williamson t=39");
  EXPECT_EQ(GetHadamardMatrix(172)->construction, "williamson t=43");
  EXPECT_EQ(GetHadamardMatrix(64)->construction, "sylvester");
}

TEST(HadamardMatrixTest, UnsupportedOrders) {
  for (int order : {0, 3, 6, 14, 44, 148, 8192}) {
    EXPECT_EQ(GetHadamardMatrix(order).status().code(), absl::StatusCode::kInvalidArgument)
        << order;
  }
}

// ---------------------------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------------------------

TEST(PlanHadamardTest, KnownDimensions) {
  struct Case {
    int64_t n;
    HadamardKind kind;
    int64_t pow2, m;
  };
  const Case cases[] = {
      {1, HadamardKind::kPow2, 1, 1},
      {2, HadamardKind::kPow2, 2, 1},
      {4096, HadamardKind::kPow2, 4096, 1},
      {11008, HadamardKind::kPow2TimesM, 64, 172},   // Llama-2-7B intermediate
      {14336, HadamardKind::kPow2TimesM, 512, 28},   // Llama-3-8B intermediate
      {28672, HadamardKind::kPow2TimesM, 1024, 28},  // Llama-2-70B intermediate
      {172, HadamardKind::kPow2TimesM, 1, 172},
      {5120, HadamardKind::kPow2TimesM, 256, 20},    // 5120 = 128·40 = 256·20: largest 2^k
      {13824, HadamardKind::kPow2TimesM, 128, 108},  // Llama-2-13B intermediate
      {20480, HadamardKind::kPow2TimesM, 1024, 20},
      {6656, HadamardKind::kPow2TimesM, 128, 52},    // Llama-1-30B hidden
      {17920, HadamardKind::kPow2TimesM, 128, 140},  // Llama-1-30B intermediate
      {19968, HadamardKind::kPow2TimesM, 128, 156},
      {202, HadamardKind::kRfft, 1, 1},    // 2·101
      {18944, HadamardKind::kRfft, 1, 1},  // 148·128 (Qwen2.5-7B): 148 not stored
      {7, HadamardKind::kNone, 1, 1},
      {0, HadamardKind::kNone, 1, 1},
  };
  for (const Case& c : cases) {
    const HadamardPlan plan = PlanHadamard(c.n);
    EXPECT_EQ(plan.kind, c.kind) << c.n << ": " << DescribeHadamardPlan(plan);
    EXPECT_EQ(plan.pow2, c.pow2) << c.n;
    EXPECT_EQ(plan.m, c.m) << c.n;
    EXPECT_EQ(plan.n, c.n);
  }
  EXPECT_EQ(DescribeHadamardPlan(PlanHadamard(11008)), "11008 = 64 x 172");
  EXPECT_STREQ(HadamardKindName(PlanHadamard(202).kind), "rfft");
}

// ---------------------------------------------------------------------------------------------
// Hadamard transforms
// ---------------------------------------------------------------------------------------------

TEST(FwhtTest, MatchesDenseSylvesterProduct) {
  QCAL_SEED_TRACE();
  for (int64_t n = 1; n <= 1024; n *= 2) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const int64_t batch = 3;
    auto h = GetHadamardMatrix(static_cast<int>(n));
    ASSERT_TRUE(h.ok());
    const std::vector<double> x = RandomVector<double>(n * batch, n);
    ASSERT_FALSE(AllZero(x));
    std::vector<double> expected(n * batch, 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(n));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < n; ++i) {
        double acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += h->entries[i * n + j] * x[b * n + j];
        expected[b * n + i] = acc * scale;
      }
    std::vector<double> y = x;
    ASSERT_TRUE(FwhtInPlace(y.data(), n, batch).ok());
    ASSERT_FALSE(AllZero(y));
    EXPECT_LE(MaxAbsDiff(y, expected), 1e-12 * std::max(1.0, Norm(x)));

    // fp32 against the fp64 reference.
    std::vector<float> yf(x.begin(), x.end());
    ASSERT_TRUE(FwhtInPlace(yf.data(), n, batch).ok());
    const double tol = 1e-5 * std::sqrt(std::max(1.0, std::log2(static_cast<double>(n))));
    for (int64_t i = 0; i < n * batch; ++i) ASSERT_NEAR(yf[i], expected[i], tol) << i;
  }
}

TEST(FwhtTest, RejectsNonPowerOfTwo) {
  std::vector<double> x(12, 1.0);
  EXPECT_EQ(FwhtInPlace(x.data(), 12, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FwhtInPlace(x.data(), 0, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FwhtInPlace(static_cast<double*>(nullptr), 4, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(FwhtInPlace(static_cast<double*>(nullptr), 4, 0).ok());
  for (double v : x) EXPECT_EQ(v, 1.0);  // untouched on error
}

// H_n for every small size: orthogonal, the transpose flag is the transpose, and the layout is
// exactly H_{2^k} ⊗ H_m (entry (a·m + b, a'·m + b') = H_{2^k}[a][a']·H_m[b][b'] / sqrt(n)).
TEST(HadamardTransformTest, SmallSizesAreOrthogonalKroneckerProducts) {
  for (int64_t n : SmallHadamardSizes()) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const HadamardPlan plan = PlanHadamard(n);
    ASSERT_TRUE(plan.IsHadamard());
    const auto t = DenseOf(n, [](double* a, int64_t n) {
      ASSERT_TRUE(HadamardTransformMatrix(a, n, n, MatrixAxis::kColumns).ok());
    });
    const auto t_transpose = DenseOf(n, [](double* a, int64_t n) {
      ASSERT_TRUE(HadamardTransformMatrix(a, n, n, MatrixAxis::kColumns, true).ok());
    });
    EXPECT_LE(OrthogonalityError(t, n), 1e-12);
    auto hp = GetHadamardMatrix(static_cast<int>(plan.pow2));
    auto hm = GetHadamardMatrix(static_cast<int>(plan.m));
    ASSERT_TRUE(hp.ok() && hm.ok());
    const int64_t m = plan.m;
    const double scale = 1.0 / std::sqrt(static_cast<double>(n));
    double worst = 0, worst_t = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const double expected =
            hp->entries[(i / m) * plan.pow2 + (j / m)] * hm->entries[(i % m) * m + (j % m)] * scale;
        worst = std::max(worst, std::abs(t[i * n + j] - expected));
        worst_t = std::max(worst_t, std::abs(t_transpose[j * n + i] - expected));
      }
    }
    EXPECT_LE(worst, 1e-12);
    EXPECT_LE(worst_t, 1e-12);
  }
}

// Large LLM dimensions: norm preservation and inverse∘forward = identity.
TEST(HadamardTransformTest, LargeSizesPreserveNormAndInvert) {
  QCAL_SEED_TRACE();
  for (int64_t n : {4096, 11008, 14336, 28672, 13824, 6656, 17920, 19968}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const int64_t batch = 2;
    const std::vector<double> x = RandomVector<double>(n * batch, n);
    std::vector<double> y = x;
    ASSERT_TRUE(HadamardTransform(y.data(), n, batch).ok());
    ASSERT_FALSE(AllZero(y));
    for (int64_t b = 0; b < batch; ++b) {
      const std::vector<double> xb(x.begin() + b * n, x.begin() + (b + 1) * n);
      const std::vector<double> yb(y.begin() + b * n, y.begin() + (b + 1) * n);
      EXPECT_NEAR(Norm(yb), Norm(xb), 1e-12 * Norm(xb));
    }
    ASSERT_TRUE(HadamardTransform(y.data(), n, batch, /*transpose=*/true).ok());
    EXPECT_LE(MaxAbsDiff(y, x), 1e-12);
  }
}

TEST(HadamardTransformTest, FloatMatchesDouble) {
  QCAL_SEED_TRACE();
  for (int64_t n : {12, 172, 4096, 11008, 28672}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<double> x = RandomVector<double>(n, n + 1);
    std::vector<double> y = x;
    std::vector<float> yf(x.begin(), x.end());
    ASSERT_TRUE(HadamardTransform(y.data(), n, 1).ok());
    ASSERT_TRUE(HadamardTransform(yf.data(), n, 1).ok());
    const double tol = 1e-5 * std::sqrt(std::log2(static_cast<double>(n)));
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(yf[i], y[i], tol) << i;
  }
}

TEST(HadamardTransformTest, RejectsUnsupportedSizes) {
  std::vector<double> x(202, 1.0);
  for (int64_t n : {3, 7, 202, 148}) {
    EXPECT_EQ(HadamardTransform(x.data(), n, 1).code(), absl::StatusCode::kInvalidArgument) << n;
  }
  for (double v : x) EXPECT_EQ(v, 1.0);
}

// Row-axis and column-axis matrix transforms agree with the vector API.
TEST(HadamardTransformTest, MatrixAxesMatchVectorApi) {
  QCAL_SEED_TRACE();
  const int64_t rows = 40, cols = 24;  // 40 = 2·20, 24 = 2·12
  const std::vector<double> a = RandomVector<double>(rows * cols, 7);
  for (bool transpose : {false, true}) {
    // Rows.
    std::vector<double> by_rows = a, expected = a;
    ASSERT_TRUE(
        HadamardTransformMatrix(by_rows.data(), rows, cols, MatrixAxis::kRows, transpose).ok());
    ASSERT_TRUE(HadamardTransform(expected.data(), cols, rows, transpose).ok());
    EXPECT_LE(MaxAbsDiff(by_rows, expected), 1e-13);
    // Columns: transpose, transform rows, transpose back.
    std::vector<double> at(rows * cols);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) at[j * rows + i] = a[i * cols + j];
    ASSERT_TRUE(HadamardTransform(at.data(), rows, cols, transpose).ok());
    std::vector<double> by_cols = a;
    ASSERT_TRUE(
        HadamardTransformMatrix(by_cols.data(), rows, cols, MatrixAxis::kColumns, transpose).ok());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        ASSERT_NEAR(by_cols[i * cols + j], at[j * rows + i], 1e-13);
  }
}

// ---------------------------------------------------------------------------------------------
// Randomized Hadamard transform
// ---------------------------------------------------------------------------------------------

TEST(RandomSignsTest, DocumentedMapping) {
  // std::mt19937_64 with its default seed 5489 starts with 14514284786278117030.
  const uint64_t first_word = 14514284786278117030ULL;
  const std::vector<int8_t> s = RandomSigns(70, 5489);
  ASSERT_EQ(s.size(), 70u);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(s[i], ((first_word >> i) & 1) ? -1 : 1) << i;
  const std::vector<int8_t> prefix = RandomSigns(10, 5489);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), s.begin()));
  EXPECT_NE(RandomSigns(256, 1), RandomSigns(256, 2));
}

TEST(RandomizedHadamardTest, ForwardIsHTimesSignsAndInverts) {
  QCAL_SEED_TRACE();
  for (int64_t n : {16, 60, 172, 11008, 28672}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const int64_t batch = 3;
    const std::vector<int8_t> signs = RandomSigns(n, TestSeed());
    const std::vector<double> x = RandomVector<double>(n * batch, n + 2);
    // Reference: flip signs by hand, then the plain transform.
    std::vector<double> expected = x;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < n; ++i) expected[b * n + i] *= signs[i];
    ASSERT_TRUE(HadamardTransform(expected.data(), n, batch).ok());
    std::vector<double> y = x;
    ASSERT_TRUE(
        RandomizedHadamardTransform(y.data(), n, batch, signs.data(), TransformDirection::kForward)
            .ok());
    EXPECT_LE(MaxAbsDiff(y, expected), 1e-13);
    ASSERT_TRUE(
        RandomizedHadamardTransform(y.data(), n, batch, signs.data(), TransformDirection::kInverse)
            .ok());
    EXPECT_LE(MaxAbsDiff(y, x), 1e-12);
  }
}

TEST(RandomizedHadamardTest, SmallSizesAreOrthogonal) {
  for (int64_t n : SmallHadamardSizes()) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<int8_t> signs = RandomSigns(n, 42 + n);
    const auto t = DenseOf(n, [&](double* a, int64_t n) {
      ASSERT_TRUE(RandomizedHadamardTransformMatrix(a, n, n, MatrixAxis::kColumns, signs.data(),
                                                    TransformDirection::kForward)
                      .ok());
    });
    EXPECT_LE(OrthogonalityError(t, n), 1e-12);
  }
}

// QuIP# IP-RHT on a weight matrix equals U·diag(S_U)·W·diag(S_V)·V^T with dense U, V.
TEST(RandomizedHadamardTest, IncoherenceProcessingMatchesDenseProduct) {
  QCAL_SEED_TRACE();
  const int64_t m = 24, n = 40;
  const std::vector<double> w = RandomVector<double>(m * n, 99);
  const std::vector<int8_t> s_u = RandomSigns(m, TestSeed() + 1);
  const std::vector<int8_t> s_v = RandomSigns(n, TestSeed() + 2);
  std::vector<double> fast = w;
  ASSERT_TRUE(RandomizedHadamardTransformMatrix(fast.data(), m, n, MatrixAxis::kRows, s_v.data(),
                                                TransformDirection::kForward)
                  .ok());
  ASSERT_TRUE(RandomizedHadamardTransformMatrix(fast.data(), m, n, MatrixAxis::kColumns, s_u.data(),
                                                TransformDirection::kForward)
                  .ok());
  const auto u = DenseOf(m, [](double* a, int64_t k) {
    ASSERT_TRUE(HadamardTransformMatrix(a, k, k, MatrixAxis::kColumns).ok());
  });
  const auto v = DenseOf(n, [](double* a, int64_t k) {
    ASSERT_TRUE(HadamardTransformMatrix(a, k, k, MatrixAxis::kColumns).ok());
  });
  // dense = U · diag(S_U) · W · diag(S_V) · V^T
  std::vector<double> left(m * n, 0.0), dense(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += w[i * n + k] * s_v[k] * v[j * n + k];
      left[i * n + j] = acc;
    }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < m; ++k) acc += u[i * m + k] * s_u[k] * left[k * n + j];
      dense[i * n + j] = acc;
    }
  EXPECT_LE(MaxAbsDiff(fast, dense), 1e-12);
  EXPECT_NEAR(Norm(fast), Norm(w), 1e-12 * Norm(w));
}

TEST(RandomizedHadamardTest, SameSeedIsBitIdentical) {
  QCAL_SEED_TRACE();
  for (int64_t n : {4096, 11008}) {
    const std::vector<float> x = RandomVector<float>(n * 2, 5);
    std::vector<float> a = x, b = x;
    const auto sa = RandomSigns(n, 1234), sb = RandomSigns(n, 1234);
    ASSERT_TRUE(
        RandomizedHadamardTransform(a.data(), n, 2, sa.data(), TransformDirection::kForward).ok());
    ASSERT_TRUE(
        RandomizedHadamardTransform(b.data(), n, 2, sb.data(), TransformDirection::kForward).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    std::vector<float> c = x;
    const auto sc = RandomSigns(n, 1235);
    ASSERT_TRUE(
        RandomizedHadamardTransform(c.data(), n, 2, sc.data(), TransformDirection::kForward).ok());
    EXPECT_NE(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Randomized FFT
// ---------------------------------------------------------------------------------------------

// With unit phases the forward RFFT is the unitary DFT: compare with a direct O(N²) sum.
TEST(RandomizedFftTest, MatchesDirectDft) {
  QCAL_SEED_TRACE();
  // Half-lengths: radix 4/2/3/5 paths, generic radix 43 (11008 / 2 = 2^7·43), primes above the
  // direct-radix limit (101, 4099: Bluestein), and 1.
  for (int64_t half : {1, 2, 3, 5, 6, 12, 43, 64, 101, 5504, 4099}) {
    SCOPED_TRACE("N=" + std::to_string(half));
    const int64_t n = 2 * half;
    const std::vector<double> x = RandomVector<double>(n, half);
    const std::vector<std::complex<double>> ones(half, std::complex<double>(1.0, 0.0));
    std::vector<double> y = x;
    ASSERT_TRUE(
        RandomizedFftTransform(y.data(), n, 1, ones.data(), TransformDirection::kForward).ok());
    const double scale = 1.0 / std::sqrt(static_cast<double>(half));
    const double pi = 3.14159265358979323846;
    double worst = 0;
    for (int64_t k = 0; k < half; ++k) {
      std::complex<double> acc(0, 0);
      for (int64_t t = 0; t < half; ++t) {
        const int64_t e = (k * t) % half;
        const double angle = -2.0 * pi * static_cast<double>(e) / static_cast<double>(half);
        acc += std::complex<double>(x[2 * t], x[2 * t + 1]) *
               std::complex<double>(std::cos(angle), std::sin(angle));
      }
      acc *= scale;
      worst = std::max(worst, std::abs(acc - std::complex<double>(y[2 * k], y[2 * k + 1])));
    }
    EXPECT_LE(worst, 1e-12 * std::max(1.0, Norm(x))) << "N=" << half;
  }
}

TEST(RandomizedFftTest, SmallSizesAreOrthogonal) {
  for (int64_t n : {2, 4, 6, 10, 14, 24, 86, 202, 256}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const auto phases = RandomPhases(n / 2, 7 + n);
    const auto t = DenseOf(n, [&](double* a, int64_t n) {
      ASSERT_TRUE(RandomizedFftTransformMatrix(a, n, n, MatrixAxis::kColumns, phases.data(),
                                               TransformDirection::kForward)
                      .ok());
    });
    EXPECT_LE(OrthogonalityError(t, n), 1e-12);
    const auto t_inv = DenseOf(n, [&](double* a, int64_t n) {
      ASSERT_TRUE(RandomizedFftTransformMatrix(a, n, n, MatrixAxis::kColumns, phases.data(),
                                               TransformDirection::kInverse)
                      .ok());
    });
    // The inverse is the transpose.
    double worst = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        worst = std::max(worst, std::abs(t_inv[i * n + j] - t[j * n + i]));
    EXPECT_LE(worst, 1e-12);
  }
}

TEST(RandomizedFftTest, LargeSizesPreserveNormAndInvert) {
  QCAL_SEED_TRACE();
  // 11008 (N = 2^7·43, Stockham), 18944 (N = 2^8·37), 202 and 8198 (N prime: Bluestein).
  for (int64_t n : {202, 8198, 11008, 18944}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const int64_t batch = 2;
    const auto phases = RandomPhases(n / 2, TestSeed());
    const std::vector<double> x = RandomVector<double>(n * batch, n);
    std::vector<double> y = x;
    ASSERT_TRUE(
        RandomizedFftTransform(y.data(), n, batch, phases.data(), TransformDirection::kForward)
            .ok());
    ASSERT_FALSE(AllZero(y));
    for (int64_t b = 0; b < batch; ++b) {
      const std::vector<double> xb(x.begin() + b * n, x.begin() + (b + 1) * n);
      const std::vector<double> yb(y.begin() + b * n, y.begin() + (b + 1) * n);
      EXPECT_NEAR(Norm(yb), Norm(xb), 1e-12 * Norm(xb));
    }
    ASSERT_TRUE(
        RandomizedFftTransform(y.data(), n, batch, phases.data(), TransformDirection::kInverse)
            .ok());
    EXPECT_LE(MaxAbsDiff(y, x), 1e-12);
  }
}

TEST(RandomizedFftTest, MatrixAxesMatchVectorApi) {
  QCAL_SEED_TRACE();
  const int64_t rows = 22, cols = 10;
  const std::vector<double> a = RandomVector<double>(rows * cols, 11);
  const auto row_phases = RandomPhases(cols / 2, 3), col_phases = RandomPhases(rows / 2, 4);
  std::vector<double> by_rows = a, expected = a;
  ASSERT_TRUE(RandomizedFftTransformMatrix(by_rows.data(), rows, cols, MatrixAxis::kRows,
                                           row_phases.data(), TransformDirection::kForward)
                  .ok());
  ASSERT_TRUE(RandomizedFftTransform(expected.data(), cols, rows, row_phases.data(),
                                     TransformDirection::kForward)
                  .ok());
  EXPECT_LE(MaxAbsDiff(by_rows, expected), 1e-13);
  std::vector<double> at(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) at[j * rows + i] = a[i * cols + j];
  ASSERT_TRUE(
      RandomizedFftTransform(at.data(), rows, cols, col_phases.data(), TransformDirection::kForward)
          .ok());
  std::vector<double> by_cols = a;
  ASSERT_TRUE(RandomizedFftTransformMatrix(by_cols.data(), rows, cols, MatrixAxis::kColumns,
                                           col_phases.data(), TransformDirection::kForward)
                  .ok());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) ASSERT_NEAR(by_cols[i * cols + j], at[j * rows + i], 1e-13);
}

TEST(RandomizedFftTest, PhasesAreUnitAndSeeded) {
  const auto p = RandomPhases(1000, 77), q = RandomPhases(1000, 77), r = RandomPhases(1000, 78);
  for (const auto& z : p) EXPECT_NEAR(std::abs(z), 1.0, 1e-15);
  EXPECT_EQ(p, q);
  EXPECT_NE(p, r);
}

TEST(RandomizedFftTest, SameSeedIsBitIdenticalAndFloatMatchesDouble) {
  QCAL_SEED_TRACE();
  const int64_t n = 11008;
  const std::vector<double> x = RandomVector<double>(n, 12);
  const auto phases = RandomPhases(n / 2, 555);
  std::vector<float> a(x.begin(), x.end()), b(x.begin(), x.end());
  ASSERT_TRUE(
      RandomizedFftTransform(a.data(), n, 1, phases.data(), TransformDirection::kForward).ok());
  const auto phases2 = RandomPhases(n / 2, 555);
  ASSERT_TRUE(
      RandomizedFftTransform(b.data(), n, 1, phases2.data(), TransformDirection::kForward).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  std::vector<double> y = x;
  ASSERT_TRUE(
      RandomizedFftTransform(y.data(), n, 1, phases.data(), TransformDirection::kForward).ok());
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(a[i], y[i], 1e-5) << i;  // only fp32 I/O rounding
}

TEST(RandomizedFftTest, RejectsOddSizes) {
  std::vector<double> x(7, 1.0);
  const auto phases = RandomPhases(4, 1);
  EXPECT_EQ(
      RandomizedFftTransform(x.data(), 7, 1, phases.data(), TransformDirection::kForward).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RandomizedFftTransform(x.data(), 6, 1, nullptr, TransformDirection::kForward).code(),
            absl::StatusCode::kInvalidArgument);
  for (double v : x) EXPECT_EQ(v, 1.0);
}

// ---------------------------------------------------------------------------------------------
// Dispatcher
// ---------------------------------------------------------------------------------------------

TEST(RandomizedOrthogonalTransformTest, DispatchesByPlanAndInverts) {
  QCAL_SEED_TRACE();
  // 64 (pow2), 172·2 (pow2·m), 202 (RFFT) along rows and columns.
  for (int64_t n : {64, 344, 202}) {
    for (MatrixAxis axis : {MatrixAxis::kRows, MatrixAxis::kColumns}) {
      SCOPED_TRACE("n=" + std::to_string(n) + (axis == MatrixAxis::kRows ? " rows" : " cols"));
      const int64_t other = 6;
      const int64_t rows = axis == MatrixAxis::kRows ? other : n;
      const int64_t cols = axis == MatrixAxis::kRows ? n : other;
      const std::vector<double> a = RandomVector<double>(rows * cols, n + 50);
      std::vector<double> y = a, y2 = a;
      ASSERT_TRUE(RandomizedOrthogonalTransformMatrix(y.data(), rows, cols, axis, 321,
                                                      TransformDirection::kForward)
                      .ok());
      ASSERT_TRUE(RandomizedOrthogonalTransformMatrix(y2.data(), rows, cols, axis, 321,
                                                      TransformDirection::kForward)
                      .ok());
      EXPECT_EQ(std::memcmp(y.data(), y2.data(), y.size() * sizeof(double)), 0);
      EXPECT_NEAR(Norm(y), Norm(a), 1e-12 * Norm(a));
      ASSERT_TRUE(RandomizedOrthogonalTransformMatrix(y.data(), rows, cols, axis, 321,
                                                      TransformDirection::kInverse)
                      .ok());
      EXPECT_LE(MaxAbsDiff(y, a), 1e-12);
    }
  }
  std::vector<double> odd(7 * 3, 1.0);
  EXPECT_EQ(RandomizedOrthogonalTransformMatrix(odd.data(), 3, 7, MatrixAxis::kRows, 1,
                                                TransformDirection::kForward)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace qcal
