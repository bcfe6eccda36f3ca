#include "engine/qsim/fp8_kv.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::qsim {

at::Tensor RoundToFp8E4M3(const at::Tensor& y) {
  // In double, where every step below is exact: |y| = m · 2^e with m in [0.5, 1), so the
  // binade's exponent is e - 1; below 2^-6 the subnormal spacing 2^-9 applies. The value rounded
  // to a multiple of its binade's spacing 2^(E - 3) with ties to even is the nearest E4M3 value
  // (a carry into the next binade lands on its first value, also representable).
  const at::Tensor a = y.to(at::kDouble).abs();
  at::Tensor mantissa, exponent;
  std::tie(mantissa, exponent) = at::frexp(a);
  const at::Tensor binade = (exponent.to(at::kDouble) - 1).clamp_min(-6.0);
  const at::Tensor step = at::pow(2.0, binade - 3);
  at::Tensor q = at::round(a / step) * step;
  // SATFINITE: beyond 448 (infinity included) to 448; NaN stays NaN.
  q = at::where(at::isnan(a), a, q.clamp_max(kFp8E4M3Max));
  q = at::where(y.to(at::kDouble) < 0, q.neg(), q);
  return q.to(at::kFloat);
}

float Fp8StaticScale(double lo, double hi) {
  const double m = std::max(std::abs(lo), std::abs(hi));
  if (!(m > 0)) return 1.0f;
  const float s = static_cast<float>(m / kFp8E4M3Max);
  return s > 0 ? s : std::numeric_limits<float>::min();
}

StatusOr<std::shared_ptr<const Fp8KvQuantizer>> Fp8KvQuantizer::Create(float k_scale,
                                                                         float v_scale) {
  for (float s : {k_scale, v_scale}) {
    if (!(std::isfinite(s) && s > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("FP8 KV cache: scale ", s, " is not finite and positive"));
    }
  }
  std::shared_ptr<Fp8KvQuantizer> q(new Fp8KvQuantizer());
  q->scales_[0] = k_scale;
  q->scales_[1] = v_scale;
  return std::shared_ptr<const Fp8KvQuantizer>(std::move(q));
}

StatusOr<std::shared_ptr<const Fp8KvQuantizer>> Fp8KvQuantizer::FromRanges(
    const KvStaticRanges& r) {
  for (int i = 0; i < 2; ++i) {
    if (!std::isfinite(r.lo[i]) || !std::isfinite(r.hi[i]) || r.lo[i] > r.hi[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FP8 KV cache: bad static range [", r.lo[i], ", ", r.hi[i], "] for the ",
          i == 0 ? "keys" : "values"));
    }
  }
  return Create(Fp8StaticScale(r.lo[0], r.hi[0]), Fp8StaticScale(r.lo[1], r.hi[1]));
}

at::Tensor Fp8KvQuantizer::Apply(const at::Tensor& x, KvRole role) const {
  if (role == KvRole::kQuery) return x;
  const at::Tensor xf = x.to(at::kFloat);
  // x / s divided element by element by a tensor of x's shape, never as a product with 1 / s
  // (which ATen may use for a scalar divisor): the IEEE float32 quotient of the cache write.
  const at::Tensor s = at::full_like(xf, scale(role));
  return RoundToFp8E4M3(at::div(xf, s)) * s;
}

std::string Fp8KvQuantizer::Describe() const {
  return absl::StrCat("fp8 e4m3 static per tensor (k_scale ", scales_[0], ", v_scale ",
                      scales_[1], ")");
}

}  // namespace qcal::qsim
