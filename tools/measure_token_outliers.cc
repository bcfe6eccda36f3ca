#include "tools/measure_token_outliers.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "tools/observing_linear.h"

namespace qcal::tools {
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
  TokenOutlierReport r = qsim::NewTokenOutlierReport(L, eta);
  {
    at::NoGradGuard no_grad;
    for (const std::vector<int32_t>& seq : sequences) {
      std::vector<int64_t> ids(seq.begin(), seq.end());
      const int64_t n = static_cast<int64_t>(ids.size());
      m.Forward(at::from_blob(ids.data(), {1, n}, at::kLong).clone());
      for (int64_t l = 0; l < L; ++l) {
        const at::Tensor t = token_max[l].reshape({-1}).contiguous();
        qsim::AddTokenOutliers(&r, l, t.data_ptr<double>(), seq.data(), n);
      }
    }
  }
  for (int64_t l = 0; l < L; ++l) Unobserve(m, l, down);
  qsim::FinishTokenOutliers(&r);
  return r;
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
