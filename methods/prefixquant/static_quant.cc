#include "methods/prefixquant/static_quant.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::methods::prefixquant {

int64_t GridMin(int bits) { return -(int64_t{1} << (bits - 1)); }
int64_t GridMax(int bits) { return (int64_t{1} << (bits - 1)) - 1; }

at::Tensor InitialStep(const at::Tensor& max_abs, int bits) {
  const double levels = static_cast<double>((int64_t{1} << bits) - 1);
  at::Tensor m = max_abs.detach().to(at::kFloat);
  return at::where(m > 0, m * (2.0 / levels), at::ones_like(m));
}

at::Tensor FakeQuant(const at::Tensor& x, const at::Tensor& step, int bits) {
  const at::Tensor v = x / step;
  const at::Tensor r = v + (at::round(v) - v).detach();  // straight-through rounding
  return at::clamp(r, static_cast<double>(GridMin(bits)), static_cast<double>(GridMax(bits))) *
         step;
}

StaticActLinear::StaticActLinear(std::unique_ptr<model::Linear> inner,
                                 std::shared_ptr<const qsim::OnlineHadamard> rotation,
                                 std::shared_ptr<Step> step, int bits, Observer observer)
    : inner_(std::move(inner)),
      rotation_(std::move(rotation)),
      step_(std::move(step)),
      bits_(bits),
      observer_(std::move(observer)) {}

at::Tensor StaticActLinear::Forward(const at::Tensor& x) const {
  // Fine-tuning differentiates through R4 (above kDenseLimit through its Kronecker factors).
  const bool grad = at::GradMode::is_enabled() && x.requires_grad();
  at::Tensor h = !rotation_ ? x : grad ? rotation_->ApplyDifferentiable(x) : rotation_->Apply(x);
  if (observer_) observer_(h);
  if (step_ && step_->value.defined()) h = FakeQuant(h, step_->value, bits_);
  return inner_->Forward(h);
}

at::Tensor StaticActLinear::DenseWeight() const {
  at::Tensor w = inner_->DenseWeight();
  return rotation_ ? rotation_->ApplyInverse(w) : w;
}

std::unique_ptr<model::Linear> Unwrap(std::unique_ptr<model::Linear> linear) {
  for (;;) {
    if (auto* a = dynamic_cast<StaticActLinear*>(linear.get())) {
      linear = a->release_inner();
    } else if (auto* b = dynamic_cast<qsim::ActQuantLinear*>(linear.get())) {
      linear = b->release_inner();
    } else {
      return linear;
    }
  }
}

StaticKvHook::StaticKvHook(std::shared_ptr<Step> k, std::shared_ptr<Step> v, int bits)
    : k_(std::move(k)), v_(std::move(v)), bits_(bits) {}

std::shared_ptr<StaticKvHook> StaticKvHook::Recorder() {
  auto h = std::shared_ptr<StaticKvHook>(new StaticKvHook());
  h->record_ = true;
  return h;
}

at::Tensor StaticKvHook::Apply(const at::Tensor& x, model::KvRole role) const {
  if (role == model::KvRole::kQuery) return x;
  const int r = role == model::KvRole::kKey ? 0 : 1;
  if (record_) {
    // x [b, kv, s, d]: max over everything but the head dim.
    const at::Tensor m = x.detach().abs().amax({0, 2, 3}).to(at::kFloat);
    max_[r] = max_[r].defined() ? at::maximum(max_[r], m) : m;
    return x;
  }
  const std::shared_ptr<Step>& step = r == 0 ? k_ : v_;
  if (!step || !step->value.defined()) return x;
  return FakeQuant(x, step->value.view({1, -1, 1, 1}), bits_);
}

std::string StaticKvHook::Describe() const {
  if (record_) return "per-head KV range recorder";
  return absl::StrCat("int", bits_, " sym static per-head");
}

FakeQuantLinear::FakeQuantLinear(at::Tensor weight, at::Tensor step, int bits)
    : weight_(std::move(weight)), step_(std::move(step)), bits_(bits) {}

at::Tensor FakeQuantLinear::Forward(const at::Tensor& x) const {
  return at::matmul(x, FakeQuant(weight_, step_.view({-1, 1}), bits_).t());
}

at::Tensor FakeQuantLinear::DenseWeight() const {
  return FakeQuant(weight_, step_.view({-1, 1}), bits_).detach();
}

StatusOr<std::unique_ptr<quant::ScalarQuantLinear>> RoundWeights(const at::Tensor& weight,
                                                                 const at::Tensor& step, int bits) {
  const at::Tensor w = weight.detach().to(at::kFloat).contiguous();
  const at::Tensor s = step.detach().to(at::kFloat).reshape({-1}).contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  if (s.numel() != out) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight steps: ", s.numel(), " for ", out, " output channels"));
  }
  const at::Tensor codes =
      at::clamp(at::round(w / s.view({out, 1})), static_cast<double>(GridMin(bits)),
                static_cast<double>(GridMax(bits)))
          .to(at::kInt)
          .contiguous();
  quant::ScalarLinearData d;
  d.in_features = in;
  d.out_features = out;
  d.bits = bits;
  d.symmetric = true;
  d.group_size = -1;
  d.codes.assign(codes.data_ptr<int32_t>(), codes.data_ptr<int32_t>() + codes.numel());
  d.scales.assign(s.data_ptr<float>(), s.data_ptr<float>() + out);
  d.zeros.assign(out, 0);
  d.pack_int4 = bits <= 4;
  return quant::ScalarQuantLinear::Create(std::move(d));
}

}  // namespace qcal::methods::prefixquant
