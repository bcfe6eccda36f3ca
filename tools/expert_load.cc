#include "tools/expert_load.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::tools {

int64_t ExpertLoad::Layer::min() const {
  return counts.empty() ? 0 : *std::min_element(counts.begin(), counts.end());
}
int64_t ExpertLoad::Layer::max() const {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}
std::vector<int64_t> ExpertLoad::Layer::Unrouted() const { return BelowRank(1); }
std::vector<int64_t> ExpertLoad::Layer::BelowRank(int64_t inputs) const {
  std::vector<int64_t> out;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] < inputs) out.push_back(static_cast<int64_t>(e));
  }
  return out;
}

StatusOr<ExpertLoad> MeasureExpertLoad(model::LlamaModel& model,
                                       const std::vector<std::vector<int32_t>>& windows) {
  const LlamaConfig& c = model.config();
  if (!c.is_moe()) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.architecture, " is not a mixture-of-experts model: no routing to count"));
  }
  if (windows.empty()) return absl::InvalidArgumentError("no text to route (no windows)");
  for (const auto& w : windows) {
    if (w.empty() || static_cast<int64_t>(w.size()) > c.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat("a window of ", w.size(),
                                                     " tokens; expected 1 to ",
                                                     c.max_position_embeddings));
    }
    for (int32_t t : w) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " outside the vocabulary of ", c.vocab_size));
      }
    }
  }
  ExpertLoad load;
  load.top_k = c.experts_per_token;
  load.inputs = c.hidden_size;
  std::vector<model::BlockHooks> saved;
  for (int64_t l = 0; l < model.num_blocks(); ++l) {
    saved.push_back(model.block(l).hooks());
    if (!model.block(l).is_moe()) continue;
    load.layers.push_back({l, std::vector<int64_t>(c.num_experts, 0)});
    const size_t index = load.layers.size() - 1;  // (the vector grows: no pointers into it)
    model::BlockHooks hooks = saved.back();
    hooks.on_routing = [&load, index](const model::Routing& r) {
      const at::Tensor chosen = r.experts.to(at::kCPU).contiguous();
      const int64_t* e = chosen.data_ptr<int64_t>();
      std::vector<int64_t>& counts = load.layers[index].counts;
      for (int64_t i = 0; i < chosen.numel(); ++i) ++counts[e[i]];
    };
    model.mutable_block(l).set_hooks(std::move(hooks));
  }
  for (const auto& w : windows) {
    std::vector<int64_t> ids(w.begin(), w.end());
    model.Forward(at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong)
                      .clone());
    load.tokens += static_cast<int64_t>(ids.size());
  }
  for (int64_t l = 0; l < model.num_blocks(); ++l) model.mutable_block(l).set_hooks(saved[l]);
  return load;
}

}  // namespace qcal::tools
