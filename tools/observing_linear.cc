#include "tools/observing_linear.h"

#include "absl/strings/str_cat.h"

namespace qcal::tools {

Status Observe(model::LlamaModel& model, int64_t layer, model::LinearKind kind,
               LinearObserver observer) {
  auto& slot = model.mutable_block(layer).mutable_weights().linears[static_cast<int>(kind)];
  if (!slot) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " has no ", model::LinearName(kind)));
  }
  slot = std::make_unique<ObservingLinear>(std::move(slot), std::move(observer));
  return Status();
}

void Unobserve(model::LlamaModel& model, int64_t layer, model::LinearKind kind) {
  auto& slot = model.mutable_block(layer).mutable_weights().linears[static_cast<int>(kind)];
  if (auto* o = dynamic_cast<ObservingLinear*>(slot.get())) slot = o->Release();
}

}  // namespace qcal::tools
