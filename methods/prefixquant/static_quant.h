// PrefixQuant's static quantizers (the reference's quantizer.py, symmetric, no zero point):
// one step size s per tensor (activations), per KV head (keys, values) or per output channel
// (weights), value = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1) · s. The step sizes are tensors
// so that block-wise fine-tuning can train them: rounding is straight-through (the gradient of
// round is taken as 1; clamping passes no gradient outside the grid), giving the LSQ-style
// gradients of the reference (without LSQ's gradient scale).
//
// Initial step: 2·max|x| / (2^b − 1) (the reference's min/max init: for 4 bits the largest value
// maps to ±7.5, so the grid's top code 7 and bottom code −8 are both used).
//
// Thread-safety: the layers and hooks read their step tensors on every forward; changing a
// Step's value (the grid search, the optimizer) must not overlap a forward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/act_quant.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::methods::prefixquant {

// A step-size tensor shared by the quantizers that use it (q/k/v share their input's).
struct Step {
  at::Tensor value;  // float32; undefined: not quantized (float)
};

int64_t GridMin(int bits);  // -2^(b-1)
int64_t GridMax(int bits);  // 2^(b-1) - 1
// 2·max / (2^b − 1), the initial step for a range max|x| = max (a max of 0 gives 1).
at::Tensor InitialStep(const at::Tensor& max_abs, int bits);

// clamp(round_ste(x / step), GridMin, GridMax) · step; `step` broadcasts against x.
at::Tensor FakeQuant(const at::Tensor& x, const at::Tensor& step, int bits);

// A block linear behind a static per-tensor activation quantizer: x → T (the online Hadamard R4,
// when given) → observer (when set: sees the transformed input, for calibration) → FakeQuant with
// the Step (when its value is defined) → inner.
class StaticActLinear final : public model::Linear {
 public:
  using Observer = std::function<void(const at::Tensor& x)>;
  StaticActLinear(std::unique_ptr<model::Linear> inner,
                  std::shared_ptr<const qsim::OnlineHadamard> rotation, std::shared_ptr<Step> step,
                  int bits, Observer observer = nullptr);
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override;  // inner.DenseWeight()·T (T when rotated)
  const model::Linear& stored() const override { return inner_->stored(); }

  const model::Linear& inner() const { return *inner_; }
  model::Linear& mutable_inner() { return *inner_; }
  std::unique_ptr<model::Linear> release_inner() { return std::move(inner_); }
  const std::shared_ptr<const qsim::OnlineHadamard>& rotation() const { return rotation_; }
  const std::shared_ptr<Step>& step() const { return step_; }

 private:
  std::unique_ptr<model::Linear> inner_;
  std::shared_ptr<const qsim::OnlineHadamard> rotation_;
  std::shared_ptr<Step> step_;
  int bits_;
  Observer observer_;
};

// Strips StaticActLinear and qsim::ActQuantLinear wrappers, returning the innermost layer.
std::unique_ptr<model::Linear> Unwrap(std::unique_ptr<model::Linear> linear);

// The static per-head KV-cache quantizer: keys (after RoPE and R3) with k [kv_heads] steps,
// values with v [kv_heads] steps; queries pass. A Step with an undefined value leaves its role
// in float. With `record`, the per-head max |x| of keys and values seen is kept instead (no
// quantization; calibration).
class StaticKvHook final : public model::KvCacheHook {
 public:
  StaticKvHook(std::shared_ptr<Step> k, std::shared_ptr<Step> v, int bits);
  static std::shared_ptr<StaticKvHook> Recorder();
  at::Tensor Apply(const at::Tensor& x, model::KvRole role) const override;
  std::string Describe() const override;
  // Recorder: per-head max |x| over everything seen, [kv_heads] float32 (undefined before).
  at::Tensor max_k() const { return max_[0]; }
  at::Tensor max_v() const { return max_[1]; }

 private:
  StaticKvHook() = default;
  std::shared_ptr<Step> k_, v_;
  int bits_ = 16;
  bool record_ = false;
  mutable at::Tensor max_[2];
};

// A linear whose float weight and per-output-channel steps are trained (block-wise
// fine-tuning): Forward = x·FakeQuant(W, step)ᵀ. weight [out, in], step [out], float32 leaves.
class FakeQuantLinear final : public model::Linear {
 public:
  FakeQuantLinear(at::Tensor weight, at::Tensor step, int bits);
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override { return weight_.size(1); }
  int64_t out_features() const override { return weight_.size(0); }
  at::Tensor DenseWeight() const override;  // FakeQuant(W, step), detached
  const at::Tensor& weight() const { return weight_; }
  const at::Tensor& step() const { return step_; }

 private:
  at::Tensor weight_, step_;
  int bits_;
};

// The scalar-format layer of W rounded per output channel with steps [out] (symmetric, no zero
// point): codes clamp(round(W / step)), scales = step. Its Forward equals x·FakeQuant(W, step)ᵀ.
StatusOr<std::unique_ptr<quant::ScalarQuantLinear>> RoundWeights(const at::Tensor& weight,
                                                                 const at::Tensor& step, int bits);

}  // namespace qcal::methods::prefixquant
