#include "engine/qsim/token_outliers.h"

#include <algorithm>
#include <cmath>

namespace qcal::qsim {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

double TokenOutlierReport::MaxRatio() const {
  double m = 0;
  for (const TokenOutlierLayer& l : layers) m = std::max(m, l.max_ratio);
  return m;
}

TokenOutlierReport NewTokenOutlierReport(int64_t layers, double eta) {
  TokenOutlierReport r;
  r.eta = eta;
  r.layers.resize(layers);
  return r;
}

void AddTokenOutliers(TokenOutlierReport* r, int64_t l, const double* token_max,
                      const int32_t* ids, int64_t n) {
  if (l == 0) {
    ++r->sequences;
    r->tokens += n;
  }
  const double median = Median(std::vector<double>(token_max, token_max + n));
  TokenOutlierLayer& layer = r->layers[l];
  for (int64_t i = 0; i < n; ++i) {
    const double ratio = median > 0 ? token_max[i] / median : (token_max[i] > 0 ? INFINITY : 0.0);
    if (ratio > layer.max_ratio) {
      layer.max_ratio = ratio;
      layer.max_token = ids[i];
      layer.max_position = i;
    }
    double& by_token = layer.ratio_by_token[ids[i]];
    by_token = std::max(by_token, ratio);
    if (i > 0) layer.max_ratio_after_first = std::max(layer.max_ratio_after_first, ratio);
    if (ratio > r->eta) {
      ++layer.count;
      if (i > 0) ++r->outlier_id_counts[ids[i]];
    }
  }
}

void FinishTokenOutliers(TokenOutlierReport* r) {
  double max_mean = 0;
  for (TokenOutlierLayer& layer : r->layers) {
    layer.mean_count = r->sequences > 0 ? static_cast<double>(layer.count) / r->sequences : 0.0;
    max_mean = std::max(max_mean, layer.mean_count);
  }
  r->o = static_cast<int64_t>(std::ceil(max_mean - 1e-12));
}

std::vector<int32_t> PrefixTokens(const TokenOutlierReport& report, int32_t bos_id) {
  std::vector<std::pair<int64_t, int32_t>> by_count;  // (-count, id): most frequent first
  for (const auto& [id, count] : report.outlier_id_counts) by_count.push_back({-count, id});
  std::sort(by_count.begin(), by_count.end());
  int64_t o = report.o;
  // The reference drops a lone id seen in fewer than a tenth of the sequences.
  if (by_count.size() == 1 && -by_count[0].first < 0.1 * report.sequences) {
    by_count.clear();
    o = std::max<int64_t>(0, o - 1);
  }
  std::vector<int32_t> prefix;
  for (size_t i = 0; i < by_count.size() && static_cast<int64_t>(i) < o; ++i) {
    prefix.push_back(by_count[i].second);
  }
  prefix.push_back(bos_id);
  return prefix;
}

}  // namespace qcal::qsim
