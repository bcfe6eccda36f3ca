// Every GPU kernel of the rounding and calibration path against its CPU reference, in the style
// of ggml's test-backend-ops: the same inputs through both, then
//   * exact equality where the outputs are integers: fixed-point Hessian sums from inputs whose
//     fp32 products are exact, their reduction digits, E8P codes (and the decoded points);
//   * elsewhere a tolerance stated relative to the reference's own precision: Hessians from
//     real-valued bf16 inputs (fp32 accumulation over t terms: 4·t·2^-24 of Σ|x_i x_j|, a bound
//     on any summation order's rounding with margin for tensor-core accumulation), Cholesky
//     factors (fp64: 1e-9 of the factor's largest entry at condition numbers ≤ 1e3);
//   * inputs and outputs asserted non-zero; fresh random inputs, the seed printed
//     (QCAL_TEST_SEED=... reproduces a run).
// Without a CUDA device every test skips visibly (ctest label gpu, reported as skipped).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_status.h"
#include "kernels/e8p.h"
#include "kernels/e8p_cuda.h"
#include "kernels/fixed_point.h"
#include "kernels/gpu_backend.h"
#include "kernels/gpu_backend_cuda.h"
#include "kernels/gptq_cuda.h"
#include "kernels/hessian_cuda.h"
#include "kernels/hessian_fixed.h"
#include "kernels/linalg.h"
#include "kernels/ldlq_cuda.h"
#include "kernels/linalg_cuda.h"
#include "kernels/rounding.h"
#include "tests/test_util.h"

namespace qcal::kernels {
namespace {

// A device buffer of T (RAII).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (cudaMalloc(&p_, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (p_ != nullptr) cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    cudaMemcpy(host.data(), p_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  void* p_ = nullptr;
  size_t count_;
};

// bf16 bits of a float, round to nearest even (inputs here are finite).
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class GpuOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    rng_.seed(qcal::testing::ProcessSeed() ^ std::hash<std::string>()(
                               ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  std::mt19937_64 rng_;
};

// Multiples of 1/16 in [-4, 4]: exact in bf16; products are multiples of 1/256 below 16 and
// their sums over t ≤ 256 terms stay below 2^12 with 8 fraction bits: exact in fp32 in any order.
std::vector<float> ExactInputs(std::mt19937_64& rng, size_t count) {
  std::uniform_int_distribution<int> k(-64, 64);
  std::vector<float> x(count);
  for (float& v : x) v = static_cast<float>(k(rng)) / 16.0f;
  return x;
}

std::vector<Fixed128> CpuReference(const std::vector<float>& x, int64_t seqs, int64_t t,
                                   int64_t n) {
  std::vector<Fixed128> packed(HessianPackedSize(n), 0);
  const Status st = AccumulateHessianFixedReference(x.data(), seqs, t, n, packed.data());
  EXPECT_TRUE(st.ok()) << st;
  return packed;
}

StatusOr<std::vector<Fixed128>> GpuHessian(const std::vector<float>& x, bool bf16, int64_t seqs,
                                           int64_t t, int64_t n, HessianCudaOptions options) {
  QCAL_ASSIGN_OR_RETURN(HessianAccumulatorCuda acc,
                        HessianAccumulatorCuda::Create(n, nullptr, options));
  if (bf16) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = ToBf16(x[i]);
    DeviceArray<uint16_t> d(b);
    QCAL_RETURN_IF_ERROR(acc.Add(d.get(), HessianInputType::kBf16, seqs, t));
    return acc.Download();
  }
  DeviceArray<float> d(x);
  QCAL_RETURN_IF_ERROR(acc.Add(d.get(), HessianInputType::kFloat32, seqs, t));
  return acc.Download();
}

size_t CountNonZero(const std::vector<Fixed128>& v) {
  return static_cast<size_t>(std::count_if(v.begin(), v.end(), [](Fixed128 x) { return x != 0; }));
}

TEST_F(GpuOpsTest, HessianEqualsCpuReferenceBitForBitOnExactProducts) {
  // n not a multiple of the strip, a partial last group: every path of the strip loop.
  const int64_t n = 300, t = 128, seqs = 11;
  const std::vector<float> x = ExactInputs(rng_, seqs * t * n);
  const std::vector<Fixed128> ref = CpuReference(x, seqs, t, n);
  ASSERT_GT(CountNonZero(ref), ref.size() / 2);
  for (bool bf16 : {true, false}) {
    for (HessianCudaOptions o : {HessianCudaOptions{128, 4, int64_t{1} << 30},
                                 HessianCudaOptions{1024, 8, int64_t{1} << 30},
                                 HessianCudaOptions{64, 3, 300 * 64 * 4 * 2}}) {
      SCOPED_TRACE(::testing::Message() << (bf16 ? "bf16" : "fp32") << " strip " << o.strip
                                        << " group " << o.max_group);
      auto gpu = GpuHessian(x, bf16, seqs, t, n, o);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      ASSERT_EQ(gpu->size(), ref.size());
      size_t mismatches = 0;
      for (size_t e = 0; e < ref.size(); ++e) mismatches += (*gpu)[e] != ref[e];
      EXPECT_EQ(mismatches, 0u);
    }
  }
}

TEST_F(GpuOpsTest, HessianOnRealValuedBf16InputsWithinFp32ProductTolerance) {
  const int64_t n = 256, t = 512, seqs = 6;
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(seqs * t * n);
  for (size_t i = 0; i < x.size(); ++i) {
    // Heavy-ish channels, as real activations have.
    const float scale = (i % n) % 37 == 0 ? 20.0f : 1.0f;
    x[i] = FromBf16(ToBf16(scale * g(rng_)));  // representable in bf16: both sides see the same x
  }
  std::vector<float> ax(x.size());
  for (size_t i = 0; i < x.size(); ++i) ax[i] = std::fabs(x[i]);
  const std::vector<double> ref = HessianMeanFromFixed(CpuReference(x, seqs, t, n).data(), n,
                                                       seqs * t);
  const std::vector<double> mag = HessianMeanFromFixed(CpuReference(ax, seqs, t, n).data(), n,
                                                       seqs * t);
  auto gpu = GpuHessian(x, /*bf16=*/true, seqs, t, n, HessianCudaOptions{});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<double> h = HessianMeanFromFixed(gpu->data(), n, seqs * t);
  double worst = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    const double tol = 4.0 * t * 0x1p-24 * mag[e] + 1e-12;
    worst = std::max(worst, std::fabs(h[e] - ref[e]) / tol);
    ASSERT_LE(std::fabs(h[e] - ref[e]), tol) << "entry " << e / n << "," << e % n;
  }
  EXPECT_GT(std::fabs(h[0]), 0.1);
  std::cout << "[ info     ] worst |gpu - cpu| / tolerance = " << worst << std::endl;
}

TEST_F(GpuOpsTest, HessianSumsAreIdenticalForAnySplitAcrossRanks) {
  // Three "ranks" each accumulate a slice of the sequences, their reduction digits are summed
  // (as NCCL's int64 sum does) and combined: the same bits as one accumulator over everything.
  const int64_t n = 200, t = 96, seqs = 7;
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<float> x(seqs * t * n);
  for (float& v : x) v = FromBf16(ToBf16(g(rng_)));
  auto whole = GpuHessian(x, true, seqs, t, n, HessianCudaOptions{});
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_GT(CountNonZero(*whole), whole->size() / 2);
  const int64_t size = HessianPackedSize(n);
  std::vector<int64_t> summed(4 * size, 0);
  const int64_t cuts[] = {0, 2, 3, 7};
  for (int r = 0; r < 3; ++r) {
    const int64_t s0 = cuts[r], s1 = cuts[r + 1];
    std::vector<float> part(x.begin() + s0 * t * n, x.begin() + s1 * t * n);
    auto acc = HessianAccumulatorCuda::Create(n, nullptr, HessianCudaOptions{64, 2});
    ASSERT_TRUE(acc.ok()) << acc.status();
    std::vector<uint16_t> b(part.size());
    for (size_t i = 0; i < part.size(); ++i) b[i] = ToBf16(part[i]);
    DeviceArray<uint16_t> d(b);
    ASSERT_TRUE(acc->Add(d.get(), HessianInputType::kBf16, s1 - s0, t).ok());
    DeviceArray<int64_t> limbs(4 * size);
    ASSERT_TRUE(acc->ToDigits(limbs.get()).ok());
    ASSERT_TRUE(acc->Sync().ok());
    const std::vector<int64_t> host = limbs.Download();
    // The digits equal the host-side split of the downloaded values.
    auto values = acc->Download();
    ASSERT_TRUE(values.ok());
    for (int64_t e = 0; e < size; e += 97) {
      int64_t expect[4];
      SplitFixedDigits((*values)[e], expect);
      for (int l = 0; l < 4; ++l) ASSERT_EQ(host[4 * e + l], expect[l]) << e;
    }
    for (int64_t i = 0; i < 4 * size; ++i) summed[i] += host[i];
  }
  auto combined = HessianAccumulatorCuda::Create(n, nullptr);
  ASSERT_TRUE(combined.ok());
  DeviceArray<int64_t> d(summed);
  ASSERT_TRUE(combined->FromDigits(d.get(), seqs * t).ok());
  auto reduced = combined->Download();
  ASSERT_TRUE(reduced.ok()) << reduced.status();
  EXPECT_TRUE(*reduced == *whole);
}

TEST_F(GpuOpsTest, DeviceHessianAllReduceInPiecesEqualsOneAccumulatorOverAllRanks) {
  // DeviceHessian::AllReduce (the backend's; NCCL's all-reduce in qcal-worker) on rank 0 of three
  // simulated ranks: the sum callback adds ranks 1 and 2's digits (downloaded beforehand) to each
  // device piece it is given. n = 3000 has 4.5M packed values: two pieces (4M and the rest).
  const int64_t n = 3000, t = 32;
  const int64_t seqs[3] = {2, 1, 3};
  std::normal_distribution<float> g(0.0f, 2.0f);
  auto backend = CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::vector<std::vector<float>> inputs(3);
  std::vector<std::unique_ptr<DeviceHessian>> ranks;
  for (int r = 0; r < 3; ++r) {
    inputs[r].resize(seqs[r] * t * n);
    for (float& v : inputs[r]) v = g(rng_);
    auto h = (*backend)->NewHessian(n);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*h)->Add(inputs[r].data(), seqs[r], t).ok());
    ranks.push_back(std::move(*h));
  }
  // Everything on one accumulator: the expected bits.
  auto whole = (*backend)->NewHessian(n);
  ASSERT_TRUE(whole.ok());
  for (int r = 0; r < 3; ++r) ASSERT_TRUE((*whole)->Add(inputs[r].data(), seqs[r], t).ok());
  int64_t whole_count = 0;
  auto expect = (*whole)->Finish(&whole_count);
  ASSERT_TRUE(expect.ok()) << expect.status();
  ASSERT_GT(CountNonZero(*expect), expect->size() / 2);
  // Ranks 1 and 2's digits, summed on the host.
  const int64_t size = HessianPackedSize(n);
  std::vector<int64_t> others(4 * size, 0);
  for (int r = 1; r < 3; ++r) {
    int64_t count = 0;
    auto v = ranks[r]->Finish(&count);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int64_t e = 0; e < size; ++e) {
      int64_t d[4];
      SplitFixedDigits((*v)[e], d);
      for (int l = 0; l < 4; ++l) others[4 * e + l] += d[l];
    }
  }
  size_t offset = 0;
  int pieces = 0;
  DeviceInt64Sum sum = [&](int64_t* device, size_t count) -> Status {
    ++pieces;
    std::vector<int64_t> host(count);
    QCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(host.data(), device, count * 8, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) host[i] += others[offset + i];
    offset += count;
    QCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(device, host.data(), count * 8, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  };
  ASSERT_TRUE(ranks[0]->AllReduce(sum, whole_count).ok());
  EXPECT_EQ(pieces, 2);
  EXPECT_EQ(offset, static_cast<size_t>(4 * size));
  EXPECT_EQ(ranks[0]->count(), whole_count);
  int64_t count = 0;
  auto reduced = ranks[0]->Finish(&count);
  ASSERT_TRUE(reduced.ok()) << reduced.status();
  EXPECT_EQ(count, (2 + 1 + 3) * t);
  EXPECT_TRUE(*reduced == *expect);
}

TEST_F(GpuOpsTest, HessianDigitRangesOutsideTheTriangleAreErrors) {
  auto acc = HessianAccumulatorCuda::Create(10, nullptr);
  ASSERT_TRUE(acc.ok()) << acc.status();
  DeviceArray<int64_t> limbs(4 * 55);
  EXPECT_TRUE(acc->ToDigits(50, 5, limbs.get()).ok());
  EXPECT_EQ(acc->ToDigits(50, 6, limbs.get()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(acc->FromDigits(-1, 2, limbs.get()).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(acc->Sync().ok());
}

TEST_F(GpuOpsTest, HessianOverflowIsAnErrorNamingTheEntry) {
  const int64_t n = 16, t = 4;
  std::vector<float> x(t * n, 1.0f);
  x[5] = 3e18f;  // (3e18)² · 2^50 > 2^123
  auto gpu = GpuHessian(x, /*bf16=*/false, 1, t, n, HessianCudaOptions{});
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(std::string(gpu.status().message()).find("(5, 5)"), std::string::npos)
      << gpu.status();
}

TEST_F(GpuOpsTest, E8pCodesEqualTheCpuEncoderExactlyTiesIncluded) {
  const E8pCodebook cb;
  std::vector<float> x;
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int64_t random_count = 1 << 18;
  for (int64_t i = 0; i < 8 * random_count; ++i) x.push_back(1.03f * g(rng_));
  // Outside the codebook's ball (the coset point is not a codebook point: one shift scanned).
  for (int64_t i = 0; i < 8 * 20000; ++i) x.push_back(2.5f * g(rng_));
  // Hard cases: lattice points themselves, midpoints between neighbouring points (ties), inputs
  // on the quarter grid (coordinates with y = 0 after a shift), zeros, large values.
  const std::vector<float>& pts = cb.expanded();
  std::uniform_int_distribution<int> code(0, 65535), coord(0, 7), quarter(-12, 12);
  for (int i = 0; i < 20000; ++i) {
    const int a = code(rng_), b = code(rng_);
    for (int j = 0; j < 8; ++j) x.push_back(pts[8 * a + j]);
    for (int j = 0; j < 8; ++j) x.push_back(0.5f * (pts[8 * a + j] + pts[8 * b + j]));
    for (int j = 0; j < 8; ++j) x.push_back(0.25f * static_cast<float>(quarter(rng_)));
    for (int j = 0; j < 8; ++j) {
      x.push_back(j == coord(rng_) ? 0.5f * static_cast<float>(quarter(rng_)) : 0.0f);
    }
  }
  for (int j = 0; j < 8; ++j) x.push_back(0.0f);
  for (int j = 0; j < 8; ++j) x.push_back(j % 2 ? 1e6f : -3e7f);
  const int64_t count = static_cast<int64_t>(x.size() / 8);
  std::vector<float> cpu_out(x.size());
  std::vector<uint32_t> cpu_codes(count);
  for (int64_t v = 0; v < count; ++v) {
    cpu_codes[v] = cb.EncodeOne(&x[8 * v], &cpu_out[8 * v]).bits;
  }
  DeviceArray<float> dx(x);
  DeviceArray<uint32_t> dcodes(count);
  DeviceArray<float> dout(x.size());
  const Status st = E8pEncodeCuda(dx.get(), count, dcodes.get(), dout.get(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint32_t> codes = dcodes.Download();
  const std::vector<float> out = dout.Download();
  int64_t mismatches = 0, distinct_nonzero = 0;
  for (int64_t v = 0; v < count; ++v) {
    if (codes[v] != cpu_codes[v]) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "vector " << v << ": gpu code " << codes[v] << ", cpu " << cpu_codes[v];
      }
    }
    distinct_nonzero += codes[v] != 0;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(distinct_nonzero, count / 2);
  EXPECT_TRUE(std::memcmp(out.data(), cpu_out.data(), out.size() * 4) == 0);
}

TEST_F(GpuOpsTest, CholeskyMatchesLapackWithinFp64Tolerance) {
  const int64_t n = 777;
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> b(n * 2 * n), h(n * n, 0.0);
  for (double& v : b) v = g(rng_);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0;
      for (int64_t k = 0; k < 2 * n; ++k) s += b[i * 2 * n + k] * b[j * 2 * n + k];
      h[i * n + j] = h[j * n + i] = s / (2.0 * n) + (i == j ? 0.05 : 0.0);
    }
  }
  std::vector<double> ref = h;
  ASSERT_TRUE(CholeskyInPlace(ref.data(), n).ok());
  DeviceArray<double> d(h);
  const Status st = CholeskyCuda(d.get(), n, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<double> c = d.Download();
  double max_ref = 0, max_diff = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    max_ref = std::max(max_ref, std::fabs(ref[e]));
    max_diff = std::max(max_diff, std::fabs(c[e] - ref[e]));
  }
  EXPECT_GT(max_ref, 0.5);
  EXPECT_LE(max_diff, 1e-9 * max_ref);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) ASSERT_EQ(c[i * n + j], 0.0);
  }
  std::cout << "[ info     ] max |gpu - lapack| = " << max_diff << " (max |C| " << max_ref << ")"
            << std::endl;
  // Not positive definite: a clear error naming the pivot.
  std::vector<double> bad = h;
  bad[10 * n + 10] = -1.0;
  DeviceArray<double> dbad(bad);
  const Status bad_st = CholeskyCuda(dbad.get(), n, nullptr);
  EXPECT_EQ(bad_st.code(), absl::StatusCode::kFailedPrecondition) << bad_st;
  EXPECT_NE(std::string(bad_st.message()).find("pivot 10"), std::string::npos) << bad_st;
}

// A correlated SPD matrix: (B Bᵀ)/(2n) + ridge·I with B [n, 2n] Gaussian plus a shared factor.
std::vector<double> RandomSpd(std::mt19937_64& rng, int64_t n, double ridge) {
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> b(n * 2 * n), h(n * n, 0.0), common(2 * n);
  for (double& v : common) v = g(rng);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < 2 * n; ++k) b[i * 2 * n + k] = g(rng) + 0.5 * common[k];
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0;
      for (int64_t k = 0; k < 2 * n; ++k) s += b[i * 2 * n + k] * b[j * 2 * n + k];
      h[i * n + j] = h[j * n + i] = s / (2.0 * n) + (i == j ? ridge : 0.0);
    }
  }
  return h;
}

TEST_F(GpuOpsTest, BlockLdlMatchesTheCpuFactorWithinFp64Tolerance) {
  const int64_t n = 512;
  const std::vector<double> h = RandomSpd(rng_, n, 0.05);
  auto ref = BlockLdlDecompose(h.data(), n, 8, LdlForm::kLtDL);
  ASSERT_TRUE(ref.ok()) << ref.status();
  DeviceArray<double> d(h);
  const Status st = BlockLdlCuda(d.get(), n, 8, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<double> l = d.Download();
  double max_ref = 0, max_diff = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    max_ref = std::max(max_ref, std::fabs(ref->L[e]));
    max_diff = std::max(max_diff, std::fabs(l[e] - ref->L[e]));
  }
  EXPECT_GT(max_ref, 0.1);
  EXPECT_LE(max_diff, 1e-9 * max_ref);
  std::cout << "[ info     ] max |gpu L - cpu L| = " << max_diff << " (max |L| " << max_ref << ")"
            << std::endl;
  EXPECT_EQ(BlockLdlCuda(d.get(), n, 4, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuOpsTest, BlockLdlqE8pMatchesTheCpuRounding) {
  // Two and a half lazy blocks, a dead input column: every path of the sweep.
  const int64_t m = 192, n = 320;
  std::vector<double> h = RandomSpd(rng_, n, 0.01);
  for (int64_t j = 0; j < n; ++j) h[7 * n + j] = h[j * n + 7] = 0.0;
  std::normal_distribution<double> g(0.0, 0.02);
  std::vector<double> w(m * n);
  for (double& v : w) v = g(rng_);
  VectorRoundingConfig config;
  const E8pCodebook cb;
  auto cpu = BlockLdlq(w.data(), m, n, h.data(), cb, config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  BlockLdlqCudaTimes times;
  auto gpu = BlockLdlqE8pCuda(w.data(), m, n, h.data(), config, nullptr, &times);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_EQ(gpu->codes.size(), cpu->codes.size());
  EXPECT_EQ(gpu->scale, cpu->scale);
  int64_t same = 0;
  for (size_t i = 0; i < cpu->codes.size(); ++i) same += gpu->codes[i] == cpu->codes[i];
  const double frac = static_cast<double>(same) / static_cast<double>(cpu->codes.size());
  const double loss_cpu = ProxyLoss(w.data(), cpu->w_hat.data(), h.data(), m, n);
  const double loss_gpu = ProxyLoss(w.data(), gpu->w_hat.data(), h.data(), m, n);
  std::cout << "[ info     ] codes equal " << frac << ", proxy loss cpu " << loss_cpu << " gpu "
            << loss_gpu << std::endl;
  EXPECT_GE(frac, 0.99);
  EXPECT_GT(loss_cpu, 0.0);
  EXPECT_NEAR(loss_gpu, loss_cpu, 0.005 * loss_cpu);
  // Errors as on the CPU: a shape the codebook cannot take, non-finite weights.
  EXPECT_EQ(BlockLdlqE8pCuda(w.data(), m, n - 4, h.data(), config, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  w[3] = std::nan("");
  EXPECT_EQ(BlockLdlqE8pCuda(w.data(), m, n, h.data(), config, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuOpsTest, InverseCholeskyUpperMatchesTheCpuFactor) {
  const int64_t n = 400;
  const std::vector<double> h = RandomSpd(rng_, n, 0.05);
  auto ref = InverseCholeskyUpper(h.data(), n);
  ASSERT_TRUE(ref.ok()) << ref.status();
  DeviceArray<double> d(h);
  const Status st = InverseCholeskyUpperCuda(d.get(), n, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<double> r = d.Download();
  double max_ref = 0, max_diff = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    max_ref = std::max(max_ref, std::fabs((*ref)[e]));
    max_diff = std::max(max_diff, std::fabs(r[e] - (*ref)[e]));
  }
  EXPECT_GT(max_ref, 0.5);
  EXPECT_LE(max_diff, 1e-9 * max_ref);
  std::cout << "[ info     ] max |gpu R - cpu R| = " << max_diff << " (max |R| " << max_ref << ")"
            << std::endl;
}

TEST_F(GpuOpsTest, GptqMatchesTheCpuRounding) {
  const int64_t m = 160, n = 256;
  std::normal_distribution<double> g(0.0, 0.02);
  std::vector<double> w(m * n);
  for (double& v : w) v = g(rng_);
  std::vector<double> h = RandomSpd(rng_, n, 0.01);
  for (int64_t j = 0; j < n; ++j) h[9 * n + j] = h[j * n + 9] = 0.0;  // a dead input
  ScalarRoundingConfig channel;  // gptq-4bit's grid: per channel, act order, clip search
  channel.quant.bits = 4;
  channel.quant.clip_search = true;
  channel.act_order = true;
  channel.lazy_block = 64;
  ScalarRoundingConfig group;  // 3-bit asymmetric groups of 32, two groups per lazy block
  group.quant.bits = 3;
  group.quant.symmetric = false;
  group.quant.granularity = QuantGranularity::kPerGroup;
  group.quant.group_size = 32;
  group.lazy_block = 64;
  ScalarRoundingConfig refined = channel;
  refined.refine_sweeps = 1;
  for (const auto& [name, config] : {std::pair<const char*, ScalarRoundingConfig>{"channel", channel},
                                     {"group", group}, {"refined", refined}}) {
    SCOPED_TRACE(name);
    auto cpu = Gptq(w.data(), m, n, h.data(), config);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = GptqCuda(w.data(), m, n, h.data(), config, nullptr);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    ASSERT_EQ(gpu->codes.size(), cpu->codes.size());
    int64_t same = 0;
    for (size_t i = 0; i < cpu->codes.size(); ++i) same += gpu->codes[i] == cpu->codes[i];
    const double frac = static_cast<double>(same) / static_cast<double>(cpu->codes.size());
    const double loss_cpu = ProxyLoss(w.data(), cpu->w_hat.data(), h.data(), m, n);
    const double loss_gpu = ProxyLoss(w.data(), gpu->w_hat.data(), h.data(), m, n);
    std::cout << "[ info     ] gptq " << name << ": codes equal " << frac << ", proxy loss cpu "
              << loss_cpu << " gpu " << loss_gpu << std::endl;
    EXPECT_GE(frac, 0.999);
    EXPECT_GT(loss_cpu, 0.0);
    EXPECT_NEAR(loss_gpu, loss_cpu, 0.001 * loss_cpu);
    EXPECT_EQ(gpu->scales.size(), cpu->scales.size());
    EXPECT_EQ(gpu->perm, cpu->perm);
  }
}

}  // namespace
}  // namespace qcal::kernels
