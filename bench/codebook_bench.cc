// E8P encode/decode throughput: the exact fast encoder (2 × 256 source rows) against the
// brute-force scan of all 65,536 points, both exact. Run e.g.
//   build/bench/bench_codebook --benchmark_min_time=0.2
// items_per_second is vectors (8 weights) per second; BM_E8pEncodeSpeedup reports the ratio.
// BM_TrellisEncodeWidth: the trellis encoder's vector widths side by side.
#include <benchmark/benchmark.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "kernels/e8_codebooks.h"
#include "kernels/e8p.h"
#include "kernels/trellis.h"

namespace {

using qcal::kernels::E8pCodebook;

std::vector<float> GaussianVectors(int64_t count, double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> x(8 * count);
  for (auto& v : x) v = static_cast<float>(scale * normal(rng));
  return x;
}

const E8pCodebook& Codebook() {
  static const E8pCodebook* cb = [] {
    auto* c = new E8pCodebook();
    c->expanded();  // build the brute-force tables outside the timed region
    return c;
  }();
  return *cb;
}

void BM_E8pEncodeFast(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto x = GaussianVectors(n, E8pCodebook::kDefaultScale, 1);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(n);
  const E8pCodebook& cb = Codebook();
  for (auto _ : state) {
    cb.Quantize(x.data(), n, out.data(), codes.data());
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_E8pEncodeFast)->Arg(4096);

void BM_E8pEncodeBruteForce(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto x = GaussianVectors(n, E8pCodebook::kDefaultScale, 1);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(n);
  const E8pCodebook& cb = Codebook();
  for (auto _ : state) {
    cb.QuantizeBruteForce(x.data(), n, out.data(), codes.data());
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_E8pEncodeBruteForce)->Arg(256)->Unit(benchmark::kMillisecond);

// Times both encoders on the same vectors in each iteration and reports their rates and ratio.
void BM_E8pEncodeSpeedup(benchmark::State& state) {
  const int64_t n = 512;
  const auto x = GaussianVectors(n, E8pCodebook::kDefaultScale, 2);
  std::vector<float> out(x.size());
  std::vector<uint32_t> fast_codes(n), brute_codes(n);
  const E8pCodebook& cb = Codebook();
  double fast_s = 0, brute_s = 0, scan_s = 0;
  int64_t mismatches = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    cb.Quantize(x.data(), n, out.data(), fast_codes.data());
    const auto t1 = std::chrono::steady_clock::now();
    cb.QuantizeBruteForce(x.data(), n, out.data(), brute_codes.data());
    const auto t2 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) cb.EncodeOneByScan(&x[8 * i], &out[8 * i]);
    const auto t3 = std::chrono::steady_clock::now();
    fast_s += std::chrono::duration<double>(t1 - t0).count();
    brute_s += std::chrono::duration<double>(t2 - t1).count();
    scan_s += std::chrono::duration<double>(t3 - t2).count();
    for (int64_t i = 0; i < n; ++i) mismatches += fast_codes[i] != brute_codes[i];
  }
  const double vectors = static_cast<double>(state.iterations() * n);
  state.counters["fast_vec_per_s"] = vectors / fast_s;
  state.counters["scan_vec_per_s"] = vectors / scan_s;  // the exact scan alone (the fallback)
  state.counters["brute_vec_per_s"] = vectors / brute_s;
  state.counters["speedup"] = brute_s / fast_s;
  state.counters["mismatches"] = static_cast<double>(mismatches);
}
BENCHMARK(BM_E8pEncodeSpeedup)->Unit(benchmark::kMillisecond);

void BM_E8pDecode(benchmark::State& state) {
  const int64_t n = 4096;
  std::vector<uint32_t> codes(n);
  std::mt19937_64 rng(3);
  for (auto& c : codes) c = static_cast<uint32_t>(rng() & 0xFFFF);
  std::vector<float> out(8 * n);
  const E8pCodebook& cb = Codebook();
  for (auto _ : state) {
    cb.Decode(codes.data(), n, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_E8pDecode);

void BM_RvqQuantize(benchmark::State& state) {
  const char* name = state.range(0) == 3 ? "rvq3_e8p_e8" : "rvq4_e8p_e8p";
  auto cb = qcal::kernels::MakeCodebook(name).value();
  const int64_t n = 2048;
  const auto x = GaussianVectors(n, cb->default_scale(), 4);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(2 * n);
  for (auto _ : state) {
    cb->Quantize(x.data(), n, out.data(), codes.data());
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetLabel(name);
}
BENCHMARK(BM_RvqQuantize)->Arg(3)->Arg(4);

// The trellis Viterbi encoder (kernels/trellis.h, L = 16) at each vector width this CPU runs
// (state.range(1) lanes: 16 AVX-512F, 8 AVX2, 4 the baseline) against the 4-lane pass timed on the
// same tiles in the same iteration, one thread: counters us_per_weight and x_4lanes (time / the
// 4-lane time). The two must give the same codes (else the benchmark fails).
void BM_TrellisEncodeWidth(benchmark::State& state) {
  static const char* kNames[] = {"qtip_1mad_l16_k2", "qtip_1mad_l16_k4", "qtip_hyb_l16_k2"};
  const char* name = kNames[state.range(0)];
  const int lanes = static_cast<int>(state.range(1));
  auto p = qcal::kernels::ParseTrellisName(name).value();
  p.lanes = lanes;
  const qcal::kernels::TrellisCodebook wide(p);
  p.lanes = 4;
  const qcal::kernels::TrellisCodebook base(p);
  state.SetLabel(std::string(name) + " at " + std::to_string(lanes) + " lanes");
  if (wide.lanes() != lanes) {
    state.SkipWithError("this CPU does not run that width");
    return;
  }
  const int64_t rows = 4 * qcal::kernels::TrellisCodebook::kTileRows;  // 4 tiles, 1024 weights
  const auto x = GaussianVectors(rows, wide.default_scale(), 6);
  std::vector<float> out(x.size());
  std::vector<uint32_t> codes(rows * p.k), base_codes(rows * p.k);
  double wide_s = 0, base_s = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    wide.Quantize(x.data(), rows, out.data(), codes.data());
    const auto t1 = std::chrono::steady_clock::now();
    base.Quantize(x.data(), rows, out.data(), base_codes.data());
    const auto t2 = std::chrono::steady_clock::now();
    wide_s += std::chrono::duration<double>(t1 - t0).count();
    base_s += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    if (codes != base_codes) {
      state.SkipWithError("the wide pass chose other codes than the 4-lane pass");
      return;
    }
  }
  const double weights = static_cast<double>(state.iterations() * x.size());
  state.counters["us_per_weight"] = 1e6 * wide_s / weights;
  state.counters["x_4lanes"] = wide_s / base_s;
}
BENCHMARK(BM_TrellisEncodeWidth)
    ->ArgNames({"code", "lanes"})
    ->ArgsProduct({{0, 1, 2}, {16, 8, 4}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
