// Simulated ("fake") quantization of activations and of the KV cache for QuaRot-style quantized
// inference (QuaRot §4 stage 2b/2c; AMD Quark's W8A8 strategies): values are quantized to
// integers and dequantized at once, so a float forward pass computes with exactly the values an
// integer engine would.
//
// Grids and rounding are those of kernels/scalar_quant.h, bit for bit (tests compare with
// kernels::QuantizeScalar):
//   symmetric b bits:  qmax = 2^(b-1) - 1, codes [-2^(b-1), qmax], s = clip·max|x| / qmax
//   asymmetric b bits: qmax = 2^b - 1, codes [0, qmax], lo = clip·min(min x, 0),
//                      hi = clip·max(max x, 0), s = (hi - lo)/qmax, z = nearbyint(-lo/s)
//   code = clamp(nearbyint(x/s) + z), x/s in double (ties to even); value = float(code - z)·s.
// The range (and clip) is taken per parameter set; s is computed in double and rounded to float
// (the element type), an all-zero set gets s = 1 (symmetric) or the [-1, 1] fallback.
//
// Thread-safety: quantizers, OnlineHadamard and ActQuantLinear are immutable after creation and
// safe to share between threads; RangeObserver and RecordingKvQuantizer lock internally.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/quant_specs.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/kv_quantizer.h"

namespace qcal::qsim {

// An integer grid with a clip ratio.
struct FakeQuantGrid {
  int bits = 4;            // symmetric 2..16, asymmetric 1..16
  bool symmetric = true;
  double clip = 1.0;       // (0, 1]
};
Status ValidateGrid(const FakeQuantGrid& grid);

// Quantize→dequantize every vector along the last dim of x (float32, any shape) with its own
// parameters computed from its range (dynamic quantization).
at::Tensor FakeQuantizeLastDim(const at::Tensor& x, const FakeQuantGrid& grid);

// vLLM's Humming input quantization of every vector along the last dim of x (float32, any
// shape), symmetric int `bits` (4 or 8), dynamic (ActivationQuantSpec::rule "humming"); all in
// float32 with IEEE division:
//   s = max(max(max x, 1e-30) / (qmax + 0.49), -min(min x, -1e-30) / (qmax + 1.49))
//   code = nearbyint(x · (1 / s))   (the float32 product; ties to even; no clamp: the divisors
//                                    keep the codes in [-qmax - 1, qmax])
//   value = float(code) · s.
// The engine's Triton kernel divides with div.full.f32 (within 2 ulp of IEEE), so a served code
// can differ from this one where x · (1 / s) is within a few ulp of a rounding boundary.
at::Tensor HummingFakeQuantizeLastDim(const at::Tensor& x, int bits);

// One fixed parameter set (static quantization): scale > 0 (float), zero (0 when symmetric).
struct FixedQuantParams {
  float scale = 1.0f;
  int32_t zero = 0;
};
// The parameters for a measured range [lo, hi] under `grid` (clip applied), exactly as
// kernels::ScalarQuantParamsFromRange<float>.
FixedQuantParams ParamsForRange(const FakeQuantGrid& grid, double lo, double hi);
at::Tensor FakeQuantizeFixed(const at::Tensor& x, const FakeQuantGrid& grid,
                             const FixedQuantParams& params);

// Thread-safe running min / max of everything observed (static calibration).
class RangeObserver {
 public:
  void Observe(const at::Tensor& x);
  double lo() const;
  double hi() const;
  int64_t count() const;  // number of values observed

 private:
  mutable std::mutex mu_;
  double lo_ = 0, hi_ = 0;
  int64_t count_ = 0;
};

// The activation quantizer of one linear input.
//   per_token:            one parameter set per vector along the last dim (each token).
//   per_tensor, dynamic:  one per sequence: x [batch, ...] gets one set per index of dim 0 when
//                         x.dim() >= 3, else one for all of x. This is what a batch-1 prefill
//                         computes; it is not causal (a later token can change the scale of an
//                         earlier one), like every dynamic per-tensor scheme.
//   per_tensor, static:   one fixed set from a calibrated range.
class ActivationQuantizer {
 public:
  // Dynamic quantizer. InvalidArgument for a static spec, bits >= 16 or a bad grid.
  static StatusOr<std::shared_ptr<const ActivationQuantizer>> Create(
      const ActivationQuantSpec& spec);
  // Static per-tensor quantizer for the calibrated range [lo, hi].
  static StatusOr<std::shared_ptr<const ActivationQuantizer>> CreateStatic(
      const ActivationQuantSpec& spec, double lo, double hi);

  at::Tensor Apply(const at::Tensor& x) const;  // x [..., n] float32
  std::string Describe() const;
  const FakeQuantGrid& grid() const { return grid_; }
  bool per_token() const { return per_token_; }
  bool is_static() const { return is_static_; }
  bool humming() const { return humming_; }  // rule "humming": HummingFakeQuantizeLastDim
  const FixedQuantParams& static_params() const { return params_; }

 private:
  ActivationQuantizer() = default;
  FakeQuantGrid grid_;
  bool per_token_ = true;
  bool is_static_ = false;
  bool humming_ = false;
  FixedQuantParams params_;
};

// The online Hadamard transform of QuaRot (R3 per head, R4 before down_proj): every vector v
// along the last dim becomes T·v, T = the normalized Hadamard H / √n of kernels/hadamard.h
// (HadamardTransform, H_{2^k} ⊗ H_m, no random signs). As row vectors: x ← x·Tᵀ.
class OnlineHadamard {
 public:
  // InvalidArgument unless PlanHadamard(n).IsHadamard().
  static StatusOr<std::shared_ptr<const OnlineHadamard>> Create(int64_t n);
  // The block-diagonal T whose n / block diagonal blocks are the Sylvester H_block / √block
  // (block a power of two dividing n, at most kDenseLimit): compressed-tensors' "hadamard"
  // transform with head_dim = block. InvalidArgument otherwise.
  static StatusOr<std::shared_ptr<const OnlineHadamard>> CreateBlockDiagonal(int64_t n,
                                                                             int64_t block);
  at::Tensor Apply(const at::Tensor& x) const;  // x [..., n] float32 -> x·Tᵀ
  at::Tensor ApplyInverse(const at::Tensor& x) const;  // x [..., n] float32 -> x·T
  // Tᵀ [n, n] float32 (dense; built for n <= kDenseLimit, undefined above, where Apply runs the
  // fast transform on the CPU). Block-diagonal: undefined (block_matrix_transposed() has it).
  const at::Tensor& transposed_matrix() const { return t_transposed_; }
  // x·Tᵀ with LibTorch operations only, so autograd passes through it (block-wise fine-tuning):
  // Apply for n <= kDenseLimit; above, T = F1 ⊗ F2 applied as two small dense products (F1, F2
  // the normalized Hadamard factors, e.g. H_64/8 ⊗ H_172/√172 for 11008; their order is the one
  // Apply uses, checked at creation). Equal to Apply up to float rounding.
  at::Tensor ApplyDifferentiable(const at::Tensor& x) const;
  int64_t dim() const { return n_; }
  int64_t block() const { return block_; }  // 0: the whole Hadamard; else the diagonal blocks'
  const at::Tensor& block_matrix_transposed() const { return block_t_; }  // [block, block]
  static constexpr int64_t kDenseLimit = 4096;

 private:
  OnlineHadamard() = default;
  // Block-diagonal: x [..., n] viewed as [..., n / block, block] times `m` [block, block].
  at::Tensor BlockProduct(const at::Tensor& x, const at::Tensor& m) const;
  int64_t n_ = 0;
  int64_t block_ = 0;
  at::Tensor block_t_;  // H_block / √block (symmetric), float32
  at::Tensor t_transposed_;
  // n > kDenseLimit: x viewed as [..., f1, f2] maps to F1·X·F2ᵀ; f1t = F1ᵀ, f2t = F2ᵀ.
  at::Tensor f1t_, f2t_;
};

// W ← W·Tᵀ for the OnlineHadamard's T (so that x·Tᵀ·(W·Tᵀ)ᵀ = x·Wᵀ): the offline half of R4.
// w [out, n] float32; returns a new tensor.
StatusOr<at::Tensor> FuseInputHadamard(const at::Tensor& w, const OnlineHadamard& t);

// The Hessian of the transformed input: for H = E[x xᵀ] and x' = T·x, T·H·Tᵀ. h [n, n] double.
StatusOr<at::Tensor> RotateHessian(const at::Tensor& h, const OnlineHadamard& t);

// A Linear whose input goes through an optional online transform, then an optional observer and
// an optional activation quantizer, before the wrapped Linear:
//   Forward(x) = inner.Forward(Q(R(x)))      R = rotation (x·Tᵀ) or identity, Q likewise.
// With neither set it equals inner (used to carry R4 alone in the float rotated model).
class ActQuantLinear final : public model::Linear {
 public:
  ActQuantLinear(std::unique_ptr<model::Linear> inner,
                 std::shared_ptr<const OnlineHadamard> rotation,
                 std::shared_ptr<const ActivationQuantizer> quantizer,
                 std::shared_ptr<RangeObserver> observer = nullptr);
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  // The float function of x without quantization: inner.DenseWeight()·T (T when rotated).
  at::Tensor DenseWeight() const override;
  const model::Linear& stored() const override { return inner_->stored(); }

  const model::Linear& inner() const { return *inner_; }
  std::unique_ptr<model::Linear> release_inner() { return std::move(inner_); }
  const std::shared_ptr<const OnlineHadamard>& rotation() const { return rotation_; }
  const std::shared_ptr<const ActivationQuantizer>& quantizer() const { return quantizer_; }

 private:
  std::unique_ptr<model::Linear> inner_;
  std::shared_ptr<const OnlineHadamard> rotation_;
  std::shared_ptr<const ActivationQuantizer> quantizer_;
  std::shared_ptr<RangeObserver> observer_;
};

// Integer KV-cache quantizer (QuaRot: asymmetric, per group of head_dim channels, clip 0.95).
//   kPerGroup:  groups of `group` consecutive channels within each head of each token.
//   kPerToken:  one set per token over all KV heads (Quark's per-token KV).
//   kPerTensor: static: one fixed set per role from calibrated ranges.
class IntKvQuantizer final : public KvQuantizer {
 public:
  enum class Granularity { kPerGroup, kPerToken, kPerTensor };
  struct Options {
    FakeQuantGrid grid{4, false, 0.95};
    Granularity granularity = Granularity::kPerGroup;
    int64_t group = 0;      // kPerGroup: channels per group, dividing head_dim (0 = head_dim)
    KvStaticRanges ranges;  // kPerTensor
  };
  // InvalidArgument for a bad grid or a group that does not divide head_dim.
  static StatusOr<std::shared_ptr<const IntKvQuantizer>> Create(const Options& options,
                                                                int64_t head_dim);
  at::Tensor Apply(const at::Tensor& x, KvRole role) const override;
  std::string Describe() const override;
  const Options& options() const { return options_; }

 private:
  IntKvQuantizer() = default;
  Options options_;
  int64_t head_dim_ = 0;
  FixedQuantParams fixed_[2];
};

// Records the range of keys and values (static calibration) and returns them unchanged.
class RecordingKvQuantizer final : public KvQuantizer {
 public:
  at::Tensor Apply(const at::Tensor& x, KvRole role) const override;
  std::string Describe() const override { return "range recorder"; }
  KvStaticRanges ranges() const;

 private:
  mutable RangeObserver observers_[2];
};

}  // namespace qcal::qsim
