#include "tools/outlier_stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "tools/observing_linear.h"

namespace qcal::tools {
namespace {

double RatioOf(const at::Tensor& channel_max) {
  at::Tensor d = channel_max.to(at::kDouble).contiguous();
  std::vector<double> v(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  return MaxOverMedian(std::move(v));
}

}  // namespace

LayerOutlierStats OutlierStats::Max() const {
  LayerOutlierStats m;
  for (const LayerOutlierStats& l : layers) {
    m.down_input = std::max(m.down_input, l.down_input);
    m.o_input = std::max(m.o_input, l.o_input);
    m.k = std::max(m.k, l.k);
  }
  return m;
}

double MaxOverMedian(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  const double max = v.back();
  if (max == 0) return 0;
  if (median == 0) return std::numeric_limits<double>::infinity();
  return max / median;
}

StatusOr<OutlierStats> MeasureOutlierStats(model::LlamaModel& m, const std::vector<int32_t>& tokens,
                                           int64_t ctx, int32_t bos_id) {
  if (ctx < 2 || ctx > m.config().max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("ctx ", ctx, ": must be in [2, ", m.config().max_position_embeddings, "]"));
  }
  if (tokens.empty()) return absl::InvalidArgumentError("no tokens to measure outliers on");
  using model::LinearKind;
  constexpr LinearKind kKinds[3] = {LinearKind::kDown, LinearKind::kO, LinearKind::kK};
  const int64_t L = m.num_blocks();
  std::vector<at::Tensor> acc(3 * L);
  auto unobserve_all = [&] {
    for (int64_t l = 0; l < L; ++l) {
      for (LinearKind k : kKinds) Unobserve(m, l, k);
    }
  };
  for (int64_t l = 0; l < L; ++l) {
    for (int i = 0; i < 3; ++i) {
      // The running per-channel max |x| of the input (K: of the output).
      const bool output = kKinds[i] == LinearKind::kK;
      Status s = Observe(m, l, kKinds[i],
                         [a = &acc[3 * l + i], output](const at::Tensor& x, const at::Tensor& y) {
                           const at::Tensor& seen = output ? y : x;
                           at::Tensor mx =
                               std::get<0>(seen.abs().reshape({-1, seen.size(-1)}).max(0));
                           *a = a->defined() ? at::maximum(*a, mx) : mx;
                         });
      if (!s.ok()) {
        unobserve_all();
        return s;
      }
    }
  }
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t s = 0; s < n; s += ctx - 1) {
    const int64_t len = std::min(ctx - 1, n - s);
    std::vector<int64_t> ids = {bos_id};
    ids.insert(ids.end(), tokens.begin() + s, tokens.begin() + s + len);
    at::Tensor input =
        at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong).clone();
    m.Forward(input);
  }
  OutlierStats stats;
  stats.tokens = n;
  for (int64_t l = 0; l < L; ++l) {
    LayerOutlierStats ls;
    double* out[3] = {&ls.down_input, &ls.o_input, &ls.k};
    for (int i = 0; i < 3; ++i) {
      Unobserve(m, l, kKinds[i]);
      *out[i] = RatioOf(acc[3 * l + i]);
    }
    stats.layers.push_back(ls);
  }
  return stats;
}

}  // namespace qcal::tools
