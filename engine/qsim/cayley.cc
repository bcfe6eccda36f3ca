#include "engine/qsim/cayley.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace qcal::qsim {

bool QrRetractionStep(uint64_t seed, int64_t step, int64_t param, int64_t qr_period) {
  if (qr_period <= 1) return true;
  // SplitMix64 of the three, so every (seed, step, param) gets its own independent draw.
  uint64_t z = seed ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(step + 1)) ^
               (0xbf58476d1ce4e5b9ULL * static_cast<uint64_t>(param + 1));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z % static_cast<uint64_t>(qr_period) == 0;
}

at::Tensor CayleyStep(const at::Tensor& p_in, const at::Tensor& g_in, double lr,
                      bool qr_retraction, const CayleyOptions& options) {
  at::NoGradGuard no_grad;
  const at::Tensor p = p_in.detach().to(at::kDouble);
  const at::Tensor g = g_in.detach().to(at::kDouble);
  at::Tensor x = p / (p.norm(2, {1}, /*keepdim=*/true) + 1e-8);
  if (qr_retraction) {
    auto [q, r] = at::linalg_qr(x.t());
    q = q * at::sign(r.diagonal()).unsqueeze(0);  // column j signed by sign(R[j][j])
    x = q.t();
  }
  const at::Tensor v = -g.t();
  const at::Tensor mx = at::mm(v, x);
  const at::Tensor w_hat = mx - 0.5 * at::mm(x.t(), at::mm(x, mx));
  const at::Tensor w = w_hat - w_hat.t();
  const double norm1 = w.abs().sum(0).max().item<double>();
  const double alpha = std::min(lr, 1.0 / (norm1 + 1e-8));
  const at::Tensor xt = x.t();
  at::Tensor y = xt + alpha * v;
  for (int i = 0; i < 200; ++i) {
    at::Tensor next = xt + alpha * at::mm(w, 0.5 * (xt + y));
    const double change = (next - y).abs().max().item<double>();
    y = std::move(next);
    if (i + 1 >= options.iterations && change <= options.tolerance) break;
  }
  return y.t().contiguous();
}

double OrthogonalityError(const at::Tensor& p) {
  const at::Tensor d = p.to(at::kDouble);
  return (at::mm(d, d.t()) - at::eye(d.size(0), at::kDouble)).abs().max().item<double>();
}

}  // namespace qcal::qsim
