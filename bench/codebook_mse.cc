// codebook_mse: per-weight mean squared error of quantizing N(0,1) samples with each codebook at
// its best scale (QuIP# Figure 3). For a multiplier c the error is mean((Q(c·g)/c - g)^2); c is
// swept on a coarse grid, then a fine one around the best. RVQ codebooks also sweep the residual
// multiplier (alternating with the input scale).
//
// Trellis codebooks (kernels/trellis.h: 1mad, 3inst, hyb at L = 16, k = 2, 3, 4) see the first
// --trellis-weights of the same samples (Viterbi is about 50 µs per weight here) and sweep only
// ±10% around their default scale in 2.5% steps. The last column is the rate–distortion bound of
// a unit Gaussian, D(R) = 4^−R.
//
//   codebook_mse [--vectors N] [--seed S] [--trellis-weights W] [--json]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/codebook.h"
#include "kernels/e8_codebooks.h"

namespace {

using qcal::kernels::VectorCodebook;

double Mse(const VectorCodebook& cb, const std::vector<float>& g, double scale,
           std::vector<float>& buf) {
  const int64_t count = static_cast<int64_t>(g.size()) / cb.dim();
  for (size_t t = 0; t < g.size(); ++t) buf[t] = static_cast<float>(g[t] * scale);
  cb.Quantize(buf.data(), count, buf.data(), nullptr);
  double err = 0;
  for (size_t t = 0; t < g.size(); ++t) {
    const double e = buf[t] / scale - g[t];
    err += e * e;
  }
  return err / static_cast<double>(g.size());
}

struct Best {
  double value;
  double mse;
};

// Minimises f over a log-spaced coarse grid around `center` (×/÷ 2), then a linear fine grid of
// step 0.5% around the coarse optimum.
Best Sweep(const std::function<double(double)>& f, double center) {
  Best best{center, std::numeric_limits<double>::infinity()};
  for (int i = -8; i <= 8; ++i) {
    const double v = center * std::pow(2.0, i / 8.0);
    const double m = f(v);
    if (m < best.mse) best = {v, m};
  }
  const double coarse = best.value;
  for (int i = -10; i <= 10; ++i) {
    const double v = coarse * (1 + 0.005 * i);
    const double m = f(v);
    if (m < best.mse) best = {v, m};
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t vectors = 1 << 16;
  uint64_t seed = 1;
  bool json = false;
  int64_t trellis_weights = 1 << 15;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--vectors" && i + 1 < argc) {
      vectors = std::strtoll(argv[++i], nullptr, 10);
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--trellis-weights" && i + 1 < argc) {
      trellis_weights = std::strtoll(argv[++i], nullptr, 10);
    } else if (arg == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "usage: %s [--vectors N] [--seed S] [--trellis-weights W] [--json]\n",
                   argv[0]);
      return 2;
    }
  }
  if (vectors <= 0) {
    std::fprintf(stderr, "--vectors must be positive\n");
    return 2;
  }
  // 8 weights per vector for every codebook (the scalar grids see the same weights).
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> g(8 * vectors);
  for (auto& v : g) v = static_cast<float>(normal(rng));
  std::vector<float> buf(g.size());

  if (trellis_weights <= 0 || trellis_weights % 256 != 0 ||
      trellis_weights > static_cast<int64_t>(g.size())) {
    std::fprintf(stderr, "--trellis-weights must be a positive multiple of 256, at most 8·N\n");
    return 2;
  }
  const std::vector<float> g_trellis(g.begin(), g.begin() + trellis_weights);
  std::vector<float> buf_trellis(g_trellis.size());
  const char* names[] = {"e8p",          "halfint2",         "e8_1bit",          "rvq3_e8p_e8",
                         "halfint3",     "rvq4_e8p_e8p",     "halfint4",         "qtip_1mad_l16_k2",
                         "qtip_3inst_l16_k2", "qtip_hyb_l16_k2", "qtip_1mad_l16_k3", "qtip_3inst_l16_k3",
                         "qtip_hyb_l16_k3", "qtip_1mad_l16_k4", "qtip_3inst_l16_k4", "qtip_hyb_l16_k4"};
  if (!json) {
    std::printf("N(0,1), %lld weights, seed %llu\n", static_cast<long long>(g.size()),
                static_cast<unsigned long long>(seed));
    std::printf("%-18s %5s %12s %12s %11s %12s %11s %9s\n", "codebook", "bits", "best_scale",
                "resid_scale", "best_mse", "default_mse", "default", "D(R)");
  } else {
    std::printf("[\n");
  }
  bool first = true;
  for (const char* name : names) {
    auto made = qcal::kernels::MakeCodebook(name);
    if (!made.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, made.status().ToString().c_str());
      return 1;
    }
    std::unique_ptr<VectorCodebook> cb = std::move(made).value();
    const bool trellis = cb->joint_vectors() > 1;
    const std::vector<float>& samples = trellis ? g_trellis : g;
    std::vector<float>& scratch = trellis ? buf_trellis : buf;
    const double default_mse = Mse(*cb, samples, cb->default_scale(), scratch);
    Best best{};
    double resid = std::nan("");
    const auto* rvq = dynamic_cast<const qcal::kernels::RvqCodebook*>(cb.get());
    if (trellis) {
      best = {cb->default_scale(), default_mse};
      for (int i = -4; i <= 4; ++i) {
        if (i == 0) continue;
        const double v = cb->default_scale() * (1 + 0.025 * i);
        const double m = Mse(*cb, samples, v, scratch);
        if (m < best.mse) best = {v, m};
      }
    } else if (rvq == nullptr) {
      best = Sweep([&](double s) { return Mse(*cb, g, s, buf); }, cb->default_scale());
    } else {
      // Coordinate descent: input scale, residual multiplier, input scale again.
      qcal::kernels::RvqScales scales = rvq->scales();
      const auto with = [&](qcal::kernels::RvqScales sc) {
        return qcal::kernels::MakeRvqCodebook(name, sc).value();
      };
      for (int round = 0; round < 2; ++round) {
        auto fixed = with(scales);
        best = Sweep([&](double s) { return Mse(*fixed, g, s, buf); }, scales.input_scale);
        scales.input_scale = best.value;
        if (round == 1) break;
        const Best r = Sweep(
            [&](double rs) {
              return Mse(*with({scales.input_scale, rs}), g, scales.input_scale, buf);
            },
            scales.residual_scale);
        scales.residual_scale = r.value;
      }
      resid = scales.residual_scale;
    }
    if (json) {
      std::printf(
          "%s  {\"codebook\": \"%s\", \"bits\": %g, \"best_scale\": %.4f, "
          "\"resid_scale\": %s, \"best_mse\": %.6f, \"default_scale\": %.4f, "
          "\"default_mse\": %.6f}",
          first ? "" : ",\n", name, cb->bits_per_weight(), best.value,
          std::isnan(resid) ? "null" : std::to_string(resid).c_str(), best.mse, cb->default_scale(),
          default_mse);
    } else {
      char rs[32] = "-";
      if (!std::isnan(resid)) std::snprintf(rs, sizeof rs, "%.3f", resid);
      std::printf("%-18s %5g %12.4f %12s %11.6f %12.6f %11.4f %9.6f\n", name,
                  cb->bits_per_weight(), best.value, rs, best.mse, default_mse,
                  cb->default_scale(), std::pow(4.0, -cb->bits_per_weight()));
    }
    std::fflush(stdout);
    first = false;
  }
  if (json) std::printf("\n]\n");
  return 0;
}
