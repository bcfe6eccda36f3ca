// PrefixQuant block by block (method prefixquant): the static quantization of one rotated block
// on its calibration inputs (the outputs of the quantized blocks before it, behind the prefix),
// its inference pieces installed from the block's extras, and the per-block tensors of the
// checkpoint (docs/formats.md "PrefixQuant checkpoints").
//
// One block (QuantizePrefixquantBlock), following the reference (notes (c)):
//   1. one float pass over all calibration inputs records, at the four linear inputs (qkv, o,
//      gate_up, down — down after R4), max|x| and the Gram matrix XᵀX, and the per-head max |K|
//      (after RoPE and R3) and |V|; the float block's outputs on the search sequences (the first
//      search_sequences inputs) are the search targets;
//   2. weights, per output channel: step c·2·max|w|/(2^b − 1) with c in {1.00, 0.95, …, 0.55}
//      minimising the layer-output error (ŵ − w)ᵀ XᵀX (ŵ − w) of that channel;
//   3. with the rounded weights in place, greedily in forward order, each quantizer's step
//      scaled from its min/max init: the qkv input (block-output MSE; c over {0.25, 0.35, …, 0.95,
//      1.0}, then 10 points on [c* − 0.05, c* + 0.05]), K per head (MSE of the attention
//      probabilities over prefix + sequence; c over {1.00, …, 0.55}), V per head (MSE of V), the
//      o, gate_up and down inputs (block-output MSE, as the qkv input). Each searched quantizer
//      stays on for the next search. Without grid_search every step is its min/max init.
//   4. with block_ft: the block-wise fine-tuning (block_ft.h) of the float weights (behind their
//      per-channel fake quantizers) and of every step size, the targets being the float block's
//      outputs on the float model's inputs (x_float, behind the same prefix); then the weights
//      are rounded with their trained steps;
//   5. the quantized block (every quantizer on, the prefix in front) maps the inputs to the next
//      block's, and the float block the float inputs.
// The reference omits the attention mask in its fine search's forward and never tries c = 1 for
// activations; qcal passes the mask and includes 1 (with a prefix the ranges are already tight).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "methods/prefixquant/prefixquant_spec.h"
#include "engine/model/llama.h"
#include "engine/qsim/rotate.h"
#include "engine/quant/block_task.h"

namespace qcal::methods::prefixquant {

// Per-block extras (model::BlockWeights::extra), stored as model.layers.N.<key> F64:
inline constexpr char kActStepsKey[] = "prefixquant.act_steps";  // [4] qkv, o, gate_up, down
inline constexpr char kKStepsKey[] = "prefixquant.k_steps";      // [kv_heads]
inline constexpr char kVStepsKey[] = "prefixquant.v_steps";      // [kv_heads]
inline constexpr char kPrefixTokensKey[] = "prefixquant.prefix_tokens";  // [o]
inline constexpr char kPrefixKKey[] = "prefixquant.prefix_k";    // [kv_heads, o, head_dim]
inline constexpr char kPrefixVKey[] = "prefixquant.prefix_v";    // [kv_heads, o, head_dim]

// The prefix of a block from its extras (null when it has none); InvalidArgument for
// inconsistent shapes.
StatusOr<std::shared_ptr<const model::PrefixKv>> PrefixFromExtras(const model::BlockWeights& w,
                                                                  const LlamaConfig& config,
                                                                  int64_t layer);
// Stores `prefix` in the block's extras.
void PrefixToExtras(const model::PrefixKv& prefix, model::BlockWeights* w);

// Installs what inference computes with on a block whose linears are final (rounded or float,
// possibly wrapped): R3, the prefix, the static KV hook and a StaticActLinear on each linear (R4
// on down_proj), from the block's extras. InvalidArgument when a step the recipe needs is
// missing or malformed.
Status InstallStaticInference(model::DecoderBlock& block, const LlamaConfig& config,
                              const PrefixquantConfig& q, const qsim::RotationPlan& plan,
                              int64_t layer);

// Steps 1–5 above on a block prepared by RotateAndMarkBlock (float dense linears);
// `prefix` (or null) is the block's prefix K/V from the float model. x: the block's calibration
// inputs [N, S, hidden]; with `propagate` replaced by the quantized block's outputs. x_float: the
// float model's inputs [N, S, hidden] (needed with block_ft, else may be null), replaced by the
// float block's outputs with `propagate`. The result holds the quantized weights with the steps
// and prefix in extras (and the held-out MSE before / after fine-tuning). `progress` (optional):
// (done, total, step) after each of the steps above.
StatusOr<quant::BlockTaskResult> QuantizePrefixquantBlock(
    model::BlockWeights weights, const LlamaConfig& config, const model::Rope& rope,
    const PrefixquantConfig& q, const qsim::RotationPlan& plan,
    std::shared_ptr<const model::PrefixKv> prefix, int64_t layer, at::Tensor* x,
    at::Tensor* x_float, int64_t batch, bool propagate,
    const std::function<void(int64_t, int64_t, const std::string&)>& progress = nullptr);

// The float block (prepared weights, online rotations, `prefix` in front) on x.
StatusOr<at::Tensor> FloatBlockForward(model::BlockWeights prepared, const LlamaConfig& config,
                                       const model::Rope& rope, const qsim::RotationPlan& plan,
                                       std::shared_ptr<const model::PrefixKv> prefix,
                                       int64_t layer, const at::Tensor& x, int64_t batch);

// The block's extras for its shard, every one as model.layers.N.<key> F64 (the norms and linears
// are the method's, methods/method.h AppendLinear).
Status AppendPrefixquantExtras(int64_t layer, const model::BlockWeights& weights,
                               SafetensorsWriter* writer);
// Reads them back into weights->extra, checked against config.json's shapes (the prefix against
// itself too).
Status LoadPrefixquantExtras(CheckpointReader& ckpt, const LlamaConfig& config, int64_t layer,
                             model::BlockWeights* weights);

}  // namespace qcal::methods::prefixquant
