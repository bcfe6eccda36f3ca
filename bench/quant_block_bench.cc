// Reports (not asserts) the Hessian accumulation throughput (GFLOP/s of x xᵀ, counted as the
// full 2·tokens·n² product) on Llama-2-7B's linear input widths with random activations: the
// exact fixed-point accumulator and the previous fp64 running sum, against LibTorch's fp32 matmul
// on the same shapes (all cores), measured in the same run. (The block quantization time is
// bench_quip_block.)
//
//   build/bench/bench_quant_block [--tokens 8192] [--seq 2048]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu.h"
#include "kernels/blas_threads.h"
#include "engine/calib/hessian.h"
#include "engine/model/llama.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 8192;
  int64_t seq = 2048;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--seq") && i + 1 < argc) seq = std::atoll(argv[++i]);
  }
  qcal::model::SetComputeThreads(0);
  at::manual_seed(0);
  std::printf("threads: %d\n\n", at::get_num_threads());

  std::printf("Hessian accumulation, %lld tokens as sequences of %lld\n", (long long)tokens,
              (long long)seq);
  std::printf("%8s %16s %16s %14s %8s\n", "n", "fixed GFLOP/s", "fp64-sum GFLOP/s",
              "matmul GFLOP/s", "fixed/mm");
  for (int64_t n : {4096, 11008}) {
    at::Tensor x = at::randn({tokens / seq, seq, n});
    const double flops = 2.0 * tokens * n * n;
    // Best of 3 of: LibTorch's fp32 matmul on the same product (xᵀx over all rows, the peak);
    // the exact fixed-point accumulator (per-sequence fp32 products, 128-bit integer sums); the
    // previous scheme (per-sequence fp32 products summed into an fp64 matrix).
    double best_mm = 1e30, best_fixed = 1e30, best_f64 = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      at::Tensor rows = x.reshape({-1, n});
      // The matmul with every core through BLAS's threads; the accumulator pins BLAS to one
      // thread and spreads its tiles over LibTorch's threads (as in a job).
      qcal::kernels::SetBlasThreads(qcal::AvailableCpus());
      auto t0 = Clock::now();
      at::Tensor p = at::mm(rows.t(), rows);
      best_mm = std::min(best_mm, Since(t0));
      qcal::calib::HessianAccumulator acc(n);
      t0 = Clock::now();
      const qcal::Status st = acc.Add(x);
      best_fixed = std::min(best_fixed, Since(t0));
      if (!st.ok()) {
        std::fprintf(stderr, "Add failed: %s\n", st.ToString().c_str());
        return 1;
      }
      at::Tensor sum = at::zeros({n, n}, at::kDouble);
      qcal::kernels::SetBlasThreads(qcal::AvailableCpus());
      t0 = Clock::now();
      for (int64_t s = 0; s < x.size(0); ++s) sum.add_(at::mm(x[s].t(), x[s]));
      best_f64 = std::min(best_f64, Since(t0));
    }
    std::printf("%8lld %16.1f %16.1f %14.1f %7.0f%%\n", (long long)n, flops / best_fixed / 1e9,
                flops / best_f64 / 1e9, flops / best_mm / 1e9, 100.0 * best_mm / best_fixed);
  }
  return 0;
}
