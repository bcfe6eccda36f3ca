// Cayley SGD (engine/qsim/cayley.h): the update keeps a rotation orthogonal over long runs, learns
// (an orthogonal Procrustes problem is solved), leaves a stationary point alone, and takes its QR
// re-orthonormalisations with the reference's frequency, deterministically.
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "engine/qsim/cayley.h"

namespace qcal {
namespace {

at::Tensor RandomOrthogonal(int64_t n) {
  auto [q, r] = at::linalg_qr(at::randn({n, n}, at::kDouble));
  return q * at::sign(r.diagonal()).unsqueeze(0);
}

// min ‖R·A − B‖² over orthogonal R with B = Q·A: 1,000 steps at the reference's learning rate
// 1.5 with cosine decay, as a training run takes them.
TEST(CayleyTest, StaysOrthogonalOverAThousandStepsAndLearns) {
  at::manual_seed(testing::TestSeed());
  const int64_t n = 64, steps = 1000;
  const at::Tensor a = at::randn({n, 256}, at::kDouble);
  const at::Tensor target = RandomOrthogonal(n);
  const at::Tensor b = at::mm(target, a);
  at::Tensor r = at::eye(n, at::kDouble);
  auto loss = [&](const at::Tensor& x) { return (at::mm(x, a) - b).pow(2).sum().item<double>(); };
  const double first = loss(r);
  double worst = 0;
  int retractions = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const double lr = 1.5 * 0.5 * (1 + std::cos(M_PI * t / steps));
    const at::Tensor grad = 2 * at::mm(at::mm(r, a) - b, a.t()) / a.size(1);
    const bool qr = qsim::QrRetractionStep(7, t, 0, 101);
    retractions += qr;
    r = qsim::CayleyStep(r, grad, lr, qr);
    worst = std::max(worst, qsim::OrthogonalityError(r));
  }
  const double last = loss(r);
  std::printf("loss %.4g -> %.4g, worst |R·Rᵀ − I| %.3g over %lld steps (%d QR steps)\n", first,
              last, worst, (long long)steps, retractions);
  EXPECT_LE(worst, 1e-6);
  EXPECT_LT(last, 1e-2 * first);
  EXPECT_GT(retractions, 0);
}

TEST(CayleyTest, AZeroGradientLeavesAnOrthogonalMatrixAlone) {
  at::manual_seed(testing::TestSeed());
  const at::Tensor r = RandomOrthogonal(32);
  const at::Tensor next = qsim::CayleyStep(r, at::zeros({32, 32}, at::kDouble), 1.5, false);
  // (Only the rows' renormalisation by norm + 1e-8 moves it.)
  EXPECT_LT((next - r).abs().max().item<double>(), 1e-8);
  const at::Tensor qr = qsim::CayleyStep(r, at::zeros({32, 32}, at::kDouble), 1.5, true);
  EXPECT_LT((qr - r).abs().max().item<double>(), 1e-8);  // QR of an orthogonal matrix, signed
}

TEST(CayleyTest, QrRetractionStepsAreDeterministicAtTheReferenceRate) {
  int64_t hits = 0;
  const int64_t draws = 200000;
  for (int64_t t = 0; t < draws; ++t) hits += qsim::QrRetractionStep(3, t, t % 5, 101);
  const double rate = static_cast<double>(hits) / draws;
  EXPECT_NEAR(rate, 1.0 / 101, 0.1 / 101);
  EXPECT_EQ(qsim::QrRetractionStep(3, 12345, 2, 101), qsim::QrRetractionStep(3, 12345, 2, 101));
  EXPECT_TRUE(qsim::QrRetractionStep(3, 12345, 2, 1));
}

}  // namespace
}  // namespace qcal
