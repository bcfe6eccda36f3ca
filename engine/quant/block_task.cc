#include "engine/quant/block_task.h"

#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::quant {
namespace {

std::string Where(int64_t layer, model::LinearKind kind, int64_t expert) {
  return absl::StrCat("block ", layer, " ", LinearProblemName(kind, expert));
}

}  // namespace

std::string LinearProblemName(model::LinearKind kind, int64_t expert) {
  if (expert < 0) return model::LinearName(kind);
  return model::ExpertLinearName(expert, ExpertRoleOf(kind));
}

model::ExpertLinear ExpertRoleOf(model::LinearKind kind) {
  return kind == model::LinearKind::kGate ? model::ExpertLinear::kGate
         : kind == model::LinearKind::kUp ? model::ExpertLinear::kUp
                                          : model::ExpertLinear::kDown;
}

const double* LinearProblem::weight() const { return w.data_ptr<double>(); }
double* LinearProblem::hessian() const { return h.defined() ? h.data_ptr<double>() : nullptr; }

StatusOr<LinearProblem> PrepareLinear(int64_t layer, model::LinearKind kind,
                                      const at::Tensor& weight, const at::Tensor& hessian,
                                      const char* method, bool needs_hessian, int64_t expert) {
  LinearProblem p;
  p.start = std::chrono::steady_clock::now();
  p.layer = layer;
  p.kind = kind;
  p.expert = expert;
  p.out = weight.size(0);
  p.in = weight.size(1);
  if (needs_hessian && !hessian.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(layer, kind, expert), ": method ", method, " needs a Hessian"));
  }
  // fp64 views: the weight is converted (a copy); a contiguous fp64 Hessian (what
  // HessianAccumulator::Mean returns) is read in place, not copied.
  p.w = weight.to(at::kDouble).contiguous();
  if (hessian.defined()) {
    if (hessian.dim() != 2 || hessian.size(0) != p.in || hessian.size(1) != p.in) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(layer, kind, expert), ": Hessian is not ", p.in, "x", p.in));
    }
    p.h = hessian.to(at::kDouble).contiguous();
  }
  return p;
}

StatusOr<QuantizedLinear> FinishLinear(const LinearProblem& p, StatusOr<QuantizedLinear> q) {
  if (!q.ok()) return Annotate(q.status(), Where(p.layer, p.kind, p.expert));
  q->metrics.name = LinearProblemName(p.kind, p.expert);
  if (!p.h.defined()) q->metrics.proxy_loss = q->metrics.relative = std::nan("");
  q->metrics.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - p.start).count();
  return q;
}

}  // namespace qcal::quant
