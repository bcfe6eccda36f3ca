// What a block task produces, for every method: the quantized block's weights and, per linear,
// the proxy loss and bits (the journal's block_done metrics); and the one helper every method
// rounds a linear with (fp64 views of W and H, metrics filled in).
//
// A block task depends only on its inputs (float block weights, the block's Hessians and
// activations, the recipe and the layer index), so the service hands the same tasks to any rank
// (methods/method.h has the interface, runner/job_steps.h runs it).
#pragma once

#include <cstdint>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::quant {

struct LinearMetrics {
  std::string name;        // "self_attn.q_proj", ...
  double proxy_loss = 0;   // tr((Ŵ − W) H (Ŵ − W)ᵀ) in the original space (NaN without H)
  double relative = 0;     // proxy_loss / tr(W H Wᵀ)
  double code_bits = 0;    // bits of codes per original weight
  double stored_bits = 0;  // all stored tensors (codes, signs, scales, ...) per original weight
  double seconds = 0;
  // Where `seconds` went (0 for a step the rounding has not): incoherence transforms (and their
  // inverse), the Hessian's factorization, the rounding pass, refinement sweeps, the proxy loss.
  double transform_seconds = 0;
  double factor_seconds = 0;
  double round_seconds = 0;
  double refine_seconds = 0;
  double proxy_seconds = 0;
};

// One fine-tuning run's learning curve: the held-out loss before training and after each epoch
// (heldout[0] is before), and each epoch's mean training loss (train[e - 1] is epoch e's).
struct FinetuneCurve {
  std::vector<double> heldout;
  std::vector<double> train;
};

struct BlockTaskResult {
  int64_t layer = 0;
  model::BlockWeights weights;  // norms copied, linears quantized
  std::vector<LinearMetrics> linears;
  double seconds = 0;
  // Block output MSE on held-out calibration sequences without / with fine-tuning
  // (finetune.h BlockTuner); NaN when the block was not fine-tuned.
  double mse_before_ft = std::numeric_limits<double>::quiet_NaN();
  double mse_after_ft = std::numeric_limits<double>::quiet_NaN();
  // Seconds spent tuning (within-block fine-tuning; 0 without).
  double finetune_seconds = 0;
  // The fine-tuning runs' curves, in order (QuIP#: one per group of linears; empty without).
  std::vector<FinetuneCurve> ft_curves;
};

struct QuantizedLinear {
  std::unique_ptr<model::Linear> layer;
  LinearMetrics metrics;
};

// One linear to round, as the rounding kernels read it: W [out, in] row-major fp64 and the
// input Hessian H [in, in] fp64 (or null). A rounder may use H's storage as work space (GPTQ:
// kernels::GptqInPlace) but leaves it as it found it when it returns OK (H is shared: q/k/v
// round with one, gate/up with another).
//
// A method rounds a linear in three steps, with no callback between it and this layer:
//   QCAL_ASSIGN_OR_RETURN(quant::LinearProblem p, quant::PrepareLinear(layer, kind, w, h, ...));
//   return quant::FinishLinear(p, its_rounding(p.weight(), p.out, p.in, p.hessian()));
struct LinearProblem {
  int64_t layer = 0;
  model::LinearKind kind = model::LinearKind::kQ;
  // A MoE block's routed expert whose linear this is (kind: its role, kGate/kUp/kDown); -1 for
  // the block's dense linears.
  int64_t expert = -1;
  int64_t out = 0, in = 0;
  at::Tensor w;  // [out, in] fp64 contiguous (a copy)
  at::Tensor h;  // [in, in] fp64 contiguous (the caller's Hessian, read in place), or undefined
  std::chrono::steady_clock::time_point start;
  const double* weight() const;
  double* hessian() const;  // null without a Hessian
};

// `weight` [out, in] (any float dtype; converted to fp64), `hessian` [in, in] (fp64 mean, read in
// place when contiguous fp64; undefined when the method uses none). `method` names the method in
// errors; `needs_hessian` refuses an undefined one. `expert` >= 0: routed expert `expert`'s
// linear of role `kind`. Errors name "block <layer> <linear>" (LinearProblemName).
StatusOr<LinearProblem> PrepareLinear(int64_t layer, model::LinearKind kind,
                                      const at::Tensor& weight, const at::Tensor& hessian,
                                      const char* method, bool needs_hessian,
                                      int64_t expert = -1);
// The linear's name in metrics: model::LinearName ("mlp.gate_proj") or, for an expert's,
// model::ExpertLinearName ("experts.3.gate_proj").
std::string LinearProblemName(model::LinearKind kind, int64_t expert);
// The routed-expert linear of role `kind` (kGate, kUp; anything else kDown): the inverse of
// model::ExpertLinearKind.
model::ExpertLinear ExpertRoleOf(model::LinearKind kind);
// The rounding's result with metrics.name and seconds filled in, and NaN proxy losses without a
// Hessian; an error annotated with "block <layer> <linear>".
StatusOr<QuantizedLinear> FinishLinear(const LinearProblem& problem,
                                       StatusOr<QuantizedLinear> rounded);

}  // namespace qcal::quant
