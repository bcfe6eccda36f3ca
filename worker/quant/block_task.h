// The block task: quantize every linear of one decoder block from its float weights and input
// Hessians, according to a recipe. This is the unit the service schedules (one block per task),
// so it depends only on its inputs: float block weights, the block's four Hessians, the recipe,
// and the layer index (which, with the recipe seed, fixes the random transforms).
//
// QuIP# (method quip): per linear W [out, in], pad in to a multiple of the codebook dimension
// (zero columns; the Hessian gets zero rows/columns there, made positive definite by damping),
// pad out to an even size when it has no Hadamard construction; IP-RHT with seeds derived from
// (recipe.seed, layer, linear) (kernels/incoherence.h; RFFT where no Hadamard size exists);
// BlockLDLQ with the recipe's codebook (E8P, RVQ, half-integer grid) at scale RMS(W)/ρ; the
// result is a quant::QuipLinear. Baselines: rtn (kernels::RoundToNearest) and gptq
// (kernels::Gptq) on the scalar grid of the recipe, giving quant::ScalarQuantLinear.
//
// QuaRot (method quarot): `float_weights` are the *rotated* float block (worker/quarot/rotate.h:
// norms fused, R1/R2/R4 fused; down_proj an ActQuantLinear carrying the online R4 Hadamard T) and
// `hessians` were collected on that block (recorders outside the wrappers, so down_proj's is the
// Hessian before T; it is turned into T·H·Tᵀ here). Each dense weight is rounded by recipe.weights
// (rtn, gptq; none keeps it float) on the recipe's scalar grid (QuaRot: per channel, symmetric,
// clip search), codes packed two per byte at <= 4 bits, and re-wrapped with its transform. The
// activation / KV quantizers are not part of the block task: quarot::InstallQuantizedInference
// adds them when the model is assembled.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "worker/calib/hessian.h"
#include "worker/model/llama.h"

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

// Quantizes one linear: weight [out, in] float, h = its input Hessian [in, in] (fp64 mean), or an
// undefined tensor for rtn.
StatusOr<QuantizedLinear> QuantizeLinear(const Recipe& recipe, int64_t layer,
                                         model::LinearKind kind, const at::Tensor& weight,
                                         const at::Tensor& h);

// `hessians` may be null for rtn (no proxy loss is then reported). Errors: unsupported method /
// codebook, Hessian sizes not matching the weights, factorisations that fail after damping.
StatusOr<BlockTaskResult> QuantizeBlock(const Recipe& recipe, const LlamaConfig& config,
                                        int64_t layer, const model::BlockWeights& float_weights,
                                        const calib::BlockHessians* hessians);

// The per-linear seed of the random transforms: a hash of (recipe seed, layer, linear, side).
uint64_t TransformSeed(uint64_t recipe_seed, int64_t layer, model::LinearKind linear, bool output);

}  // namespace qcal::quant
