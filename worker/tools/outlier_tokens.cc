#include "worker/tools/outlier_tokens.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "worker/tools/observing_linear.h"

namespace qcal::tools {
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

StatusOr<TokenOutlierReport> MeasureTokenOutliers(model::LlamaModel& m,
                                                  const std::vector<std::vector<int32_t>>& sequences,
                                                  double eta) {
  if (!(eta > 0)) return absl::InvalidArgumentError(absl::StrCat("outlier threshold ", eta, " <= 0"));
  if (sequences.empty()) return absl::InvalidArgumentError("no sequences to measure outliers on");
  const int64_t context = m.config().max_position_embeddings;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const int64_t n = static_cast<int64_t>(sequences[i].size());
    if (n < 2 || n > context) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " has ", n,
                                                     " tokens; need 2 to ", context));
    }
  }
  const int64_t L = m.num_blocks();
  const model::LinearKind down = model::LinearKind::kDown;
  std::vector<at::Tensor> token_max(L);
  for (int64_t l = 0; l < L; ++l) {
    Status s = Observe(m, l, down, [t = &token_max[l]](const at::Tensor& x, const at::Tensor&) {
      *t = std::get<0>(x.abs().max(-1)).to(at::kDouble);
    });
    if (!s.ok()) {
      for (int64_t i = 0; i < l; ++i) Unobserve(m, i, down);
      return s;
    }
  }
  TokenOutlierReport r;
  r.eta = eta;
  r.sequences = static_cast<int64_t>(sequences.size());
  r.layers.resize(L);
  std::vector<int64_t> count_sum(L, 0);
  {
    at::NoGradGuard no_grad;
    for (const std::vector<int32_t>& seq : sequences) {
      std::vector<int64_t> ids(seq.begin(), seq.end());
      const int64_t n = static_cast<int64_t>(ids.size());
      r.tokens += n;
      m.Forward(at::from_blob(ids.data(), {1, n}, at::kLong).clone());
      for (int64_t l = 0; l < L; ++l) {
        const at::Tensor t = token_max[l].reshape({-1}).contiguous();
        const double* p = t.data_ptr<double>();
        std::vector<double> mt(p, p + n);
        const double median = Median(mt);
        TokenOutlierLayer& layer = r.layers[l];
        for (int64_t i = 0; i < n; ++i) {
          const double ratio = median > 0 ? mt[i] / median
                                          : (mt[i] > 0 ? INFINITY : 0.0);
          if (ratio > layer.max_ratio) {
            layer.max_ratio = ratio;
            layer.max_token = seq[i];
            layer.max_position = i;
          }
          double& by_token = layer.ratio_by_token[seq[i]];
          by_token = std::max(by_token, ratio);
          if (i > 0) layer.max_ratio_after_first = std::max(layer.max_ratio_after_first, ratio);
          if (ratio > eta) {
            ++count_sum[l];
            if (i > 0) ++r.outlier_id_counts[seq[i]];
          }
        }
      }
    }
  }
  double max_mean = 0;
  for (int64_t l = 0; l < L; ++l) {
    Unobserve(m, l, down);
    r.layers[l].mean_count = static_cast<double>(count_sum[l]) / r.sequences;
    max_mean = std::max(max_mean, r.layers[l].mean_count);
  }
  r.o = static_cast<int64_t>(std::ceil(max_mean - 1e-12));
  return r;
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

std::vector<std::vector<int32_t>> TextWindows(const std::vector<int32_t>& tokens, int64_t ctx,
                                              bool with_bos, int32_t bos_id,
                                              int64_t max_windows) {
  std::vector<std::vector<int32_t>> out;
  const int64_t step = with_bos ? ctx - 1 : ctx;
  if (step < 1) return out;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t s = 0; s < n; s += step) {
    if (max_windows > 0 && static_cast<int64_t>(out.size()) >= max_windows) break;
    const int64_t len = std::min(step, n - s);
    std::vector<int32_t> w;
    if (with_bos) w.push_back(bos_id);
    w.insert(w.end(), tokens.begin() + s, tokens.begin() + s + len);
    if (w.size() >= 2) out.push_back(std::move(w));
  }
  return out;
}

}  // namespace qcal::tools
