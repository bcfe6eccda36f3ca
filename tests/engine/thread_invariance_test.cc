// The thread-count invariance that docs/algorithms.md ("Determinism: ranks, threads,
// CPUs") promises for the two numeric primitives every forward and every loss goes through:
// model::LinearRows (a dense linear without autograd, fixed 256-row chunks) and
// model::SumToDouble (fixed 4096-element partial sums). Each is computed with 1, 2, 3 and 4
// LibTorch threads (model::SetComputeThreads, which also pins BLAS to one thread) and must give
// the same bits; against a plain reference it must agree to float / double rounding. (Checked
// to fail when BLAS runs on 2-4 threads or when the sum is LibTorch's whole-tensor sum().)
//
// Random inputs are fresh per run; the seed is printed and can be pinned with QCAL_TEST_SEED.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/blas_threads.h"
#include "tests/test_util.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

constexpr int kThreadCounts[] = {1, 2, 3, 4};

class ThreadInvarianceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::TestSeed();
    std::printf("BLAS: %s\n", kernels::PinBlasToOneThread().c_str());
    at::manual_seed(seed_);
  }
  void TearDown() override { model::SetComputeThreads(1); }
  uint64_t seed_ = 0;
};

TEST_F(ThreadInvarianceTest, LinearRowsGivesTheSameBitsForAnyThreadCount) {
  // Rows not a multiple of the 256-row chunk (11 · 101 = 1111: four full chunks and a tail), a
  // Llama-like width, and inputs of mixed magnitude so that summation order shows in the bits.
  const at::Tensor x = at::randn({11, 101, 288}) * at::exp(at::randn({11, 101, 288}));
  const at::Tensor w = at::randn({768, 288}) * 0.05;
  std::vector<at::Tensor> outs;
  for (int threads : kThreadCounts) {
    model::SetComputeThreads(threads);
    outs.push_back(model::LinearRows(x, w));
  }
  ASSERT_EQ(outs[0].sizes(), (std::vector<int64_t>{11, 101, 768}));
  for (size_t i = 1; i < outs.size(); ++i) {
    EXPECT_TRUE(at::equal(outs[0], outs[i]))
        << kThreadCounts[i] << " threads differ from 1 thread; max |diff| "
        << (outs[0] - outs[i]).abs().max().item<float>();
  }
  // Each chunk is an ordinary GEMM of its rows.
  const at::Tensor ref = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  const double rel = ((outs[0].to(at::kDouble) - ref).abs().max() / ref.abs().max()).item<double>();
  EXPECT_LT(rel, 1e-5) << "LinearRows vs a double-precision x·wᵀ";
  // Small inputs (one chunk or less) take the single-GEMM path; the same bits for any count.
  const at::Tensor small = x.reshape({-1, 288}).narrow(0, 0, 200);
  model::SetComputeThreads(1);
  const at::Tensor small1 = model::LinearRows(small, w);
  model::SetComputeThreads(4);
  EXPECT_TRUE(at::equal(small1, model::LinearRows(small, w)));
  // A row's output depends only on its chunk: the first 256 rows alone give the same bits.
  const at::Tensor first = model::LinearRows(x.reshape({-1, 288}).narrow(0, 0, 256), w);
  EXPECT_TRUE(at::equal(first, outs[0].reshape({-1, 768}).narrow(0, 0, 256)));
}

TEST_F(ThreadInvarianceTest, LinearRowsWithAutogradGivesTheSameBitsForAnyThreadCount) {
  const at::Tensor x = at::randn({1111, 288});
  const at::Tensor w0 = at::randn({768, 288}) * 0.05;
  std::vector<at::Tensor> outs, grads;
  for (int threads : kThreadCounts) {
    model::SetComputeThreads(threads);
    const at::Tensor w = w0.clone().set_requires_grad(true);
    at::Tensor y = model::LinearRows(x, w);
    y.pow(2).sum().backward();
    outs.push_back(y.detach());
    grads.push_back(w.grad());
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    EXPECT_TRUE(at::equal(outs[0], outs[i])) << kThreadCounts[i] << " threads (forward)";
    EXPECT_TRUE(at::equal(grads[0], grads[i])) << kThreadCounts[i] << " threads (gradient)";
  }
}

// Fine-tuning's held-out passes run under a NoGradGuard while the weights require grad: the
// chunked path must not hand mm_out a grad-requiring weight on a pool thread, whose own grad
// mode is enabled (a worker aborted this way with --threads 2).
TEST_F(ThreadInvarianceTest, LinearRowsUnderNoGradWithAGradRequiringWeightOnManyThreads) {
  const at::Tensor x = at::randn({1111, 288});
  const at::Tensor w = (at::randn({768, 288}) * 0.05).set_requires_grad(true);
  model::SetComputeThreads(1);
  at::Tensor one;
  {
    at::NoGradGuard no_grad;
    one = model::LinearRows(x, w);
  }
  for (int threads : kThreadCounts) {
    model::SetComputeThreads(threads);
    at::NoGradGuard no_grad;
    at::Tensor y;
    ASSERT_NO_THROW(y = model::LinearRows(x, w)) << threads << " threads";
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(at::equal(one, y)) << threads << " threads";
  }
}

TEST_F(ThreadInvarianceTest, SumToDoubleGivesTheSameBitsForAnyThreadCount) {
  // Above LibTorch's 32768-element grain (where its own sum() splits by thread count), not a
  // multiple of the 4096-element chunk, with magnitudes over many binades.
  for (const int64_t n : {int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{1000003}}) {
    const at::Tensor t = at::randn({n}) * at::exp(3 * at::randn({n}));
    std::vector<double> sums;
    for (int threads : kThreadCounts) {
      model::SetComputeThreads(threads);
      sums.push_back(model::SumToDouble(t));
    }
    for (size_t i = 1; i < sums.size(); ++i) {
      EXPECT_EQ(sums[0], sums[i]) << "n=" << n << ", " << kThreadCounts[i] << " threads";
    }
    // Against a compensated sum of the same doubles.
    const at::Tensor d = t.to(at::kDouble).contiguous();
    const double* p = d.data_ptr<double>();
    long double ref = 0, abs_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      ref += p[i];
      abs_sum += std::fabs(p[i]);
    }
    EXPECT_LE(std::fabs(sums[0] - static_cast<double>(ref)),
              1e-13 * static_cast<double>(abs_sum) + 1e-300)
        << "n=" << n;
  }
}

}  // namespace
}  // namespace qcal
