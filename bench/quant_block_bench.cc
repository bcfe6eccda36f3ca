// Reports (not asserts) two costs of a quantization job on Llama-shaped layers with random
// weights and synthetic Hessians (no 7B/70B checkpoint can be fetched here):
//  1. Hessian accumulation throughput (GFLOP/s of x xᵀ): the exact fixed-point accumulator and
//     the previous fp64 running sum, against LibTorch's fp32 matmul on the same shapes, measured
//     in the same run.
//  2. Wall time to quantize one Llama-2-7B-shaped decoder block (hidden 4096, intermediate 11008)
//     with QuIP# E8P 2-bit, no fine-tuning, and its extrapolation to the 32 blocks of the model.
//
//   build/bench/bench_quant_block [--tokens 8192] [--seq 2048] [--skip-block]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/recipe.h"
#include "worker/calib/hessian.h"
#include "worker/model/llama.h"
#include "worker/quant/block_task.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Synthetic SPD Hessian with a decaying spectrum: A Aᵀ / k + 1e-3 I, A [n, k] Gaussian.
at::Tensor SyntheticHessian(int64_t n) {
  at::Tensor a = at::randn({n, 256}, at::kDouble) * at::linspace(1.0, 0.05, 256, at::kDouble);
  return at::matmul(a, a.t()) / 256.0 + 1e-3 * at::eye(n, at::kDouble);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 8192;
  int64_t seq = 2048;
  bool skip_block = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--seq") && i + 1 < argc) seq = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--skip-block")) skip_block = true;
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
      t0 = Clock::now();
      for (int64_t s = 0; s < x.size(0); ++s) sum.add_(at::mm(x[s].t(), x[s]));
      best_f64 = std::min(best_f64, Since(t0));
    }
    std::printf("%8lld %16.1f %16.1f %14.1f %7.0f%%\n", (long long)n, flops / best_fixed / 1e9,
                flops / best_f64 / 1e9, flops / best_mm / 1e9, 100.0 * best_mm / best_fixed);
  }
  if (skip_block) return 0;

  std::printf("\nQuIP# E8P 2-bit, one Llama-2-7B-shaped block (random weights, synthetic H)\n");
  qcal::LlamaConfig config;
  config.hidden_size = 4096;
  config.intermediate_size = 11008;
  config.num_hidden_layers = 32;
  config.num_attention_heads = 32;
  config.num_key_value_heads = 32;
  config.head_dim = 128;
  qcal::model::BlockWeights w;
  w.input_norm = at::ones({4096});
  w.post_norm = at::ones({4096});
  const std::pair<int64_t, int64_t> shapes[7] = {{4096, 4096}, {4096, 4096},  {4096, 4096},
                                                 {4096, 4096}, {11008, 4096}, {11008, 4096},
                                                 {4096, 11008}};
  for (int i = 0; i < 7; ++i) {
    w.linears[i] = std::make_unique<qcal::model::DenseLinear>(
        at::randn({shapes[i].first, shapes[i].second}) * 0.02);
  }
  qcal::calib::BlockHessians h;
  for (auto kind : qcal::calib::kAllHessianKinds) {
    const int64_t n = kind == qcal::calib::HessianKind::kDown ? 11008 : 4096;
    h.at(kind) = qcal::calib::HessianAccumulator::FromSum(SyntheticHessian(n), 1).value();
  }
  qcal::Recipe recipe;
  recipe.method = qcal::QuantMethod::kQuip;
  recipe.bits = 2;
  recipe.codebook = "e8p";
  const auto t0 = Clock::now();
  auto r = qcal::quant::QuantizeBlock(recipe, config, 0, w, &h);
  const double secs = Since(t0);
  if (!r.ok()) {
    std::fprintf(stderr, "QuantizeBlock failed: %s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  for (const auto& m : r->linears) {
    std::printf("  %-18s %7.1f s  relative proxy %.4f\n", m.name.c_str(), m.seconds, m.relative);
  }
  std::printf("block: %.1f s; 32 blocks (Llama-2-7B): %.1f min on this machine\n", secs,
              32 * secs / 60);
  return 0;
}
