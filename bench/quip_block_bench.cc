// Reports (not asserts) the QuIP# quantization time (no fine-tuning) of one Llama-shaped decoder
// block with random weights and synthetic Hessians, per linear and for the block, with the peak
// resident memory, and extrapolates to the whole model. No 7B/70B checkpoint can be fetched here;
// the weights are N(0, 0.02²) and each Hessian is A Aᵀ / 256 + 1e-3 I with A [n, 256] Gaussian
// with a decaying column scale (a low-rank-plus-ridge spectrum like real activations').
//
// It calls the same rounding core as the job (methods/quip/quip_rounding.h: padding, IP-RHT,
// per-row scales, BlockLDLQ with E8P, proxy loss) and links no LibTorch, so it also runs on a
// machine that has only BLAS/LAPACK.
//
//   bench_quip_block [--shape 7b|70b] [--linears q,k,v,o,gate,up,down] [--codebook e8p]
//                    [--threads N]
//
// Shapes: 7b = Llama-2-7B (hidden 4096, intermediate 11008, 32 heads, 32 layers);
//         70b = Llama-2-70B (hidden 8192, intermediate 28672, 64 heads, GQA 8 → k/v 1024 rows,
//         80 layers).
#include <sys/resource.h>

#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "methods/quip/quip_rounding.h"

extern "C" void openblas_set_num_threads(int);

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double PeakRssGb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

struct Shape {
  const char* name;
  int64_t hidden, intermediate, kv_rows, layers;
};

struct LinearSpec {
  const char* name;
  int64_t out, in;
  int hessian;  // 0 qkv, 1 o, 2 gate/up, 3 down
};

std::vector<double> SyntheticHessian(int64_t n, std::mt19937_64& rng) {
  const int64_t k = 256;
  std::vector<double> a(n * k);
  std::normal_distribution<double> normal;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < k; ++j) a[i * k + j] = normal(rng) * (1.0 - 0.95 * j / (k - 1.0));
  }
  std::vector<double> h(n * n, 0.0);
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, static_cast<int>(n), static_cast<int>(k),
              1.0 / k, a.data(), static_cast<int>(k), 0.0, h.data(), static_cast<int>(n));
  for (int64_t i = 0; i < n; ++i) {
    h[i * n + i] += 1e-3;
    for (int64_t j = 0; j < i; ++j) h[i * n + j] = h[j * n + i];
  }
  return h;
}

std::vector<double> RandomWeights(int64_t out, int64_t in, std::mt19937_64& rng) {
  std::vector<double> w(out * in);
  std::normal_distribution<double> normal(0.0, 0.02);
  for (double& v : w) v = normal(rng);
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "7b", codebook = "e8p";
  std::string linears = "q,k,v,o,gate,up,down";
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--shape")) {
      shape_name = next("--shape");
    } else if (!std::strcmp(argv[i], "--linears")) {
      linears = next("--linears");
    } else if (!std::strcmp(argv[i], "--codebook")) {
      codebook = next("--codebook");
    } else if (!std::strcmp(argv[i], "--threads")) {
      threads = std::atoi(next("--threads"));
    } else {
      std::fprintf(stderr,
                   "usage: %s [--shape 7b|70b] [--linears q,k,v,o,gate,up,down] "
                   "[--codebook e8p] [--threads N]\n",
                   argv[0]);
      return 2;
    }
  }
  Shape shape;
  if (shape_name == "7b") {
    shape = {"Llama-2-7B", 4096, 11008, 4096, 32};
  } else if (shape_name == "70b") {
    shape = {"Llama-2-70B", 8192, 28672, 1024, 80};
  } else {
    std::fprintf(stderr, "--shape must be 7b or 70b, not '%s'\n", shape_name.c_str());
    return 2;
  }
  std::set<std::string> wanted;
  {
    std::stringstream ss(linears);
    for (std::string item; std::getline(ss, item, ',');) wanted.insert(item);
  }
  openblas_set_num_threads(threads);
  const int64_t d = shape.hidden, f = shape.intermediate;
  const LinearSpec specs[7] = {{"q", d, d, 0},         {"k", shape.kv_rows, d, 0},
                               {"v", shape.kv_rows, d, 0}, {"o", d, d, 1},
                               {"gate", f, d, 2},      {"up", f, d, 2},
                               {"down", d, f, 3}};
  for (const std::string& name : wanted) {
    bool known = false;
    for (const auto& s : specs) known = known || name == s.name;
    if (!known) {
      std::fprintf(stderr, "unknown linear '%s' (q,k,v,o,gate,up,down)\n", name.c_str());
      return 2;
    }
  }
  std::printf("QuIP# %s, one %s-shaped block (random W, synthetic H), %d threads\n",
              codebook.c_str(), shape.name, threads);
  std::printf("%-6s %7s %7s %10s %12s %12s %10s\n", "linear", "out", "in", "seconds",
              "rel. proxy", "code bits", "peak GB");
  std::mt19937_64 rng(0);
  std::vector<double> h;
  int h_kind = -1;
  double total = 0;
  for (const auto& spec : specs) {
    if (!wanted.count(spec.name)) continue;
    if (spec.hessian != h_kind) {
      h = std::vector<double>();
      h = SyntheticHessian(spec.in, rng);
      h_kind = spec.hessian;
    }
    std::vector<double> w = RandomWeights(spec.out, spec.in, rng);
    qcal::methods::quip::QuipRoundingOptions options;
    options.codebook = codebook;
    options.seed_u = 1000 + spec.hessian * 2;
    options.seed_v = 1001 + spec.hessian * 2;
    options.num_threads = threads;
    const auto t0 = Clock::now();
    auto r = qcal::methods::quip::RoundQuipLinear(w.data(), spec.out, spec.in, h.data(), options);
    const double secs = Since(t0);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", spec.name, r.status().ToString().c_str());
      return 1;
    }
    total += secs;
    std::printf("%-6s %7lld %7lld %10.1f %12.4f %12.3f %10.1f\n", spec.name,
                static_cast<long long>(spec.out), static_cast<long long>(spec.in), secs,
                r->relative, r->code_bits, PeakRssGb());
    std::fflush(stdout);
  }
  std::printf("linears run: %.1f s", total);
  if (wanted.size() == 7) {
    std::printf("; whole model (%lld blocks): %.1f min", static_cast<long long>(shape.layers),
                shape.layers * total / 60.0);
  }
  std::printf("; peak resident %.1f GB\n", PeakRssGb());
  return 0;
}
