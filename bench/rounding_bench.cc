// Hessian-aware rounding cost (kernels/rounding.h) against one dense matmul of the same shape.
//
//   build-quant/bench/bench_rounding --benchmark_filter='n:4096/'
//   build-quant/bench/bench_rounding --benchmark_filter='n:11008'   # ~4.5 GB of fp64 buffers
//   build/bench/bench_rounding --benchmark_filter='m:28672'          # Llama-2-70B gate/up_proj
//   build/bench/bench_rounding --benchmark_filter=ClipSearch          # GPTQ's clip search
//   build/bench/bench_rounding --benchmark_filter=RtnClipSearchThreads  # RTN, 1 vs every CPU
//   build/bench/bench_rounding --benchmark_filter='m:1024/'           # the trellis encoder
//
// Arguments are {m = out_features, n = in_features}: W is [m, n], H is [n, n] (fp64). Every
// benchmark runs once per repetition (the work is seconds long) and reports wall time (BLAS uses
// OpenBLAS threads) plus the counter `x_sgemm` = time / time of one cblas_sgemm computing the
// [m, n] × [n, n] product in fp32 (2·m·n² flops), measured in the same process.
//
// H is synthetic and SPD: A Aᵀ / k + 0.01·I with A [n, k = 256] Gaussian, W Gaussian. The
// rounding cost does not depend on H's spectrum. Llama-2-70B's gate/up_proj shape (m = 28672,
// n = 8192) is registered; its down_proj (m = 8192, n = 28672: H alone is 28672² fp64 = 6.6 GB,
// the LDL another 6.6 GB) is not: it does not fit a 24 GB development machine beside the rest.
// The cost model is O(n³/3) for the factorization plus m·n² for the feedback.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/cpu.h"
#include "kernels/blas_threads.h"
#include "kernels/codebook.h"
#include "kernels/rounding.h"
#include "kernels/scalar_quant.h"

namespace {

using qcal::kernels::VectorCodebook;

struct Problem {
  std::vector<double> w, h;
  double sgemm_seconds = 0;
};

std::vector<double> Gaussian(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> v(count);
  for (auto& x : v) {
    const double u1 = (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    x = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  return v;
}

// The dense baseline uses every core through BLAS's own threads; the rounding kernels pin BLAS to
// one thread (as qcal does everywhere) and parallelise over their own row tasks.
double TimeSgemm(int64_t m, int64_t n) {
  qcal::kernels::SetBlasThreads(qcal::AvailableCpus());
  std::vector<float> a(m * n), b(n * n), c(m * n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : a) x = u(rng);
  for (auto& x : b) x = u(rng);
  double best = 1e30;
  for (int rep = 0; rep < 2; ++rep) {  // Best of 2 (the first warms up the threads).
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(n), 1.0f, a.data(), static_cast<int>(n), b.data(),
                static_cast<int>(n), 0.0f, c.data(), static_cast<int>(n));
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  benchmark::DoNotOptimize(c.data());
  qcal::kernels::PinBlasToOneThread();
  return best;
}

// One problem at a time (the 11008 one is ~2 GB): rebuilt when the shape changes.
Problem& GetProblem(int64_t m, int64_t n) {
  static std::pair<int64_t, int64_t> key{0, 0};
  static std::unique_ptr<Problem> p;
  if (!p || key != std::make_pair(m, n)) {
    p.reset();
    p = std::make_unique<Problem>();
    key = {m, n};
    p->w = Gaussian(m * n, 1);
    const int64_t k = 256;
    const std::vector<double> a = Gaussian(n * k, 2);
    p->h.assign(n * n, 0.0);
    cblas_dsyrk(CblasRowMajor, CblasLower, CblasNoTrans, static_cast<int>(n), static_cast<int>(k),
                1.0 / k, a.data(), static_cast<int>(k), 0.0, p->h.data(), static_cast<int>(n));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) p->h[j * n + i] = p->h[i * n + j];
      p->h[i * n + i] += 0.01;
    }
    p->sgemm_seconds = TimeSgemm(m, n);
  }
  return *p;
}

// A scalar integer grid as a dim-8 vector codebook (2 bits per coordinate, like QuIP#'s
// "halfint2" grid): the fallback when E8P is not available.
class HalfIntGrid8 final : public VectorCodebook {
 public:
  std::string name() const override { return "bench_halfint2_dim8"; }
  int dim() const override { return 8; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override { return 2.0; }
  double default_scale() const override { return 1.0; }
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override {
    for (int64_t v = 0; v < count; ++v) {
      uint32_t code = 0;
      for (int j = 0; j < 8; ++j) {
        const float k = std::min(std::max(std::floor(x[v * 8 + j]) + 0.5f, -1.5f), 1.5f);
        out[v * 8 + j] = k;
        code |= static_cast<uint32_t>(k + 1.5f) << (2 * j);
      }
      if (codes) codes[v] = code;
    }
  }
  void Decode(const uint32_t* codes, int64_t count, float* out) const override {
    for (int64_t v = 0; v < count; ++v) {
      for (int j = 0; j < 8; ++j)
        out[v * 8 + j] = static_cast<float>((codes[v] >> (2 * j)) & 3) - 1.5f;
    }
  }
};

const VectorCodebook& Codebook(bool e8p) {
  static std::unique_ptr<VectorCodebook> e8 = [] {
    auto cb = qcal::kernels::MakeCodebook("e8p");
    return cb.ok() ? std::move(cb).value() : nullptr;
  }();
  static HalfIntGrid8 grid;
  if (e8p && e8) return *e8;
  return grid;
}

void Finish(benchmark::State& state, const Problem& p, double seconds) {
  state.counters["sgemm_s"] = p.sgemm_seconds;
  state.counters["x_sgemm"] = seconds / p.sgemm_seconds;
}

template <typename Fn>
void RunTimed(benchmark::State& state, const Problem& p, Fn fn) {
  double total = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!fn()) {
      state.SkipWithError("rounding failed");
      return;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
    ++iters;
  }
  Finish(state, p, total / std::max<int64_t>(iters, 1));
}

void BM_Sgemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1);
  Problem& p = GetProblem(m, n);
  std::vector<float> a(m * n, 0.5f), b(n * n, 0.25f), c(m * n);
  qcal::kernels::SetBlasThreads(qcal::AvailableCpus());
  double total = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(n), 1.0f, a.data(), static_cast<int>(n), b.data(),
                static_cast<int>(n), 0.0f, c.data(), static_cast<int>(n));
    benchmark::DoNotOptimize(c.data());
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
    ++iters;
  }
  qcal::kernels::PinBlasToOneThread();
  state.counters["GFLOPS"] = 2.0 * m * n * n / (total / std::max<int64_t>(iters, 1)) * 1e-9;
  Finish(state, p, total / std::max<int64_t>(iters, 1));
}

void BM_Gptq(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1);
  Problem& p = GetProblem(m, n);
  qcal::kernels::ScalarRoundingConfig cfg;
  cfg.quant.bits = 4;
  cfg.quant.granularity = qcal::kernels::QuantGranularity::kPerChannel;
  cfg.act_order = state.range(2) != 0;
  RunTimed(state, p, [&] {
    auto r = qcal::kernels::Gptq(p.w.data(), m, n, p.h.data(), cfg);
    benchmark::DoNotOptimize(r.ok() ? r->w_hat.data() : nullptr);
    return r.ok();
  });
}

void BM_Ldlq(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1);
  Problem& p = GetProblem(m, n);
  qcal::kernels::ScalarRoundingConfig cfg;
  cfg.quant.bits = 4;
  cfg.quant.granularity = qcal::kernels::QuantGranularity::kPerChannel;
  RunTimed(state, p, [&] {
    auto r = qcal::kernels::Ldlq(p.w.data(), m, n, p.h.data(), cfg);
    benchmark::DoNotOptimize(r.ok() ? r->w_hat.data() : nullptr);
    return r.ok();
  });
}

void BM_BlockLdlq(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1);
  Problem& p = GetProblem(m, n);
  const VectorCodebook& cb = Codebook(state.range(2) != 0);
  state.SetLabel(cb.name());
  RunTimed(state, p, [&] {
    qcal::kernels::VectorRoundingConfig cfg;
    cfg.refine_sweeps = static_cast<int>(state.range(3));
    auto r = qcal::kernels::BlockLdlq(p.w.data(), m, n, p.h.data(), cb, cfg);
    if (r.ok() && cfg.refine_sweeps > 0) {
      state.counters["sweeps_run"] = r->refine.sweeps;
      state.counters["loss_ratio"] = r->refine.loss_after / r->refine.loss_before;
    }
    benchmark::DoNotOptimize(r.ok() ? r->w_hat.data() : nullptr);
    return r.ok();
  });
}

// BlockLDLQ with a QTIP trellis codebook (kernels/trellis.h, 1MAD code, L = 16, k bits): the
// Viterbi encoder's cost (two passes over 2^16 states per weight group of V, per tile) against
// the same sgemm; counter us_per_weight = wall time per weight (all cores, tiles over threads).
void BM_BlockLdlqTrellis(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  Problem& p = GetProblem(m, n);
  auto cb = qcal::kernels::MakeCodebook("qtip_1mad_l16_k" + std::to_string(k));
  if (!cb.ok()) {
    state.SkipWithError("no trellis codebook");
    return;
  }
  state.SetLabel((*cb)->name());
  RunTimed(state, p, [&] {
    qcal::kernels::VectorRoundingConfig cfg;
    auto r = qcal::kernels::BlockLdlq(p.w.data(), m, n, p.h.data(), **cb, cfg);
    benchmark::DoNotOptimize(r.ok() ? r->w_hat.data() : nullptr);
    if (r.ok()) {
      state.counters["us_per_weight"] =
          1e6 * (r->times.factor + r->times.round) / static_cast<double>(m * n);
    }
    return r.ok();
  });
}

// 4-bit symmetric per-channel grid with the clip search (grid 100, max shrink 0.8, norm 2.4).
qcal::kernels::ScalarQuantConfig ClipSearchGrid4() {
  qcal::kernels::ScalarQuantConfig c;
  c.bits = 4;
  c.symmetric = true;
  c.granularity = qcal::kernels::QuantGranularity::kPerChannel;
  c.clip_search = true;
  return c;
}

// GPTQ's clip search (4-bit symmetric per channel, grid 100, max shrink 0.8, norm 2.4: the
// gptq-4bit recipe) over `rows` Gaussian rows of `cols` weights on one thread, against an
// exhaustive search written here (every candidate's error summed over the whole row) timed in
// the same run: counter x_exhaustive = time / exhaustive time. Both must choose the same scales.
void BM_ClipSearch(benchmark::State& state) {
  using namespace qcal::kernels;
  const int64_t rows = state.range(0), cols = state.range(1);
  const double norm = static_cast<double>(state.range(2)) / 10.0;
  const std::vector<double> w = Gaussian(rows * cols, 3);
  ScalarQuantConfig c = ClipSearchGrid4();
  c.clip_search_norm = norm;
  const int32_t cmin = ScalarCodeMin(c), cmax = ScalarCodeMax(c);
  const int steps = static_cast<int>(c.clip_search_max_shrink * c.clip_search_grid);
  for (auto _ : state) {
    std::vector<double> fast(rows), slow(rows);
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rows; ++r) fast[r] = ComputeScalarQuantParams(&w[r * cols], cols, c).scale;
    const double t_fast =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rows; ++r) {
      const double* x = &w[r * cols];
      double lo = 0, hi = 0;
      for (int64_t j = 0; j < cols; ++j) {
        lo = std::min(lo, x[j]);
        hi = std::max(hi, x[j]);
      }
      double best = 0;
      for (int i = 0; i < steps; ++i) {
        const auto p = ScalarQuantParamsFromRange<double>(
            lo, hi, 1.0 - static_cast<double>(i) / c.clip_search_grid, c);
        double e = 0;
        for (int64_t j = 0; j < cols; ++j) {
          const double d = ScalarDequantizeCode(ScalarQuantizeCode(x[j], p, cmin, cmax), p) - x[j];
          e += std::pow(std::fabs(d), norm);
        }
        if (i == 0 || e < best) {
          best = e;
          slow[r] = p.scale;
        }
      }
    }
    const double t_slow =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (fast != slow) {
      state.SkipWithError("the early-stopping clip search chose other scales than the exhaustive one");
      return;
    }
    state.SetIterationTime(t_fast);
    state.counters["exhaustive_s"] = t_slow;
    state.counters["x_exhaustive"] = t_fast / t_slow;
    state.counters["ns_per_weight"] = 1e9 * t_fast / static_cast<double>(rows * cols);
  }
}

// RTN with the clip search (the rtn-4bit recipe's grid: 4-bit symmetric per channel, norm 2.4)
// on `rows` Gaussian rows of `cols` weights, on one thread and on every CPU of the process in the
// same run: counters one_thread_s, threads, x_one_thread = time on every CPU / time on one. Both
// must give the same codes and scales.
void BM_RtnClipSearchThreads(benchmark::State& state) {
  using namespace qcal::kernels;
  const int64_t rows = state.range(0), cols = state.range(1);
  const std::vector<double> w = Gaussian(rows * cols, 5);
  const ScalarQuantConfig c = ClipSearchGrid4();
  auto timed = [&](int threads, double* seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = RoundToNearest(w.data(), rows, cols, c, threads);
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  for (auto _ : state) {
    double t_one = 0, t_all = 0;
    auto one = timed(1, &t_one);
    auto all = timed(0, &t_all);
    if (!one.ok() || !all.ok() || one->codes != all->codes || one->scales != all->scales) {
      state.SkipWithError("RTN on every CPU differs from RTN on one thread");
      return;
    }
    state.SetIterationTime(t_all);
    state.counters["one_thread_s"] = t_one;
    state.counters["threads"] = qcal::AvailableCpus();
    state.counters["x_one_thread"] = t_all / t_one;
    state.counters["ns_per_weight_one_thread"] = 1e9 * t_one / static_cast<double>(rows * cols);
  }
}

}  // namespace

// Registered shape by shape (Sgemm, Gptq act_order 0|1, Ldlq, BlockLdlq halfint grid | E8P) so
// the synthetic problem is built once per shape.
int main(int argc, char** argv) {
  for (auto [m, n] : {std::pair<int64_t, int64_t>{4096, 4096}, {4096, 11008}, {28672, 8192}}) {
    auto setup = [](benchmark::internal::Benchmark* b) {
      b->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
    };
    setup(benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)->ArgNames({"m", "n"})->Args({m, n}));
    for (int64_t act_order : {0, 1}) {
      setup(benchmark::RegisterBenchmark("BM_Gptq", BM_Gptq)
                ->ArgNames({"m", "n", "act_order"})
                ->Args({m, n, act_order}));
    }
    setup(benchmark::RegisterBenchmark("BM_Ldlq", BM_Ldlq)->ArgNames({"m", "n"})->Args({m, n}));
    for (int64_t e8p : {0, 1}) {
      setup(benchmark::RegisterBenchmark("BM_BlockLdlq", BM_BlockLdlq)
                ->ArgNames({"m", "n", "e8p", "sweeps"})
                ->Args({m, n, e8p, 0}));
    }
    // The refinement sweeps' cost: BlockLDLQ-E8P followed by 1 and by 10 sweeps.
    for (int64_t sweeps : {1, 10}) {
      setup(benchmark::RegisterBenchmark("BM_BlockLdlq", BM_BlockLdlq)
                ->ArgNames({"m", "n", "e8p", "sweeps"})
                ->Args({m, n, 1, sweeps}));
    }
  }
  // The trellis encoder: 1024 × 1024 (about 25 s per k on 2 cores) and 4096 × 4096 (16× that).
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1024, 1024}, {4096, 4096}}) {
    auto setup = [](benchmark::internal::Benchmark* b) {
      b->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
    };
    if (m == 1024) {
      setup(benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)->ArgNames({"m", "n"})->Args({m, n}));
      setup(benchmark::RegisterBenchmark("BM_BlockLdlq", BM_BlockLdlq)
                ->ArgNames({"m", "n", "e8p", "sweeps"})
                ->Args({m, n, 1, 0}));
    }
    for (int64_t k : {2, 4}) {
      setup(benchmark::RegisterBenchmark("BM_BlockLdlqTrellis", BM_BlockLdlqTrellis)
                ->ArgNames({"m", "n", "k"})
                ->Args({m, n, k}));
    }
  }
  // GPTQ's clip search at Llama-70B row lengths (hidden 8192, intermediate 28672), norm 2.4.
  for (int64_t cols : {8192, 28672}) {
    benchmark::RegisterBenchmark("BM_ClipSearch", BM_ClipSearch)
        ->ArgNames({"rows", "cols", "norm_x10"})
        ->Args({32, cols, 24})
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kSecond);
  }
  // RTN's clip search on one thread vs every CPU: Mixtral-8x7B / Llama-3-8B expert rows (4096,
  // 14336 weights).
  for (int64_t cols : {4096, 14336}) {
    benchmark::RegisterBenchmark("BM_RtnClipSearchThreads", BM_RtnClipSearchThreads)
        ->ArgNames({"rows", "cols"})
        ->Args({256, cols})
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kSecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
