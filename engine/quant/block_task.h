// What a block task produces, for every method: the quantized block's weights and, per linear,
// the proxy loss and bits (the journal's block_done metrics); and the one helper every method
// rounds a linear through (fp64 views of W and H, metrics filled in).
//
// A block task depends only on its inputs (float block weights, the block's Hessians and
// activations, the recipe and the layer index), so the service hands the same tasks to any rank
// (methods/method.h has the interface, runner/job_steps.h runs it).
#pragma once

#include <cstdint>
#include <functional>
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
};

struct BlockTaskResult {
  int64_t layer = 0;
  model::BlockWeights weights;  // norms copied, linears quantized
  std::vector<LinearMetrics> linears;
  double seconds = 0;
  // Block output MSE on held-out calibration sequences without / with fine-tuning
  // (finetune.h QuantizeBlockWithFinetune); NaN when the block was not fine-tuned.
  double mse_before_ft = std::numeric_limits<double>::quiet_NaN();
  double mse_after_ft = std::numeric_limits<double>::quiet_NaN();
};

struct QuantizedLinear {
  std::unique_ptr<model::Linear> layer;
  LinearMetrics metrics;
};

// Rounds W [out, in] (row-major fp64) with the input Hessian H [in, in] (fp64, or null). A rounder
// may use H's storage as work space (GPTQ: kernels::GptqInPlace) but leaves it as it found it
// when it returns OK (H is shared: q/k/v round with one, gate/up with another).
using LinearRounder = std::function<StatusOr<QuantizedLinear>(const double* w, int64_t out,
                                                              int64_t in, double* h)>;

// Rounds one linear of block `layer`: `weight` [out, in] (any float dtype; converted to fp64),
// `hessian` [in, in] (fp64 mean, read in place when contiguous fp64; undefined when the method
// uses none). `method` names the method in errors; `needs_hessian` refuses an undefined one.
// Fills metrics.name and seconds, and NaN proxy losses without a Hessian. Errors are annotated
// with "block <layer> <linear>".
StatusOr<QuantizedLinear> RoundLinear(int64_t layer, model::LinearKind kind,
                                      const at::Tensor& weight, const at::Tensor& hessian,
                                      const char* method, bool needs_hessian,
                                      const LinearRounder& round);

}  // namespace qcal::quant
