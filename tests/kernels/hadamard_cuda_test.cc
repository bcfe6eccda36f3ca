// FwhtCuda (kernels/hadamard_cuda.cu) against the CPU reference FwhtInPlace in fp64.
//
// Tolerance: |gpu - ref| ≤ 1e-5·sqrt(log2 n)·rms(ref) per element (fp32 rounding in log2 n
// butterfly levels). Without a CUDA device every test here skips visibly (ctest label gpu; ctest
// reports the binary as skipped). Checks that need no device (argument validation, Status
// formatting) live in cuda_status_test.cc so they run wherever CUDA compiles.
#include "kernels/hadamard_cuda.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_status.h"
#include "kernels/hadamard.h"

namespace qcal {
namespace {

uint64_t TestSeed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* env = std::getenv("QCAL_TEST_SEED"); env != nullptr && *env != '\0') {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    std::cout << "[ seed     ] QCAL_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<float, DeviceFree>;

StatusOr<DeviceBuffer> AllocDevice(size_t count) {
  void* p = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(float)));
  return DeviceBuffer(static_cast<float*>(p));
}

// Runs FwhtCuda on `host` (in place) through a device buffer at float offset `offset`.
Status RunOnDevice(std::vector<float>& host, int64_t n, int64_t batch, bool normalize,
                   size_t offset) {
  QCAL_ASSIGN_OR_RETURN(DeviceBuffer buffer, AllocDevice(host.size() + offset));
  float* d = buffer.get() + offset;
  const size_t bytes = host.size() * sizeof(float);
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(d, host.data(), bytes, cudaMemcpyHostToDevice));
  FwhtCudaParams params;
  params.data = d;
  params.n = n;
  params.batch = batch;
  params.normalize = normalize;
  QCAL_RETURN_IF_ERROR(FwhtCuda(params, /*stream=*/nullptr));
  QCAL_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), d, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

class FwhtCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }

  void CheckAgainstCpu(int64_t n, int64_t batch, bool normalize, size_t offset) {
    SCOPED_TRACE("n=" + std::to_string(n) + " batch=" + std::to_string(batch) +
                 " normalize=" + std::to_string(normalize) + " offset=" + std::to_string(offset) +
                 " QCAL_TEST_SEED=" + std::to_string(TestSeed()));
    std::mt19937_64 rng(TestSeed() ^ static_cast<uint64_t>(n * 1315423911 + batch));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(n * batch);
    for (auto& v : x) v = normal(rng);
    ASSERT_TRUE(std::any_of(x.begin(), x.end(), [](float v) { return v != 0.0f; }));

    std::vector<double> ref(x.begin(), x.end());
    ASSERT_TRUE(FwhtInPlace(ref.data(), n, batch).ok());
    if (!normalize) {
      const double s = std::sqrt(static_cast<double>(n));
      for (auto& v : ref) v *= s;
    }
    std::vector<float> gpu = x;
    const Status status = RunOnDevice(gpu, n, batch, normalize, offset);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_TRUE(std::any_of(gpu.begin(), gpu.end(), [](float v) { return v != 0.0f; }));

    double sum_sq = 0;
    for (double v : ref) sum_sq += v * v;
    const double rms = std::sqrt(sum_sq / static_cast<double>(ref.size()));
    const double tol =
        1e-5 * std::sqrt(std::max(1.0, std::log2(static_cast<double>(n)))) * std::max(rms, 1e-30);
    double worst = 0;
    int64_t worst_at = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double err = std::abs(static_cast<double>(gpu[i]) - ref[i]);
      if (err > worst) {
        worst = err;
        worst_at = static_cast<int64_t>(i);
      }
    }
    EXPECT_LE(worst, tol) << "worst at element " << worst_at << ": gpu " << gpu[worst_at] << " ref "
                          << ref[worst_at];
  }
};

TEST_F(FwhtCudaTest, MatchesCpuAllSizes) {
  for (int64_t n = 1; n <= 32768; n *= 2) {
    for (int64_t batch : {1, 3, 37}) CheckAgainstCpu(n, batch, /*normalize=*/true, 0);
  }
}

TEST_F(FwhtCudaTest, MultiPassSizes) {
  // 2^16 (one radix-8 pass), 2^17 (radix-16), 2^18 (radix-16 + radix-2).
  for (int64_t n : {int64_t{1} << 16, int64_t{1} << 17, int64_t{1} << 18}) {
    CheckAgainstCpu(n, 2, /*normalize=*/true, 0);
  }
}

TEST_F(FwhtCudaTest, UnnormalizedAndUnalignedPointers) {
  for (int64_t n : {8, 64, 4096, 16384}) {
    CheckAgainstCpu(n, 5, /*normalize=*/false, 0);
    CheckAgainstCpu(n, 5, /*normalize=*/true, /*offset=*/1);  // scalar (non-float4) path
  }
}

TEST_F(FwhtCudaTest, LargeBatch) { CheckAgainstCpu(128, 10000, /*normalize=*/true, 0); }

}  // namespace
}  // namespace qcal
