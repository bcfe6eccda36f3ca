#include "worker/calib/hessian.h"

#include <ATen/ATen.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace qcal::calib {

HessianAccumulator::HessianAccumulator(int64_t n)
    : n_(n), sum_(at::zeros({n, n}, at::kDouble)) {}

HessianAccumulator HessianAccumulator::FromSum(at::Tensor sum, int64_t count) {
  HessianAccumulator acc(0);
  acc.n_ = sum.size(0);
  acc.sum_ = sum.to(at::kDouble).contiguous();
  acc.count_ = count;
  return acc;
}

void HessianAccumulator::Add(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  if (x.scalar_type() == at::kDouble) {
    at::Tensor rows = x.reshape({-1, n_});
    sum_.addmm_(rows.t(), rows);
    count_ += rows.size(0);
    return;
  }
  // Products in fp32 (fp32 GEMM runs at twice the fp64 rate on CPU, and TF32/fp32 on GPU), one
  // partial sum per sequence, accumulated in fp64. Partials are per sequence (not per chunk of
  // rows) so that the result does not depend on how sequences are batched or split across ranks.
  at::Tensor seqs = x.dim() >= 3 ? x.reshape({-1, x.size(-2), n_}) : x.reshape({1, -1, n_});
  seqs = seqs.to(at::kFloat).contiguous();
  for (int64_t s = 0; s < seqs.size(0); ++s) {
    at::Tensor rows = seqs[s];
    sum_.add_(at::mm(rows.t(), rows));  // promotes to fp64 in place, no temporary
    count_ += rows.size(0);
  }
}

void HessianAccumulator::Merge(const HessianAccumulator& other) {
  sum_.add_(other.sum_);
  count_ += other.count_;
}

at::Tensor HessianAccumulator::Mean() const {
  if (count_ == 0) return at::zeros_like(sum_);
  // fp32 products are symmetric only up to rounding (BLAS computes the two triangles
  // separately); the factorizations downstream expect an exactly symmetric H.
  return (sum_ + sum_.t()) / (2.0 * static_cast<double>(count_));
}

const char* HessianKindName(HessianKind kind) {
  switch (kind) {
    case HessianKind::kQkv: return "qkv";
    case HessianKind::kO: return "o";
    case HessianKind::kGateUp: return "gate_up";
    case HessianKind::kDown: return "down";
  }
  return "?";
}

HessianKind HessianKindOf(model::LinearKind linear) {
  switch (linear) {
    case model::LinearKind::kQ:
    case model::LinearKind::kK:
    case model::LinearKind::kV: return HessianKind::kQkv;
    case model::LinearKind::kO: return HessianKind::kO;
    case model::LinearKind::kGate:
    case model::LinearKind::kUp: return HessianKind::kGateUp;
    case model::LinearKind::kDown: return HessianKind::kDown;
  }
  return HessianKind::kQkv;
}

namespace {

// Forwards to the wrapped layer and records the input into an accumulator (borrowed).
class RecordingLinear final : public model::Linear {
 public:
  RecordingLinear(std::unique_ptr<model::Linear> inner, HessianAccumulator* acc)
      : inner_(std::move(inner)), acc_(acc) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    if (acc_) acc_->Add(x);
    return inner_->Forward(x);
  }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }
  std::unique_ptr<model::Linear> Release() { return std::move(inner_); }

 private:
  std::unique_ptr<model::Linear> inner_;
  HessianAccumulator* acc_;
};

}  // namespace

StatusOr<at::Tensor> ForwardCollectingHessians(model::DecoderBlock& block, const at::Tensor& x,
                                               const model::Rope& rope, int64_t batch,
                                               BlockHessians* hessians) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  model::BlockWeights& w = block.mutable_weights();
  for (model::LinearKind k : model::kAllLinears) {
    HessianAccumulator& acc = hessians->at(HessianKindOf(k));
    const int64_t n = w.linear(k).in_features();
    if (acc.dim() == 0) acc = HessianAccumulator(n);
    if (acc.dim() != n) {
      return absl::InvalidArgumentError(absl::StrCat("Hessian for ", model::LinearName(k),
                                                     " has dim ", acc.dim(), ", expected ", n));
    }
  }
  // Wrap: only one linear per distinct input records (q records for k and v).
  for (model::LinearKind k : model::kAllLinears) {
    const bool records = k == model::LinearKind::kQ || k == model::LinearKind::kO ||
                         k == model::LinearKind::kGate || k == model::LinearKind::kDown;
    auto& slot = w.linears[static_cast<int>(k)];
    slot = std::make_unique<RecordingLinear>(std::move(slot),
                                             records ? &hessians->at(HessianKindOf(k)) : nullptr);
  }
  // Unwrap on every exit path, so the block is left as it was.
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) slot = static_cast<RecordingLinear*>(slot.get())->Release();
  });
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> outs;
  try {
    for (int64_t s = 0; s < x.size(0); s += batch) {
      outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block forward failed: ", e.what()));
  }
  return at::cat(outs, 0);
}

}  // namespace qcal::calib
