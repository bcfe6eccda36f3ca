// Tests for the E8P / E8 / RVQ / half-integer codebooks (kernels/codebook.h, e8p.h,
// e8_codebooks.h). Tolerances: everything here is exact (codebook points are multiples of 1/4;
// encoders are compared code for code against brute force), except the MSE ordering.
#include "kernels/codebook.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/e8_codebooks.h"
#include "kernels/e8p.h"
#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

using Row = std::array<int8_t, 8>;

std::unique_ptr<VectorCodebook> Make(const std::string& name) {
  auto cb = MakeCodebook(name);
  EXPECT_TRUE(cb.ok()) << cb.status();
  return cb.ok() ? std::move(cb).value() : nullptr;
}

double Dist2(const float* x, const float* p, int d) {
  double s = 0;
  for (int j = 0; j < d; ++j) {
    const double t = static_cast<double>(x[j]) - p[j];
    s += t * t;
  }
  return s;
}

std::vector<float> Gaussian(std::mt19937_64& rng, int64_t n, double scale) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& e : v) e = static_cast<float>(scale * normal(rng));
  return v;
}

// ---------------------------------------------------------------------------------------------
// The source table S
// ---------------------------------------------------------------------------------------------

TEST(E8pSourceTest, BallRowsAreAllOfAbsD8HatWithNormAtMost10InLexOrder) {
  // Independent enumeration: every x ∈ D̂8 with ||x||^2 <= 10 (as 2x: odd entries in [-7, 7],
  // sum(2x) ≡ 0 mod 4), then the distinct |x| sorted (std::set sorts lexicographically).
  std::set<Row> abs_rows;
  int64_t signed_points = 0;
  for (int i = 0; i < (1 << 24); ++i) {
    Row t{};
    int sum = 0;
    int norm2 = 0;
    for (int j = 0; j < 8; ++j) {
      const int v = 2 * ((i >> (3 * j)) & 7) - 7;  // -7, -5, ..., 7
      t[j] = static_cast<int8_t>(v);
      sum += v;
      norm2 += v * v;
    }
    if (norm2 > 40 || ((sum / 2) % 2 + 2) % 2 != 0) continue;
    ++signed_points;
    for (auto& v : t) v = static_cast<int8_t>(std::abs(v));
    abs_rows.insert(t);
  }
  // |D̂8 ∩ ball(sqrt 10)|: 2^7 sign patterns per absolute vector.
  EXPECT_EQ(signed_points, 227 * 128);
  ASSERT_EQ(abs_rows.size(), 227u);
  const E8pSourceTable& s = E8pSource();
  int k = 0;
  for (const Row& row : abs_rows) {
    EXPECT_EQ(s[k], row) << "row " << k;
    ++k;
  }
  // The first rows, worked out by hand: all 1/2, then (…,3/2), (…,5/2), (…,3/2,1/2).
  EXPECT_EQ(s[0], (Row{1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(s[1], (Row{1, 1, 1, 1, 1, 1, 1, 3}));
  EXPECT_EQ(s[2], (Row{1, 1, 1, 1, 1, 1, 1, 5}));
  EXPECT_EQ(s[3], (Row{1, 1, 1, 1, 1, 1, 3, 1}));
  EXPECT_EQ(s[21], (Row{1, 1, 1, 1, 3, 1, 3, 3}));
}

TEST(E8pSourceTest, Has256DistinctRowsWith29PaddingRowsOfNorm12) {
  const E8pSourceTable& s = E8pSource();
  std::set<Row> all(s.begin(), s.end());
  EXPECT_EQ(all.size(), 256u);
  int ball = 0;
  int norm12 = 0;
  for (int k = 0; k < kE8pSourceRows; ++k) {
    int norm2 = 0;
    for (int j = 0; j < 8; ++j) {
      EXPECT_TRUE(s[k][j] == 1 || s[k][j] == 3 || s[k][j] == 5) << k;
      norm2 += s[k][j] * s[k][j];
    }
    if (k < kE8pBallRows) {
      EXPECT_LE(norm2, 40) << k;
      ++ball;
    } else {
      EXPECT_EQ(norm2, 48) << k;  // ||x||^2 = 12
      EXPECT_EQ(s[k], E8pPaddingRows()[k - kE8pBallRows]) << k;
      ++norm12;
    }
  }
  EXPECT_EQ(ball, 227);
  EXPECT_EQ(norm12, 29);
  // Spot-check the padding rows against ../shared/reference/e8p-codebook.md (first and last).
  EXPECT_EQ(s[227], (Row{3, 1, 1, 1, 3, 3, 3, 3}));
  EXPECT_EQ(s[255], (Row{3, 3, 1, 1, 3, 3, 3, 1}));
}

// ---------------------------------------------------------------------------------------------
// Code layout and decoding
// ---------------------------------------------------------------------------------------------

TEST(E8pDecodeTest, AppendixC2WorkedExample) {
  // "Let the codeword be 0001010110010111": S entry 21 (hypothetically s below), signs 1001011,
  // shift bit 1.
  const E8pCode code{0b0001010110010111};
  EXPECT_EQ(code.source_index(), 21u);
  EXPECT_EQ(code.sign_bits7(), 0b1001011u);
  EXPECT_TRUE(code.plus_quarter());
  const Row s = {1, 1, 1, 3, 1, 1, 1, 1};  // (1/2, 1/2, 1/2, 3/2, 1/2, 1/2, 1/2, 1/2), sum 5
  float out[8];
  DecodeE8pWithSource(code, s, out);
  // Sign-decoded vector per the paper: (-1/2, -1/2, 1/2, 3/2, -1/2, 1/2, -1/2, -1/2), in D̂8;
  // plus 1/4. (The paper prints -3/4 for the second coordinate, a typo for -1/2 + 1/4.)
  const float want[8] = {-0.25f, -0.25f, 0.75f, 1.75f, -0.25f, 0.75f, -0.25f, -0.25f};
  for (int j = 0; j < 8; ++j) EXPECT_EQ(out[j], want[j]) << j;
  float signed_sum = 0;
  for (int j = 0; j < 8; ++j) signed_sum += out[j] - 0.25f;
  EXPECT_EQ(signed_sum, 0.0f);  // even

  // The same code against our actual S[21] = (1,1,1,1,3,1,3,3)/2 (sum 7, odd -> coordinate 0
  // negated too).
  E8pCodebook cb;
  uint32_t c = code.bits;
  cb.Decode(&c, 1, out);
  const float want21[8] = {-0.25f, -0.25f, 0.75f, 0.75f, -1.25f, 0.75f, -1.25f, -1.25f};
  for (int j = 0; j < 8; ++j) EXPECT_EQ(out[j], want21[j]) << j;
}

TEST(E8pDecodeTest, AllCodesDecodeToDistinctPointsOfShiftedE8) {
  E8pCodebook cb;
  const E8pSourceTable& s = E8pSource();
  std::vector<uint32_t> codes(kE8pNumCodes);
  for (int c = 0; c < kE8pNumCodes; ++c) codes[c] = static_cast<uint32_t>(c);
  std::vector<float> pts(8 * kE8pNumCodes);
  cb.Decode(codes.data(), kE8pNumCodes, pts.data());
  ASSERT_EQ(cb.expanded().size(), pts.size());
  EXPECT_EQ(std::memcmp(cb.expanded().data(), pts.data(), pts.size() * sizeof(float)), 0);

  std::set<std::array<int, 8>> seen;
  int64_t nonzero = 0;
  for (int c = 0; c < kE8pNumCodes; ++c) {
    const float* p = pts.data() + 8 * c;
    const E8pCode code{static_cast<uint16_t>(c)};
    const int shift4 = code.plus_quarter() ? 1 : -1;  // 4 × shift
    std::array<int, 8> key{};
    int d_sum2 = 0;  // sum of 2d, d = p - shift ∈ D̂8
    for (int j = 0; j < 8; ++j) {
      const float q = 4 * p[j];
      ASSERT_EQ(q, std::round(q)) << c;
      key[j] = static_cast<int>(q);
      const int d4 = key[j] - shift4;  // 4d: an even number 2·(odd)
      ASSERT_EQ(d4 % 2, 0) << c;
      const int d2 = d4 / 2;
      ASSERT_EQ(std::abs(d2) % 2, 1) << c;                      // d half-integer
      ASSERT_EQ(std::abs(d2), s[code.source_index()][j]) << c;  // |d| = S[k]
      // Sign: explicit for coordinates 1..7.
      if (j > 0) {
        ASSERT_EQ(d2 < 0, code.NegatesExplicit(j)) << c;
      }
      d_sum2 += d2;
      if (p[j] != 0) ++nonzero;
    }
    ASSERT_EQ(((d_sum2 / 2) % 2 + 2) % 2, 0) << "sum of d must be even, code " << c;
    // p - 1/4 ∈ E8: d (half-integers, even sum) when the shift is +1/4, d - 1/2 (integers, sum
    // = sum(d) - 4, even) when it is -1/4. Both follow from the checks above.
    seen.insert(key);
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kE8pNumCodes));
  EXPECT_GT(nonzero, 0);
}

// ---------------------------------------------------------------------------------------------
// The fast encoder against brute force
// ---------------------------------------------------------------------------------------------

// Compares the fast encoder with the brute-force scan on `x` (count vectors). Codes must match;
// a mismatch is tolerated only when both points are at the same distance to within rounding
// (a near-tie for inputs whose arithmetic is not exact), and such cases are counted.
void ExpectFastMatchesBruteForce(const E8pCodebook& cb, const std::vector<float>& x,
                                 int64_t* near_ties, const std::string& what) {
  const int64_t count = static_cast<int64_t>(x.size()) / 8;
  std::vector<float> out_fast(x.size());
  std::vector<float> out_brute(x.size());
  std::vector<uint32_t> code_fast(count);
  std::vector<uint32_t> code_brute(count);
  cb.Quantize(x.data(), count, out_fast.data(), code_fast.data());
  cb.QuantizeBruteForce(x.data(), count, out_brute.data(), code_brute.data());
  int64_t failures = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (code_fast[i] == code_brute[i]) {
      continue;
    }
    const double df = Dist2(&x[8 * i], &out_fast[8 * i], 8);
    const double db = Dist2(&x[8 * i], &out_brute[8 * i], 8);
    if (std::fabs(df - db) <= 1e-12 * (1 + db)) {
      ++*near_ties;
      continue;
    }
    if (++failures <= 5) {
      ADD_FAILURE() << what << ": vector " << i << " fast code " << code_fast[i] << " (d2 " << df
                    << ") vs brute force " << code_brute[i] << " (d2 " << db << ")";
    }
  }
  EXPECT_EQ(failures, 0) << what;
}

TEST(E8pEncodeTest, FastEncoderEqualsBruteForceOnGaussians) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  E8pCodebook cb;
  // 10^5 vectors over several scales, from well inside the ball to far outside it.
  const double scales[] = {0.1, 0.5, 1.0, 1.03, 1.5, 2.0, 4.0, 10.0, 100.0, 1e4};
  const int64_t per_scale = 10000;
  int64_t near_ties = 0;
  for (double scale : scales) {
    const std::vector<float> x = Gaussian(rng, 8 * per_scale, scale);
    ExpectFastMatchesBruteForce(cb, x, &near_ties, "scale " + std::to_string(scale));
  }
  std::printf("[ info     ] %lld vectors, %lld near-ties within rounding\n",
              static_cast<long long>(per_scale * std::size(scales)),
              static_cast<long long>(near_ties));
  EXPECT_LE(near_ties, 10);
}

TEST(E8pEncodeTest, FastEncoderEqualsBruteForceOnExactTies) {
  // Dyadic inputs make both encoders' arithmetic exact, so exact ties happen often (coordinates
  // at ±1/4 make y_j = 0; equal |y_j|·s_j; midpoints between codebook points) and the codes must
  // agree through the smallest-code tie rule, not merely the distances.
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  E8pCodebook cb;
  std::vector<float> x;
  // Coordinates on a 1/8 grid in [-3, 3].
  std::uniform_int_distribution<int> grid8(-24, 24);
  for (int i = 0; i < 8 * 4000; ++i) x.push_back(grid8(rng) / 8.0f);
  // Coordinates on a 1/4 grid in [-1, 1] (many y_j == 0).
  std::uniform_int_distribution<int> grid4(-4, 4);
  for (int i = 0; i < 8 * 4000; ++i) x.push_back(grid4(rng) / 4.0f);
  // Midpoints of random pairs of codebook points.
  const std::vector<float>& pts = cb.expanded();
  std::uniform_int_distribution<int> any_code(0, kE8pNumCodes - 1);
  for (int i = 0; i < 2000; ++i) {
    const int a = any_code(rng);
    const int b = any_code(rng);
    for (int j = 0; j < 8; ++j) x.push_back(0.5f * (pts[8 * a + j] + pts[8 * b + j]));
  }
  // The origin (two points at distance^2 1/2: all +1/4 and all -1/4).
  for (int j = 0; j < 8; ++j) x.push_back(0.0f);
  int64_t near_ties = 0;
  ExpectFastMatchesBruteForce(cb, x, &near_ties, "dyadic");
  EXPECT_EQ(near_ties, 0) << "dyadic inputs are exact: ties must resolve identically";

  const float zero[8] = {};
  float out[8];
  const E8pCode c0 = cb.EncodeOne(zero, out);
  EXPECT_EQ(Dist2(zero, out, 8), 0.5);
  // The two nearest points are S[0] = (1/2)^8 - 1/4 (code 0x0000) and -(1/2)^8 + 1/4 (code
  // 0x00FF: all seven explicit signs negated, +1/4); the smaller code wins.
  EXPECT_EQ(c0.bits, 0u);
}

// EncodeOne answers from the lattice decoder when the nearest point of D̂8 ± 1/4 is a codebook
// point by a clear margin and falls back to the exact scan otherwise; the codes must be those of
// the scan, bit for bit, on every kind of input (inside and far outside the ball, exact ties,
// huge and non-finite values).
TEST(E8pEncodeTest, LatticeFastPathGivesTheScansCodes) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  E8pCodebook cb;
  std::vector<float> x;
  for (double scale : {0.05, 0.3, 0.7, 1.0, 1.03, 1.3, 2.0, 5.0, 1e3, 1e7}) {
    const std::vector<float> g = Gaussian(rng, 8 * 20000, scale);
    x.insert(x.end(), g.begin(), g.end());
  }
  std::uniform_int_distribution<int> grid8(-24, 24), grid4(-4, 4);
  for (int i = 0; i < 8 * 20000; ++i) x.push_back(grid8(rng) / 8.0f);
  for (int i = 0; i < 8 * 20000; ++i) x.push_back(grid4(rng) / 4.0f);
  const std::vector<float>& pts = cb.expanded();
  std::uniform_int_distribution<int> any_code(0, kE8pNumCodes - 1);
  for (int i = 0; i < 20000; ++i) {  // codebook points, and points nudged off them
    const int a = any_code(rng);
    const float nudge = (i % 3 == 0) ? 0.0f : std::ldexp(1.0f, -(i % 30));
    for (int j = 0; j < 8; ++j) x.push_back(pts[8 * a + j] + (j == i % 8 ? nudge : 0.0f));
  }
  for (float special : {std::numeric_limits<float>::infinity(), std::nanf(""), 3e38f}) {
    for (int j = 0; j < 8; ++j) x.push_back(j == 3 ? special : 0.5f);
  }
  const int64_t count = static_cast<int64_t>(x.size()) / 8;
  std::vector<float> out_fast(x.size()), out_scan(x.size());
  std::vector<uint32_t> codes(count);
  cb.Quantize(x.data(), count, out_fast.data(), codes.data());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) {
    const E8pCode scan = cb.EncodeOneByScan(&x[8 * i], &out_scan[8 * i]);
    if (scan.bits != codes[i]) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "vector " << i << ": EncodeOne " << codes[i] << ", scan " << scan.bits;
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << count << " vectors";
  for (int64_t i = 0; i < count * 8; ++i) ASSERT_EQ(out_fast[i], out_scan[i]) << "at " << i;
}

TEST(E8pEncodeTest, EveryCodebookPointEncodesToItself) {
  E8pCodebook cb;
  const std::vector<float>& pts = cb.expanded();
  for (int c = 0; c < kE8pNumCodes; ++c) {
    float out[8];
    const E8pCode code = cb.EncodeOne(&pts[8 * c], out);
    ASSERT_EQ(code.bits, c);
    for (int j = 0; j < 8; ++j) ASSERT_EQ(out[j], pts[8 * c + j]);
  }
}

TEST(E8pEncodeTest, SameSeedSameCodes) {
  const uint64_t seed = qcal::testing::TestSeed();
  E8pCodebook cb;
  std::vector<uint32_t> codes[2];
  std::vector<float> outs[2];
  for (int run = 0; run < 2; ++run) {
    std::mt19937_64 rng(seed);
    const std::vector<float> x = Gaussian(rng, 8 * 4096, 1.0);
    codes[run].resize(4096);
    outs[run].resize(x.size());
    cb.Quantize(x.data(), 4096, outs[run].data(), codes[run].data());
  }
  EXPECT_EQ(codes[0], codes[1]);
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_TRUE(std::any_of(codes[0].begin(), codes[0].end(), [](uint32_t c) { return c != 0; }));
}

// ---------------------------------------------------------------------------------------------
// Every codebook: decode(encode(x)) == Quantize(x), aliasing, names
// ---------------------------------------------------------------------------------------------

class AllCodebooksTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AllCodebooksTest, DecodeOfCodesEqualsQuantizeOutput) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  auto cb = Make(GetParam());
  ASSERT_NE(cb, nullptr);
  EXPECT_EQ(cb->name(), GetParam());
  const int64_t count = 3000;  // not a multiple of the RVQ block
  const int d = cb->dim();
  std::vector<float> x = Gaussian(rng, count * d, cb->default_scale() * 1.5);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(count * cb->code_words());
  cb->Quantize(x.data(), count, out.data(), codes.data());
  std::vector<float> decoded(x.size());
  cb->Decode(codes.data(), count, decoded.data());
  EXPECT_EQ(std::memcmp(out.data(), decoded.data(), out.size() * sizeof(float)), 0);
  EXPECT_TRUE(std::any_of(out.begin(), out.end(), [](float v) { return v != 0; }));
  // Quantizing in place (out aliases x) gives the same result; codes are optional.
  std::vector<float> inplace = x;
  cb->Quantize(inplace.data(), count, inplace.data(), nullptr);
  EXPECT_EQ(inplace, out);
  // Quantization is idempotent for single-stage codebooks (a point is its own nearest point).
  if (cb->code_words() == 1) {
    std::vector<float> again(out.size());
    cb->Quantize(out.data(), count, again.data(), nullptr);
    EXPECT_EQ(again, out);
  }
}

INSTANTIATE_TEST_SUITE_P(Names, AllCodebooksTest,
                         ::testing::Values("e8p", "e8_1bit", "rvq3_e8p_e8", "rvq4_e8p_e8p",
                                           "halfint2", "halfint3", "halfint4"));

TEST(MakeCodebookTest, PropertiesAndUnknownName) {
  struct Want {
    const char* name;
    int dim;
    int words;
    double bits;
  };
  for (const Want& w :
       {Want{"e8p", 8, 1, 2}, Want{"e8_1bit", 8, 1, 1}, Want{"rvq3_e8p_e8", 8, 2, 3},
        Want{"rvq4_e8p_e8p", 8, 2, 4}, Want{"halfint2", 1, 1, 2}, Want{"halfint3", 1, 1, 3},
        Want{"halfint4", 1, 1, 4}}) {
    auto cb = Make(w.name);
    ASSERT_NE(cb, nullptr) << w.name;
    EXPECT_EQ(cb->dim(), w.dim) << w.name;
    EXPECT_EQ(cb->code_words(), w.words) << w.name;
    EXPECT_EQ(cb->bits_per_weight(), w.bits) << w.name;
    EXPECT_GT(cb->default_scale(), 0) << w.name;
  }
  auto bad = MakeCodebook("e8q");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeRvqCodebook("rvq3_e8p_e8", RvqScales{1.0, 0.0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeRvqCodebook("e8p", kRvq3Scales).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// E8 1-bit
// ---------------------------------------------------------------------------------------------

TEST(E8OneBitTest, Has256DistinctPointsOfE8WithNormAtMost4) {
  E8OneBitCodebook cb;
  std::set<std::array<float, 8>> seen;
  int origin = 0;
  int roots = 0;
  int norm4 = 0;
  for (int i = 0; i < 256; ++i) {
    const auto& p = cb.point(i);
    seen.insert(p);
    double norm2 = 0;
    double sum = 0;
    const bool integer = p[0] == std::round(p[0]);
    for (float v : p) {
      norm2 += v * v;
      sum += v;
      // All integer or all half-integer.
      EXPECT_EQ(v == std::round(v), integer) << i;
      if (!integer) {
        EXPECT_EQ(2 * v, std::round(2 * v)) << i;
      }
    }
    EXPECT_EQ(std::fmod(sum, 2.0), 0.0) << "E8 needs an even sum, point " << i;
    if (norm2 == 0) ++origin;
    if (norm2 == 2) ++roots;
    if (norm2 == 4) ++norm4;
  }
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(origin, 1);
  EXPECT_EQ(roots, 240);
  EXPECT_EQ(norm4, 15);
  std::array<float, 8> minus_2e7{};
  minus_2e7[7] = -2;
  EXPECT_EQ(seen.count(minus_2e7), 0u);
  for (int j = 0; j < 8; ++j) {
    std::array<float, 8> e{};
    e[j] = 2;
    EXPECT_EQ(seen.count(e), 1u) << j;
    e[j] = -2;
    if (j < 7) {
      EXPECT_EQ(seen.count(e), 1u) << j;
    }
  }
  // Reference order: integer points first (the first is (-1,-1,0,...,0)), half-integers from
  // index 113, then +2e_0.
  EXPECT_EQ(cb.point(0), (std::array<float, 8>{-1, -1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(cb.point(113)[0], -0.5f);
  EXPECT_EQ(cb.point(241), (std::array<float, 8>{2, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(E8OneBitTest, QuantizeIsNearestPoint) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  E8OneBitCodebook cb;
  const std::vector<float> x = Gaussian(rng, 8 * 2000, 1.0);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(2000);
  cb.Quantize(x.data(), 2000, out.data(), codes.data());
  for (int i = 0; i < 2000; ++i) {
    const double got = Dist2(&x[8 * i], &out[8 * i], 8);
    for (int c = 0; c < 256; ++c) {
      ASSERT_LE(got, Dist2(&x[8 * i], cb.point(c).data(), 8)) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RVQ
// ---------------------------------------------------------------------------------------------

TEST(RvqTest, QuantizeIsStage1PlusScaledStage2) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  E8pCodebook e8p;
  E8OneBitCodebook e8;
  for (const char* name : {"rvq3_e8p_e8", "rvq4_e8p_e8p"}) {
    auto cb = Make(name);
    ASSERT_NE(cb, nullptr);
    const double rs = std::string(name) == "rvq3_e8p_e8" ? 2.04 : 3.45;
    EXPECT_EQ(static_cast<const RvqCodebook&>(*cb).scales().residual_scale, rs);
    const VectorCodebook& stage2 =
        std::string(name) == "rvq3_e8p_e8" ? static_cast<const VectorCodebook&>(e8) : e8p;
    const int64_t n = 500;
    const std::vector<float> x = Gaussian(rng, 8 * n, 1.0);
    std::vector<float> out(x.size());
    std::vector<uint32_t> codes(2 * n);
    cb->Quantize(x.data(), n, out.data(), codes.data());
    for (int64_t i = 0; i < n; ++i) {
      float q1[8], r[8], q2[8];
      uint32_t c1, c2;
      e8p.Quantize(&x[8 * i], 1, q1, &c1);
      for (int j = 0; j < 8; ++j) r[j] = (x[8 * i + j] - q1[j]) * static_cast<float>(rs);
      stage2.Quantize(r, 1, q2, &c2);
      ASSERT_EQ(codes[2 * i], c1) << name << " " << i;
      ASSERT_EQ(codes[2 * i + 1], c2) << name << " " << i;
      for (int j = 0; j < 8; ++j) {
        ASSERT_EQ(out[8 * i + j], q1[j] + q2[j] / static_cast<float>(rs)) << name << " " << i;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Half-integer grid
// ---------------------------------------------------------------------------------------------

TEST(HalfIntegerGridTest, LevelsClampingAndTies) {
  HalfIntegerGridCodebook g2(2);
  const float x[] = {-9.0f, -1.2f, -0.9f, 0.0f, 0.3f, 1.0f, 1.4f, 2.0f, 7.0f};
  const float want[] = {-1.5f, -1.5f, -0.5f, -0.5f, 0.5f, 0.5f, 1.5f, 1.5f, 1.5f};
  const uint32_t want_codes[] = {0, 0, 1, 1, 2, 2, 3, 3, 3};
  float out[9];
  uint32_t codes[9];
  g2.Quantize(x, 9, out, codes);
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(out[i], want[i]) << x[i];
    EXPECT_EQ(codes[i], want_codes[i]) << x[i];
  }
  HalfIntegerGridCodebook g4(4);
  uint32_t all[16];
  float levels[16];
  for (int c = 0; c < 16; ++c) all[c] = c;
  g4.Decode(all, 16, levels);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(levels[c], c - 7.5f);
}

// ---------------------------------------------------------------------------------------------
// MSE on Gaussian input (QuIP# Figure 3 ordering)
// ---------------------------------------------------------------------------------------------

// Per-weight MSE of quantizing N(0,1) at the best of a few scales around the default.
double BestMse(const VectorCodebook& cb, const std::vector<float>& g) {
  const int64_t count = static_cast<int64_t>(g.size()) / cb.dim();
  std::vector<float> in(g.size());
  std::vector<float> out(g.size());
  double best = std::numeric_limits<double>::infinity();
  for (double f : {0.9, 0.95, 1.0, 1.05, 1.1}) {
    const double scale = cb.default_scale() * f;
    for (size_t t = 0; t < g.size(); ++t) in[t] = static_cast<float>(g[t] * scale);
    cb.Quantize(in.data(), count, out.data(), nullptr);
    double err = 0;
    for (size_t t = 0; t < g.size(); ++t) {
      const double e = out[t] / scale - g[t];
      err += e * e;
    }
    best = std::min(best, err / static_cast<double>(g.size()));
  }
  return best;
}

TEST(CodebookMseTest, E8BeatsHalfIntegerAndMoreBitsHelp) {
  const uint64_t seed = qcal::testing::TestSeed();
  std::mt19937_64 rng(seed);
  const std::vector<float> g = Gaussian(rng, 8 * 8192, 1.0);
  std::map<std::string, double> mse;
  for (const char* name :
       {"e8p", "halfint2", "rvq3_e8p_e8", "halfint3", "rvq4_e8p_e8p", "halfint4"}) {
    auto cb = Make(name);
    ASSERT_NE(cb, nullptr);
    mse[name] = BestMse(*cb, g);
    std::printf("[ info     ] %-14s MSE %.5f\n", name, mse[name]);
  }
  EXPECT_LT(mse["e8p"], mse["halfint2"]);
  EXPECT_LT(mse["rvq3_e8p_e8"], mse["e8p"]);
  EXPECT_LT(mse["rvq4_e8p_e8p"], mse["rvq3_e8p_e8"]);
  EXPECT_LT(mse["rvq3_e8p_e8"], mse["halfint3"]);
  EXPECT_LT(mse["rvq4_e8p_e8p"], mse["halfint4"]);
  // Sanity: the Gaussian-optimal 4-level uniform quantizer has MSE 0.1188.
  EXPECT_NEAR(mse["halfint2"], 0.1188, 0.01);
}

}  // namespace
}  // namespace qcal::kernels
