// Tests for kernels/linalg.h: Cholesky, LDL in both forms, the g-block LDL of QuIP# §4.1,
// GPTQ's inverse factor, damping, and the errors for matrices that are not positive definite.
//
// Tolerances: reconstructions ‖factors − H‖_F / ‖H‖_F <= 1e-10 (the brief's requirement; fp64
// with condition numbers <= 1e4 gives ~1e-14). Structural properties (unit diagonal, zero
// blocks) are exact. Damping is checked exactly.
#include "kernels/linalg.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
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

 private:
  std::mt19937_64 rng_;
};

// H = A Aᵀ / k + eps·I with A [n, k]: SPD with a spread spectrum.
std::vector<double> RandomSpd(int64_t n, Gaussian& g, double eps = 1e-3) {
  const int64_t k = n + 8;
  std::vector<double> a(n * k), h(n * n);
  for (auto& v : a) v = g();
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, k, 1.0 / k, a.data(), k, a.data(), k,
              0.0, h.data(), n);
  for (int64_t i = 0; i < n; ++i) h[i * n + i] += eps;
  for (int64_t i = 0; i < n; ++i) {  // Exactly symmetric.
    for (int64_t j = 0; j < i; ++j) h[j * n + i] = h[i * n + j];
  }
  return h;
}

TEST(LinalgTest, CholeskyReconstructs) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  for (int64_t n : {1, 2, 17, 64, 257}) {
    SCOPED_TRACE(n);
    const std::vector<double> h = RandomSpd(n, g);
    auto c = Cholesky(h.data(), n);
    ASSERT_TRUE(c.ok()) << c.status();
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_GT((*c)[i * n + i], 0.0);
      for (int64_t j = i + 1; j < n; ++j) ASSERT_EQ((*c)[i * n + j], 0.0);
    }
    const std::vector<double> back = MultiplyLLt(*c, n);
    EXPECT_LE(RelativeFrobeniusError(back.data(), h.data(), n), 1e-10);
    // In-place variant gives the same factor.
    std::vector<double> a = h;
    ASSERT_TRUE(CholeskyInPlace(a.data(), n).ok());
    EXPECT_EQ(a, *c);
  }
}

void ExpectUnitBlockLower(const BlockLdl& f) {
  const int64_t n = f.n, g = f.block;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double v = f.L[i * n + j];
      if (i / g == j / g) {
        ASSERT_EQ(v, i == j ? 1.0 : 0.0) << "diagonal block entry (" << i << ", " << j << ")";
      } else if (j / g > i / g) {
        ASSERT_EQ(v, 0.0) << "above the block diagonal (" << i << ", " << j << ")";
      }
    }
  }
}

void ExpectSpdBlocks(const BlockLdl& f) {
  const int64_t n = f.n, g = f.block;
  for (int64_t s = 0; s < n; s += g) {
    const int64_t w = std::min(g, n - s);
    std::vector<double> db(w * w);
    for (int64_t i = 0; i < w; ++i) {
      for (int64_t j = 0; j < w; ++j) {
        db[i * w + j] = f.D(s + i, s + j);
        if (j < i) {
          ASSERT_EQ(f.D(s + i, s + j), f.D(s + j, s + i));
        }
      }
    }
    ASSERT_TRUE(Cholesky(db.data(), w).ok()) << "D block at " << s << " not SPD";
  }
}

TEST(LinalgTest, LdlBothFormsReconstruct) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  for (int64_t n : {1, 5, 64, 200}) {
    const std::vector<double> h = RandomSpd(n, g);
    for (LdlForm form : {LdlForm::kLDLt, LdlForm::kLtDL}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " form " << static_cast<int>(form));
      auto f = LdlDecompose(h.data(), n, form);
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(f->block, 1);
      ExpectUnitBlockLower(*f);
      for (int64_t i = 0; i < n; ++i) EXPECT_GT(f->D(i, i), 0.0);
      const std::vector<double> back = ReconstructLdl(*f);
      EXPECT_LE(RelativeFrobeniusError(back.data(), h.data(), n), 1e-10);
    }
  }
}

TEST(LinalgTest, BlockLdlReconstructsIncludingRaggedLastBlock) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  struct Case {
    int64_t n, block;
  };
  for (const Case c : {Case{64, 8}, Case{64, 5}, Case{130, 16}, Case{96, 96}, Case{10, 32}}) {
    const std::vector<double> h = RandomSpd(c.n, g);
    for (LdlForm form : {LdlForm::kLDLt, LdlForm::kLtDL}) {
      SCOPED_TRACE(::testing::Message()
                   << "n " << c.n << " block " << c.block << " form " << static_cast<int>(form));
      auto f = BlockLdlDecompose(h.data(), c.n, c.block, form);
      ASSERT_TRUE(f.ok()) << f.status();
      ExpectUnitBlockLower(*f);
      ExpectSpdBlocks(*f);
      const std::vector<double> back = ReconstructLdl(*f);
      const double err = RelativeFrobeniusError(back.data(), h.data(), c.n);
      EXPECT_LE(err, 1e-10);
      double tr = 0;
      for (int64_t i = 0; i < c.n; ++i) tr += f->DenseD()[i * c.n + i];
      EXPECT_DOUBLE_EQ(f->TraceD(), tr);
    }
  }
}

TEST(LinalgTest, InPlaceBlockLdlEqualsCopyingBitForBit) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  for (const int64_t n : {1, 9, 64, 130}) {
    const std::vector<double> h = RandomSpd(n, g);
    for (LdlForm form : {LdlForm::kLDLt, LdlForm::kLtDL}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " form " << static_cast<int>(form));
      auto copied = BlockLdlDecompose(h.data(), n, 8, form);
      auto in_place = BlockLdlDecompose(std::vector<double>(h), n, 8, form);
      ASSERT_TRUE(copied.ok() && in_place.ok());
      EXPECT_EQ(copied->L, in_place->L);
      EXPECT_EQ(copied->d, in_place->d);
    }
  }
  EXPECT_EQ(BlockLdlDecompose(std::vector<double>(5, 1.0), 2, 1, LdlForm::kLtDL).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LinalgTest, BlockLdlWithFullBlockIsH) {
  // g = n: L = I, D = H.
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t n = 12;
  const std::vector<double> h = RandomSpd(n, g);
  auto f = BlockLdlDecompose(h.data(), n, n, LdlForm::kLtDL);
  ASSERT_TRUE(f.ok());
  const std::vector<double> d = f->DenseD();
  EXPECT_LE(RelativeFrobeniusError(d.data(), h.data(), n), 1e-12);
}

TEST(LinalgTest, GptqInverseFactorMatchesLtDl) {
  // H⁻¹ = Rᵀ R and H = Lᵀ D L are related by L⁻ᵀ = diag(R)⁻¹ R and D = diag(R)⁻² (the algebra
  // behind the GPTQ == LDLQ equivalence).
  // 96: one tile; 600: three 256-wide tiles of the tiled factor and inverse, the last ragged.
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  for (const int64_t n : {96, 600}) {
    SCOPED_TRACE(n);
    const std::vector<double> h = RandomSpd(n, g, 0.05);
    auto r = InverseCholeskyUpper(h.data(), n);
    ASSERT_TRUE(r.ok()) << r.status();
    // Computed in the matrix's own storage (GPTQ's path): the same bits.
    auto owned = InverseCholeskyUpper(std::vector<double>(h), n);
    ASSERT_TRUE(owned.ok()) << owned.status();
    EXPECT_TRUE(*owned == *r);
    auto f = LdlDecompose(h.data(), n, LdlForm::kLtDL);
    ASSERT_TRUE(f.ok());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) ASSERT_EQ((*r)[i * n + j], 0.0);
      EXPECT_NEAR(f->D(i, i) * (*r)[i * n + i] * (*r)[i * n + i], 1.0, 1e-10);
    }
    // Rᵀ R H = I.
    std::vector<double> rtr(n * n), prod(n * n), eye(n * n, 0.0);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, n, 1.0, r->data(), n, r->data(), n,
                0.0, rtr.data(), n);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, rtr.data(), n, h.data(), n,
                0.0, prod.data(), n);
    for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1.0;
    EXPECT_LE(RelativeFrobeniusError(prod.data(), eye.data(), n), 1e-10);
    // Lᵀ · (diag(R)⁻¹ R) = I.
    std::vector<double> ru(n * n), prod2(n * n);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) ru[i * n + j] = (*r)[i * n + j] / (*r)[i * n + i];
    }
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, n, 1.0, f->L.data(), n, ru.data(), n,
                0.0, prod2.data(), n);
    EXPECT_LE(RelativeFrobeniusError(prod2.data(), eye.data(), n), 1e-10);
  }
}

// The Cholesky is tiled (256 × 256 tiles, the panel and trailing updates spread over threads): a
// pivot that fails in a later tile is reported at its own index.
TEST(LinalgTest, IndefinitePivotInALaterTileIsReportedAtItsIndex) {
  const int64_t n = 600, bad = 450;
  std::vector<double> h(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    h[i * n + i] = i == bad ? -1.0 : 4.0;
    if (i + 1 < n) h[i * n + i + 1] = h[(i + 1) * n + i] = 0.1;
  }
  auto c = Cholesky(h.data(), n);
  ASSERT_FALSE(c.ok());
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("pivot 450"), std::string::npos) << msg;
  h[bad * n + bad] = 4.0;
  c = Cholesky(h.data(), n);
  ASSERT_TRUE(c.ok()) << c.status();
  // C Cᵀ reproduces H across tile boundaries.
  std::vector<double> prod(n * n);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0, c->data(), n, c->data(), n,
              0.0, prod.data(), n);
  EXPECT_LE(RelativeFrobeniusError(prod.data(), h.data(), n), 1e-14);
}

TEST(LinalgTest, InverseFactorKeepingLowerEqualsCopyingAndKeepsTheLowerTriangle) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  for (const int64_t n : {1, 7, 256, 300, 600}) {  // one tile, a ragged one, several
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const std::vector<double> h = RandomSpd(n, g, 0.05);
    auto r = InverseCholeskyUpper(h.data(), n);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<double> a = h;
    ASSERT_TRUE(InverseCholeskyUpperKeepingLower(a.data(), n).ok());
    int64_t upper_diff = 0, lower_diff = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (j >= i) upper_diff += a[i * n + j] != (*r)[i * n + j];
        if (j < i) lower_diff += a[i * n + j] != h[i * n + j];
      }
    }
    EXPECT_EQ(upper_diff, 0);
    EXPECT_EQ(lower_diff, 0);
    EXPECT_NE(a[(n - 1) * n + n - 1], 0.0);
  }
  // Not positive definite (a negative pivot in a later tile): an error, the lower triangle kept.
  const int64_t n = 600;
  std::vector<double> h = RandomSpd(n, g, 0.05);
  h[450 * n + 450] = -1.0;
  std::vector<double> a = h;
  const Status s = InverseCholeskyUpperKeepingLower(a.data(), n);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  int64_t lower_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) lower_diff += a[i * n + j] != h[i * n + j];
  }
  EXPECT_EQ(lower_diff, 0);
  a = h;
  a[3] = std::nan("");
  EXPECT_EQ(InverseCholeskyUpperKeepingLower(a.data(), n).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LinalgTest, IndefiniteMatrixGivesAClearError) {
  // diag(4, 3, -1, 5) with small off-diagonal coupling: the third pivot (index 2) fails.
  const int64_t n = 4;
  std::vector<double> h = {4,   0.1, 0,   0,    //
                           0.1, 3,   0.1, 0,    //
                           0,   0.1, -1,  0.1,  //
                           0,   0,   0.1, 5};
  auto c = Cholesky(h.data(), n);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("not positive definite"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pivot 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Damp"), std::string::npos) << msg;
  std::printf("error text: %s\n", msg.c_str());

  for (int64_t block : {1, 2}) {
    for (LdlForm form : {LdlForm::kLDLt, LdlForm::kLtDL}) {
      auto f = BlockLdlDecompose(h.data(), n, block, form);
      ASSERT_FALSE(f.ok());
      EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
      const std::string m(f.status().message());
      EXPECT_NE(m.find("not positive definite"), std::string::npos) << m;
      // kLtDL factors the reversed matrix; it still names original index 2.
      EXPECT_NE(m.find(form == LdlForm::kLDLt ? "pivot 2" : "original index 2"), std::string::npos)
          << m;
    }
  }
  EXPECT_EQ(InverseCholeskyUpper(h.data(), n).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Damping by 1% of the mean diagonal does not rescue an eigenvalue near -1: still an error.
  auto added = DampHessian(h.data(), n, 0.01);
  ASSERT_TRUE(added.ok());
  EXPECT_EQ(Cholesky(h.data(), n).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LinalgTest, SingularPsdNeedsDamping) {
  // Rank-deficient PSD (a Hessian from fewer samples than features): fails as is, works damped.
  const uint64_t seed = testing::TestSeed();
  Gaussian g(seed);
  const int64_t n = 48, k = 16;
  std::vector<double> a(n * k), h(n * n);
  for (auto& v : a) v = g();
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, k, 1.0, a.data(), k, a.data(), k, 0.0,
              h.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) h[j * n + i] = h[i * n + j];
  }
  EXPECT_EQ(Cholesky(h.data(), n).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<double> damped = h;
  ASSERT_TRUE(DampHessian(damped.data(), n).ok());  // Default δ = 0.01.
  auto f = BlockLdlDecompose(damped.data(), n, 8, LdlForm::kLtDL);
  ASSERT_TRUE(f.ok()) << f.status();
  const std::vector<double> back = ReconstructLdl(*f);
  EXPECT_LE(RelativeFrobeniusError(back.data(), damped.data(), n), 1e-10);
}

TEST(LinalgTest, DampingAddsDeltaTimesMeanDiagonal) {
  std::vector<double> h = {2, 1,  0,   //
                           1, 4,  -1,  //
                           0, -1, 6};
  const std::vector<double> orig = h;
  auto added = DampHessian(h.data(), 3, 0.5);  // mean diag = 4 -> +2.
  ASSERT_TRUE(added.ok());
  EXPECT_EQ(*added, 2.0);
  EXPECT_EQ(h, (std::vector<double>{4, 1, 0, 1, 6, -1, 0, -1, 8}));
  h = orig;
  auto def = DampHessian(h.data(), 3);  // Default δ = 0.01 -> +0.04.
  ASSERT_TRUE(def.ok());
  EXPECT_DOUBLE_EQ(*def, 0.04);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(h[i * 3 + j], i == j ? orig[i * 3 + j] + 0.01 * 4.0 : orig[i * 3 + j]);
    }
  }
  h = orig;
  ASSERT_TRUE(DampHessian(h.data(), 3, 0.0).ok());
  EXPECT_EQ(h, orig);
  EXPECT_EQ(DampHessian(h.data(), 3, -0.1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DampHessian(h.data(), 0, 0.1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinalgTest, RejectsBadInput) {
  std::vector<double> h = {1, 0, 0, NAN};
  EXPECT_EQ(Cholesky(h.data(), 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cholesky(nullptr, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cholesky(h.data(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  h[3] = 1;
  EXPECT_EQ(BlockLdlDecompose(h.data(), 2, 0, LdlForm::kLDLt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LinalgTest, DeterministicForSameInput) {
  const uint64_t seed = testing::TestSeed();
  Gaussian g1(seed), g2(seed);
  const std::vector<double> h1 = RandomSpd(150, g1), h2 = RandomSpd(150, g2);
  ASSERT_EQ(h1, h2);
  auto a = BlockLdlDecompose(h1.data(), 150, 8, LdlForm::kLtDL);
  auto b = BlockLdlDecompose(h2.data(), 150, 8, LdlForm::kLtDL);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->L, b->L);
  EXPECT_EQ(a->d, b->d);
}

}  // namespace
}  // namespace qcal::kernels
