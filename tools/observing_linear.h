// A Linear that forwards to the one it wraps and shows each call's input and output to an
// observer: how the model tools measure activations (outlier statistics, token outliers, the
// sink planter's probes) without touching the forward code. Install with Observe, restore with
// Unobserve; the model must not be used by another thread meanwhile.
#pragma once

#include <functional>
#include <memory>

#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::tools {

using LinearObserver = std::function<void(const at::Tensor& input, const at::Tensor& output)>;

class ObservingLinear final : public model::Linear {
 public:
  ObservingLinear(std::unique_ptr<model::Linear> inner, LinearObserver observer)
      : inner_(std::move(inner)), observer_(std::move(observer)) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    at::Tensor y = inner_->Forward(x);
    observer_(x, y);
    return y;
  }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }
  std::unique_ptr<model::Linear> Release() { return std::move(inner_); }

 private:
  std::unique_ptr<model::Linear> inner_;
  LinearObserver observer_;
};

// Wraps linear `kind` of block `layer`. InvalidArgument when the block has no such linear.
Status Observe(model::LlamaModel& model, int64_t layer, model::LinearKind kind,
               LinearObserver observer);
// Puts back the linear Observe wrapped (a no-op when it is not wrapped).
void Unobserve(model::LlamaModel& model, int64_t layer, model::LinearKind kind);

}  // namespace qcal::tools
