#include "methods/quip/transforms_torch.h"

#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::methods::quip {
namespace {

// Dense [order, order] float64 tensor of hadamard.h's ±1 matrix times `scale`.
StatusOr<at::Tensor> DenseHadamard(int order, double scale) {
  QCAL_ASSIGN_OR_RETURN(HadamardMatrix h, GetHadamardMatrix(order));
  at::Tensor t = at::empty({order, order}, at::kDouble);
  double* p = t.data_ptr<double>();
  for (size_t i = 0; i < h.entries.size(); ++i) p[i] = h.entries[i] * scale;
  return t;
}

// Splits 2^k into ceil(k/6) Sylvester blocks of balanced sizes, each at most 64.
std::vector<int64_t> Pow2Blocks(int64_t pow2) {
  int k = 0;
  while ((int64_t{1} << k) < pow2) ++k;
  std::vector<int64_t> blocks;
  if (k == 0) return blocks;
  const int r = (k + 5) / 6;
  for (int i = 0; i < r; ++i) {
    const int bits = k / r + (i < k % r ? 1 : 0);
    blocks.push_back(int64_t{1} << bits);
  }
  return blocks;
}

}  // namespace

OrthogonalTransformOp OrthogonalTransformOp::Identity(int64_t d) {
  OrthogonalTransformOp op;
  op.kind_ = Kind::kIdentity;
  op.dim_ = d;
  return op;
}

StatusOr<OrthogonalTransformOp> OrthogonalTransformOp::Hadamard(int64_t d) {
  const HadamardPlan plan = PlanHadamard(d);
  if (!plan.IsHadamard()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no Hadamard matrix of order ", d, " (plan: ", HadamardKindName(plan.kind),
                     ")"));
  }
  OrthogonalTransformOp op;
  op.kind_ = Kind::kHadamard;
  op.dim_ = d;
  std::vector<int64_t> sizes = Pow2Blocks(plan.pow2);
  if (plan.kind == HadamardKind::kPow2TimesM) sizes.push_back(plan.m);
  if (sizes.empty()) sizes.push_back(1);  // d == 1
  for (int64_t f : sizes) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor a,
                          DenseHadamard(static_cast<int>(f), 1.0 / std::sqrt(static_cast<double>(f))));
    op.factors64_.push_back(a);
    op.factors32_.push_back(a.to(at::kFloat));
  }
  return op;
}

StatusOr<OrthogonalTransformOp> OrthogonalTransformOp::Rfft(
    int64_t d, const std::vector<std::complex<double>>& phases) {
  if (d < 2 || d % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("randomized FFT needs an even dimension, got ", d));
  }
  if (static_cast<int64_t>(phases.size()) != d / 2) {
    return absl::InvalidArgumentError(absl::StrCat("randomized FFT of dimension ", d, " needs ",
                                                   d / 2, " phases, got ", phases.size()));
  }
  OrthogonalTransformOp op;
  op.kind_ = Kind::kRfft;
  op.dim_ = d;
  at::Tensor re_im = at::empty({d / 2, 2}, at::kDouble);
  double* p = re_im.data_ptr<double>();
  for (int64_t k = 0; k < d / 2; ++k) {
    p[2 * k] = phases[k].real();
    p[2 * k + 1] = phases[k].imag();
  }
  op.phases128_ = at::view_as_complex(re_im).clone();
  op.phases64_ = op.phases128_.to(at::kComplexFloat);
  return op;
}

StatusOr<OrthogonalTransformOp> OrthogonalTransformOp::FixedPart(
    const kernels::RandomizedTransform& t) {
  if (t.plan.IsHadamard()) return Hadamard(t.dim());
  if (t.kind() == HadamardKind::kRfft) return Rfft(t.dim(), t.phases);
  return absl::InvalidArgumentError(absl::StrCat("no orthogonal transform for dimension ",
                                                 t.dim(), " (plan ", HadamardKindName(t.kind()),
                                                 ")"));
}

at::Tensor OrthogonalTransformOp::Like(const at::Tensor& c64, const at::Tensor& c32,
                                       const at::Tensor& x) {
  const at::Tensor& c = x.scalar_type() == at::kDouble ? c64 : c32;
  return c.device() == x.device() ? c : c.to(x.device());
}

at::Tensor OrthogonalTransformOp::Forward(const at::Tensor& x) const { return Run(x, false); }

at::Tensor OrthogonalTransformOp::Inverse(const at::Tensor& x) const { return Run(x, true); }

at::Tensor OrthogonalTransformOp::Run(const at::Tensor& x, bool inverse) const {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim_, "orthogonal transform of dimension ", dim_,
              " applied to a tensor of shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "orthogonal transform: float32 or float64 expected, got ", x.scalar_type());
  switch (kind_) {
    case Kind::kIdentity: return x;
    case Kind::kHadamard: return ApplyHadamard(x, /*transpose=*/inverse);
    case Kind::kRfft: return ApplyRfft(x, inverse);
  }
  return x;
}

at::Tensor OrthogonalTransformOp::ApplyHadamard(const at::Tensor& x, bool transpose) const {
  // x viewed as [N, f_1, …, f_r]: T = A_1 ⊗ … ⊗ A_r maps the axis of f_i by A_i (Tᵀ by A_iᵀ).
  // Factors are applied innermost first. The innermost is one matmul on rows of length f_r; any
  // other acts on the middle axis of [N·pre, f_i, post] as a bmm against A_i expanded over the
  // batch (stride 0, no copy), so no transposes are materialized.
  const int64_t n = x.numel() / std::max<int64_t>(dim_, 1);
  at::Tensor y = x.reshape({n, dim_});
  const size_t r = factors64_.size();
  int64_t post = 1;
  for (size_t step = 0; step < r; ++step) {
    const size_t i = r - 1 - step;
    const at::Tensor a = Like(factors64_[i], factors32_[i], x);
    const int64_t f = a.size(0);
    const int64_t pre = dim_ / (f * post);
    const at::Tensor m = transpose ? a.t() : a;
    if (post == 1) {
      y = at::matmul(y.reshape({n * pre, f}), m.t());
    } else {
      y = at::bmm(m.unsqueeze(0).expand({n * pre, f, f}), y.reshape({n * pre, f, post}));
    }
    post *= f;
  }
  return y.reshape(x.sizes());
}

at::Tensor OrthogonalTransformOp::ApplyRfft(const at::Tensor& x, bool inverse) const {
  const int64_t half = dim_ / 2;
  std::vector<int64_t> pair_shape(x.sizes().begin(), x.sizes().end());
  pair_shape.back() = half;
  pair_shape.push_back(2);
  at::Tensor xc = x.contiguous();
  if (xc.storage_offset() % 2 != 0) xc = xc.clone();  // view_as_complex needs even offsets
  at::Tensor z = at::view_as_complex(xc.view(pair_shape));
  const at::Tensor phases = Like(phases128_, phases64_, x);
  if (!inverse) {
    z = at::fft_fft(z * phases, /*n=*/{}, -1, "ortho");
  } else {
    z = at::fft_ifft(z, /*n=*/{}, -1, "ortho") * phases.conj();
  }
  return at::view_as_real(z).reshape(x.sizes());
}

}  // namespace qcal::methods::quip
