#include "engine/quant/block_task.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::quant {

StatusOr<QuantizedLinear> RoundLinear(int64_t layer, model::LinearKind kind,
                                      const at::Tensor& weight, const at::Tensor& hessian,
                                      const char* method, bool needs_hessian,
                                      const LinearRounder& round) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t out = weight.size(0), in = weight.size(1);
  const std::string where = absl::StrCat("block ", layer, " ", model::LinearName(kind));
  if (needs_hessian && !hessian.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": method ", method, " needs a Hessian"));
  }
  // fp64 views: the weight is converted (a copy); a contiguous fp64 Hessian (what
  // HessianAccumulator::Mean returns) is read in place, not copied.
  const at::Tensor w = weight.to(at::kDouble).contiguous();
  at::Tensor h;
  if (hessian.defined()) {
    if (hessian.dim() != 2 || hessian.size(0) != in || hessian.size(1) != in) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": Hessian is not ", in, "x", in));
    }
    h = hessian.to(at::kDouble).contiguous();
  }
  double* hp = h.defined() ? h.data_ptr<double>() : nullptr;
  StatusOr<QuantizedLinear> q = round(w.data_ptr<double>(), out, in, hp);
  if (!q.ok()) return Annotate(q.status(), where);
  q->metrics.name = model::LinearName(kind);
  if (hp == nullptr) q->metrics.proxy_loss = q->metrics.relative = std::nan("");
  q->metrics.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return q;
}

}  // namespace qcal::quant
