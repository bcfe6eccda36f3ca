#include "engine/model/linear_slots.h"

namespace qcal::model {

void ForEachLinearSlot(
    BlockWeights& weights,
    const std::function<void(LinearKind role, int64_t expert, std::unique_ptr<Linear>& slot)>& fn) {
  for (LinearKind k : kAllLinears) {
    auto& slot = weights.linears[static_cast<int>(k)];
    if (slot != nullptr) fn(k, -1, slot);
  }
  if (weights.moe == nullptr) return;
  for (size_t e = 0; e < weights.moe->experts.size(); ++e) {
    for (ExpertLinear k : kExpertLinears) {
      fn(ExpertLinearKind(k), static_cast<int64_t>(e),
         weights.moe->experts[e].linears[static_cast<int>(k)]);
    }
  }
}

}  // namespace qcal::model
