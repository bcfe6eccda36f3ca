// Structured transforms vs a dense n×n product, on a batch of vectors (fp32, CPU).
//
//   BM_Fwht            normalized FWHT, n = 2^k
//   BM_HadamardPow2xM  H_{2^k} ⊗ H_m (QuIP#/QuaRot sizes: 11008 = 64·172, 14336 = 512·28, ...)
//   BM_Rfft            QuIP# randomized FFT (any even n; double-precision FFT inside)
//   BM_DenseSgemm      the same rotation stored as a dense n×n fp32 matrix, applied with
//                      cblas_sgemm (BLAS threads as configured; the structured transforms above
//                      are single-threaded). At n = 28672 the matrix is 3.3 GB, so it runs once.
//
// Every benchmark transforms kBatch vectors per iteration and reports vectors/s of wall time
// (UseRealTime: BLAS runs multi-threaded).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/hadamard.h"

namespace qcal {
namespace {

constexpr int64_t kBatch = 32;

std::vector<float> RandomData(int64_t size) {
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(size);
  for (auto& x : v) x = normal(rng);
  return v;
}

void SetCounters(benchmark::State& state, int64_t n) {
  state.counters["vectors/s"] = benchmark::Counter(static_cast<double>(state.iterations() * kBatch),
                                                   benchmark::Counter::kIsRate);
  state.SetBytesProcessed(state.iterations() * kBatch * n * static_cast<int64_t>(sizeof(float)));
}

void BM_Fwht(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> x = RandomData(n * kBatch);
  for (auto _ : state) {
    if (!FwhtInPlace(x.data(), n, kBatch).ok()) state.SkipWithError("FwhtInPlace failed");
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, n);
}

void BM_HadamardPow2xM(benchmark::State& state) {
  const int64_t n = state.range(0);
  state.SetLabel(DescribeHadamardPlan(PlanHadamard(n)));
  std::vector<float> x = RandomData(n * kBatch);
  for (auto _ : state) {
    if (!HadamardTransform(x.data(), n, kBatch).ok()) state.SkipWithError("transform failed");
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, n);
}

void BM_Rfft(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto phases = RandomPhases(n / 2, 7);
  std::vector<float> x = RandomData(n * kBatch);
  for (auto _ : state) {
    if (!RandomizedFftTransform(x.data(), n, kBatch, phases.data(), TransformDirection::kForward)
             .ok()) {
      state.SkipWithError("RFFT failed");
    }
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, n);
}

void BM_DenseSgemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  // Contents do not affect the timing; a constant fill keeps setup of the 3.3 GB case short.
  std::vector<float> h(static_cast<size_t>(n) * n, 1.0f / std::sqrt(static_cast<float>(n)));
  const std::vector<float> x = RandomData(n * kBatch);
  std::vector<float> y(n * kBatch);
  for (auto _ : state) {
    // Y (kBatch×n) = X (kBatch×n) · H^T, i.e. y_b = H·x_b for each row vector.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(kBatch),
                static_cast<int>(n), static_cast<int>(n), 1.0f, x.data(), static_cast<int>(n),
                h.data(), static_cast<int>(n), 0.0f, y.data(), static_cast<int>(n));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, n);
}

BENCHMARK(BM_Fwht)->Arg(4096)->Arg(8192)->Arg(16384)->Arg(32768)->UseRealTime()->Unit(
    benchmark::kMicrosecond);
BENCHMARK(BM_HadamardPow2xM)
    ->Arg(11008)
    ->Arg(14336)
    ->Arg(28672)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Rfft)->Arg(4096)->Arg(11008)->Arg(14336)->Arg(28672)->UseRealTime()->Unit(
    benchmark::kMicrosecond);
BENCHMARK(BM_DenseSgemm)
    ->Arg(4096)
    ->Arg(11008)
    ->Arg(14336)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DenseSgemm)->Arg(28672)->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace qcal

BENCHMARK_MAIN();
