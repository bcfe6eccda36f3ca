#include "engine/qsim/act_quant.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard.h"
#include "kernels/scalar_quant.h"
#include "engine/qsim/bfp_kv.h"

namespace qcal::qsim {
namespace {

kernels::ScalarQuantConfig KernelConfig(const FakeQuantGrid& g) {
  kernels::ScalarQuantConfig c;
  c.bits = g.bits;
  c.symmetric = g.symmetric;
  c.clip_ratio = g.clip;
  c.granularity = kernels::QuantGranularity::kPerToken;
  return c;
}

std::string Fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

std::string GridName(const FakeQuantGrid& g) {
  return absl::StrCat("int", g.bits, g.symmetric ? " sym" : " asym", " clip ", Fmt(g.clip));
}

// Quantize→dequantize with per-set parameters given as tensors broadcastable to x:
// scale (float32), zero (double, integer-valued).
at::Tensor QuantDequant(const at::Tensor& x, const at::Tensor& scale_f, const at::Tensor& zero_d,
                        const FakeQuantGrid& g) {
  const kernels::ScalarQuantConfig c = KernelConfig(g);
  const double cmin = kernels::ScalarCodeMin(c), cmax = kernels::ScalarCodeMax(c);
  at::Tensor codes = at::round(x.to(at::kDouble) / scale_f.to(at::kDouble));
  if (!g.symmetric) codes = codes + zero_d;
  codes = codes.clamp(cmin, cmax);
  if (!g.symmetric) codes = codes - zero_d;
  return codes.to(at::kFloat) * scale_f;
}

}  // namespace

Status ValidateGrid(const FakeQuantGrid& grid) {
  return kernels::ValidateScalarQuantConfig(KernelConfig(grid));
}

at::Tensor FakeQuantizeLastDim(const at::Tensor& x, const FakeQuantGrid& g) {
  const kernels::ScalarQuantConfig c = KernelConfig(g);
  const double qmax = kernels::ScalarCodeMax(c);
  const at::Tensor xd = x.to(at::kDouble);
  const float tiny = std::numeric_limits<float>::min();
  at::Tensor scale_f, zero_d;
  if (g.symmetric) {
    // s = float(clip·max|x| / qmax); all-zero sets: s = 1.
    const at::Tensor m = xd.abs().amax(-1, /*keepdim=*/true) * g.clip;
    scale_f = (m / qmax).to(at::kFloat);
    scale_f = at::where(m == 0, at::ones_like(scale_f), scale_f);
    zero_d = at::zeros_like(m);
  } else {
    at::Tensor lo = xd.amin(-1, true).clamp_max(0) * g.clip;
    at::Tensor hi = xd.amax(-1, true).clamp_min(0) * g.clip;
    const at::Tensor empty = (lo == 0) & (hi == 0);  // GPTQ's fallback range [-1, 1]
    lo = at::where(empty, at::full_like(lo, -1.0), lo);
    hi = at::where(empty, at::full_like(hi, 1.0), hi);
    scale_f = ((hi - lo) / qmax).to(at::kFloat);
    zero_d = at::round(-lo / scale_f.to(at::kDouble)).clamp(0, qmax);
  }
  scale_f = at::where(scale_f > 0, scale_f, at::full_like(scale_f, tiny));  // float underflow
  return QuantDequant(x, scale_f, zero_d, g);
}

at::Tensor HummingFakeQuantizeLastDim(const at::Tensor& x, int bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "Humming quantizes int4 and int8 inputs, not int", bits);
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  // The divisors as float32 constants, as Triton takes 7.49 / 8.49 (int4), 127.49 / 128.49.
  const float pos_div = static_cast<float>(qmax + 0.49), neg_div = static_cast<float>(qmax + 1.49);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor maxval = xf.amax(-1, /*keepdim=*/true).clamp_min(1e-30f);
  const at::Tensor minval = xf.amin(-1, /*keepdim=*/true).clamp_max(-1e-30f);
  // Tensor-by-tensor divisions: IEEE float32 quotients (a division by a scalar may be computed
  // as a product with its reciprocal).
  const at::Tensor scale = at::maximum(at::div(maxval, at::full_like(maxval, pos_div)),
                                       at::div(minval.neg(), at::full_like(minval, neg_div)));
  const at::Tensor inv = at::div(at::ones_like(scale), scale);
  return at::round(xf * inv) * scale;
}

FixedQuantParams ParamsForRange(const FakeQuantGrid& grid, double lo, double hi) {
  const kernels::ScalarQuantParams<float> p =
      kernels::ScalarQuantParamsFromRange<float>(lo, hi, grid.clip, KernelConfig(grid));
  return {p.scale, p.zero};
}

at::Tensor FakeQuantizeFixed(const at::Tensor& x, const FakeQuantGrid& grid,
                             const FixedQuantParams& p) {
  const at::Tensor scale = at::full({}, p.scale, x.options().dtype(at::kFloat));
  const at::Tensor zero = at::full({}, static_cast<double>(p.zero), x.options().dtype(at::kDouble));
  return QuantDequant(x, scale, zero, grid);
}

// ---------------------------------------------------------------------------------------------

void RangeObserver::Observe(const at::Tensor& x) {
  if (x.numel() == 0) return;
  const double lo = x.min().item<double>(), hi = x.max().item<double>();
  std::lock_guard<std::mutex> lock(mu_);
  lo_ = count_ == 0 ? lo : std::min(lo_, lo);
  hi_ = count_ == 0 ? hi : std::max(hi_, hi);
  count_ += x.numel();
}
double RangeObserver::lo() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lo_;
}
double RangeObserver::hi() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hi_;
}
int64_t RangeObserver::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

// ---------------------------------------------------------------------------------------------

namespace {

StatusOr<FakeQuantGrid> ActGrid(const ActivationQuantSpec& spec) {
  if (!spec.enabled()) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation quantizer: bits = ", spec.bits, " (16 means not quantized)"));
  }
  if (spec.granularity != "per_token" && spec.granularity != "per_tensor") {
    return absl::InvalidArgumentError(absl::StrCat("activation quantizer: granularity '",
                                                   spec.granularity,
                                                   "' (per_token or per_tensor)"));
  }
  FakeQuantGrid g{spec.bits, spec.symmetric, spec.clip};
  QCAL_RETURN_IF_ERROR(ValidateGrid(g));
  return g;
}

}  // namespace

StatusOr<std::shared_ptr<const ActivationQuantizer>> ActivationQuantizer::Create(
    const ActivationQuantSpec& spec) {
  QCAL_ASSIGN_OR_RETURN(FakeQuantGrid g, ActGrid(spec));
  if (spec.is_static) {
    return absl::InvalidArgumentError("activation quantizer: a static spec needs calibrated ranges");
  }
  std::shared_ptr<ActivationQuantizer> q(new ActivationQuantizer());
  q->grid_ = g;
  q->per_token_ = spec.granularity == "per_token";
  if (spec.rule == "humming") {
    if (!q->per_token_ || !spec.symmetric || spec.clip != 1.0 || (spec.bits != 4 && spec.bits != 8)) {
      return absl::InvalidArgumentError(
          "activation quantizer: rule humming is int4 or int8, symmetric, per token, clip 1");
    }
    q->humming_ = true;
  } else if (spec.rule != "qcal") {
    return absl::InvalidArgumentError(
        absl::StrCat("activation quantizer: rule '", spec.rule, "' (qcal or humming)"));
  }
  return std::shared_ptr<const ActivationQuantizer>(std::move(q));
}

StatusOr<std::shared_ptr<const ActivationQuantizer>> ActivationQuantizer::CreateStatic(
    const ActivationQuantSpec& spec, double lo, double hi) {
  QCAL_ASSIGN_OR_RETURN(FakeQuantGrid g, ActGrid(spec));
  if (spec.granularity != "per_tensor") {
    return absl::InvalidArgumentError("activation quantizer: static scales are per_tensor only");
  }
  if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation quantizer: bad static range [", lo, ", ", hi, "]"));
  }
  std::shared_ptr<ActivationQuantizer> q(new ActivationQuantizer());
  q->grid_ = g;
  q->per_token_ = false;
  q->is_static_ = true;
  q->params_ = ParamsForRange(g, lo, hi);
  return std::shared_ptr<const ActivationQuantizer>(std::move(q));
}

at::Tensor ActivationQuantizer::Apply(const at::Tensor& x) const {
  if (is_static_) return FakeQuantizeFixed(x, grid_, params_);
  if (humming_) return HummingFakeQuantizeLastDim(x, grid_.bits);
  if (per_token_) return FakeQuantizeLastDim(x, grid_);
  const at::Tensor flat = x.dim() >= 3 ? x.reshape({x.size(0), -1}) : x.reshape({1, -1});
  return FakeQuantizeLastDim(flat, grid_).view(x.sizes());
}

std::string ActivationQuantizer::Describe() const {
  if (humming_) return absl::StrCat("int", grid_.bits, " sym per_token (Humming's scale rule)");
  return absl::StrCat(GridName(grid_),
                      per_token_ ? " per_token" : (is_static_ ? " per_tensor static"
                                                              : " per_tensor dynamic"));
}

// ---------------------------------------------------------------------------------------------

StatusOr<std::shared_ptr<const OnlineHadamard>> OnlineHadamard::Create(int64_t n) {
  const HadamardPlan plan = PlanHadamard(n);
  if (!plan.IsHadamard()) {
    return absl::InvalidArgumentError(absl::StrCat("online Hadamard: no Hadamard matrix of size ",
                                                   n, " (", DescribeHadamardPlan(plan), ")"));
  }
  std::shared_ptr<OnlineHadamard> h(new OnlineHadamard());
  h->n_ = n;
  if (n <= kDenseLimit) {
    // Rows of the identity transformed: I·Tᵀ = Tᵀ.
    at::Tensor m = at::eye(n, at::kFloat).contiguous();
    QCAL_RETURN_IF_ERROR(
        HadamardTransformMatrix(m.data_ptr<float>(), n, n, MatrixAxis::kRows, false));
    h->t_transposed_ = m;
  } else {
    // Two Kronecker factors of at most kDenseLimit each: (2^k, m), or two powers of two.
    int64_t a = plan.pow2, b = plan.m;
    if (plan.kind == HadamardKind::kPow2) {
      b = 1;
      while (a > kDenseLimit) {
        a /= 2;
        b *= 2;
      }
    }
    if (a > kDenseLimit || b > kDenseLimit) {
      return std::shared_ptr<const OnlineHadamard>(std::move(h));  // no differentiable form
    }
    auto dense_t = [](int64_t k) -> StatusOr<at::Tensor> {
      at::Tensor m = at::eye(k, at::kFloat).contiguous();
      QCAL_RETURN_IF_ERROR(
          HadamardTransformMatrix(m.data_ptr<float>(), k, k, MatrixAxis::kRows, false));
      return m;
    };
    QCAL_ASSIGN_OR_RETURN(at::Tensor at_, dense_t(a));
    QCAL_ASSIGN_OR_RETURN(at::Tensor bt_, dense_t(b));
    // Which factor is outer in Apply's ordering: try both on a probe.
    // (A fixed probe: creating a transform must not draw from LibTorch's generator.)
    const at::Tensor probe = at::sin(at::arange(2 * n, at::kFloat) * 0.37).view({2, n});
    const at::Tensor want = h->Apply(probe);
    for (int order = 0; order < 2; ++order) {
      h->f1t_ = order == 0 ? at_ : bt_;
      h->f2t_ = order == 0 ? bt_ : at_;
      const at::Tensor got = h->ApplyDifferentiable(probe);
      if ((got - want).abs().max().item<double>() <= 1e-4 * want.abs().max().item<double>()) {
        return std::shared_ptr<const OnlineHadamard>(std::move(h));
      }
    }
    h->f1t_ = h->f2t_ = at::Tensor();
  }
  return std::shared_ptr<const OnlineHadamard>(std::move(h));
}

StatusOr<std::shared_ptr<const OnlineHadamard>> OnlineHadamard::CreateBlockDiagonal(
    int64_t n, int64_t block) {
  if (block < 2 || (block & (block - 1)) != 0 || block > kDenseLimit || n % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "online Hadamard: blocks of ", block, " for size ", n,
        " (a power of two from 2 to ", kDenseLimit, " that divides the size)"));
  }
  std::shared_ptr<OnlineHadamard> h(new OnlineHadamard());
  h->n_ = n;
  h->block_ = block;
  at::Tensor m = at::eye(block, at::kFloat).contiguous();
  QCAL_RETURN_IF_ERROR(
      HadamardTransformMatrix(m.data_ptr<float>(), block, block, MatrixAxis::kRows, false));
  h->block_t_ = m;  // Sylvester H_b / √b: symmetric, so Tᵀ = T
  return std::shared_ptr<const OnlineHadamard>(std::move(h));
}

at::Tensor OnlineHadamard::BlockProduct(const at::Tensor& x, const at::Tensor& m) const {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n_ / block_;
  shape.push_back(block_);
  return at::matmul(x.reshape(shape), m.to(x.device())).reshape(x.sizes());
}

at::Tensor OnlineHadamard::ApplyDifferentiable(const at::Tensor& x) const {
  if (block_ > 0) return BlockProduct(x, block_t_);
  if (t_transposed_.defined() || !f1t_.defined()) return Apply(x);
  const int64_t f1 = f1t_.size(0), f2 = f2t_.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = f1;
  shape.push_back(f2);
  const at::Tensor y = at::matmul(f1t_.to(x.device()).t(),
                                  at::matmul(x.reshape(shape), f2t_.to(x.device())));
  return y.reshape(x.sizes());
}

at::Tensor OnlineHadamard::Apply(const at::Tensor& x) const {
  if (block_ > 0) return BlockProduct(x, block_t_);
  if (t_transposed_.defined()) return at::matmul(x, t_transposed_.to(x.device()));
  at::Tensor c = x.to(at::kCPU, at::kFloat).contiguous().clone();
  const Status s = HadamardTransform(c.data_ptr<float>(), n_, c.numel() / n_, false);
  (void)s;  // n_ was validated in Create and c has numel a multiple of n_
  return c.to(x.device());
}

at::Tensor OnlineHadamard::ApplyInverse(const at::Tensor& x) const {
  if (block_ > 0) return BlockProduct(x, block_t_.t());
  if (t_transposed_.defined()) return at::matmul(x, t_transposed_.to(x.device()).t());
  at::Tensor c = x.to(at::kCPU, at::kFloat).contiguous().clone();
  const Status s = HadamardTransform(c.data_ptr<float>(), n_, c.numel() / n_, true);
  (void)s;
  return c.to(x.device());
}

StatusOr<at::Tensor> FuseInputHadamard(const at::Tensor& w, const OnlineHadamard& t) {
  if (w.dim() != 2 || w.size(1) != t.dim()) {
    return absl::InvalidArgumentError(absl::StrCat("FuseInputHadamard: weight with ",
                                                   w.dim() == 2 ? w.size(1) : -1,
                                                   " inputs, transform of size ", t.dim()));
  }
  at::Tensor c = w.to(at::kFloat).contiguous().clone();
  // Block-diagonal: each row is n / b runs of b, each transformed alone.
  const int64_t b = t.block() > 0 ? t.block() : c.size(1);
  QCAL_RETURN_IF_ERROR(HadamardTransformMatrix(c.data_ptr<float>(), c.numel() / b, b,
                                               MatrixAxis::kRows, false));
  return c;
}

StatusOr<at::Tensor> RotateHessian(const at::Tensor& h, const OnlineHadamard& t) {
  const int64_t n = t.dim();
  if (h.dim() != 2 || h.size(0) != n || h.size(1) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("RotateHessian: Hessian is not ", n, "x", n));
  }
  at::Tensor c = h.to(at::kDouble).contiguous().clone();
  // Block-diagonal T: T·H transforms each slab of b rows along its columns, ·Tᵀ each run of b
  // along the rows.
  const int64_t b = t.block() > 0 ? t.block() : n;
  for (int64_t r = 0; r < n; r += b) {  // T·H
    QCAL_RETURN_IF_ERROR(HadamardTransformMatrix(c.data_ptr<double>() + r * n, b, n,
                                                 MatrixAxis::kColumns, false));
  }
  QCAL_RETURN_IF_ERROR(  // ·Tᵀ
      HadamardTransformMatrix(c.data_ptr<double>(), n * n / b, b, MatrixAxis::kRows, false));
  return c;
}

// ---------------------------------------------------------------------------------------------

ActQuantLinear::ActQuantLinear(std::unique_ptr<model::Linear> inner,
                               std::shared_ptr<const OnlineHadamard> rotation,
                               std::shared_ptr<const ActivationQuantizer> quantizer,
                               std::shared_ptr<RangeObserver> observer)
    : inner_(std::move(inner)),
      rotation_(std::move(rotation)),
      quantizer_(std::move(quantizer)),
      observer_(std::move(observer)) {}

at::Tensor ActQuantLinear::Forward(const at::Tensor& x) const {
  at::Tensor h = rotation_ ? rotation_->Apply(x) : x;
  if (observer_) observer_->Observe(h);
  if (quantizer_) h = quantizer_->Apply(h);
  return inner_->Forward(h);
}

at::Tensor ActQuantLinear::DenseWeight() const {
  at::Tensor w = inner_->DenseWeight();
  if (!rotation_) return w;
  // y = (x·Tᵀ)·Wᵀ = x·(W·T)ᵀ.
  return rotation_->ApplyInverse(w).contiguous();
}

// ---------------------------------------------------------------------------------------------

StatusOr<std::shared_ptr<const IntKvQuantizer>> IntKvQuantizer::Create(const Options& options,
                                                                       int64_t head_dim) {
  QCAL_RETURN_IF_ERROR(ValidateGrid(options.grid));
  std::shared_ptr<IntKvQuantizer> q(new IntKvQuantizer());
  q->options_ = options;
  q->head_dim_ = head_dim;
  if (options.granularity == Granularity::kPerGroup) {
    if (q->options_.group == 0) q->options_.group = head_dim;
    const int64_t g = q->options_.group;
    if (g < 0 || head_dim % g != 0) {
      return absl::InvalidArgumentError(absl::StrCat("KV cache: group ", g,
                                                     " does not divide head_dim ", head_dim));
    }
  }
  if (options.granularity == Granularity::kPerTensor) {
    for (int r = 0; r < 2; ++r) {
      const double lo = options.ranges.lo[r], hi = options.ranges.hi[r];
      if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV cache: bad static range [", lo, ", ", hi, "] for ",
                         KvRoleName(static_cast<KvRole>(r))));
      }
      q->fixed_[r] = ParamsForRange(options.grid, lo, hi);
    }
  }
  return std::shared_ptr<const IntKvQuantizer>(std::move(q));
}

at::Tensor IntKvQuantizer::Apply(const at::Tensor& x, KvRole role) const {
  if (role == KvRole::kQuery) return x;  // queries are not cached
  const int64_t b = x.size(0), kvh = x.size(1), s = x.size(2), d = x.size(3);
  switch (options_.granularity) {
    case Granularity::kPerGroup: {
      const int64_t g = options_.group;
      return FakeQuantizeLastDim(x.reshape({b, kvh, s, d / g, g}), options_.grid)
          .view({b, kvh, s, d});
    }
    case Granularity::kPerToken: {
      at::Tensor t = x.transpose(1, 2).reshape({b, s, kvh * d});
      return FakeQuantizeLastDim(t, options_.grid).view({b, s, kvh, d}).transpose(1, 2);
    }
    case Granularity::kPerTensor:
      return FakeQuantizeFixed(x, options_.grid, fixed_[static_cast<int>(role)]);
  }
  return x;
}

std::string IntKvQuantizer::Describe() const {
  switch (options_.granularity) {
    case Granularity::kPerGroup:
      return absl::StrCat(GridName(options_.grid), " per_group(", options_.group, ")");
    case Granularity::kPerToken:
      return absl::StrCat(GridName(options_.grid), " per_token");
    case Granularity::kPerTensor:
      return absl::StrCat(GridName(options_.grid), " per_tensor static");
  }
  return "?";
}

at::Tensor RecordingKvQuantizer::Apply(const at::Tensor& x, KvRole role) const {
  if (role == KvRole::kQuery) return x;
  observers_[static_cast<int>(role)].Observe(x);
  return x;
}

KvStaticRanges RecordingKvQuantizer::ranges() const {
  KvStaticRanges r;
  for (int i = 0; i < 2; ++i) {
    r.lo[i] = observers_[i].lo();
    r.hi[i] = observers_[i].hi();
  }
  return r;
}

}  // namespace qcal::qsim
