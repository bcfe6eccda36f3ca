// QuaRot (QuaRot §4; method quarot recipes, jobs/README.md), block by block: rotate (stage 1,
// engine/qsim/rotate.h), quantize the weights with RTN or GPTQ (stage 2a) — GPTQ calibrated
// sequentially: block l's Hessians are collected on the outputs of blocks 0..l-1 *already
// quantized* (QuaRot's gptq_fwrd), with float activations as QuaRot calibrates —, calibrate
// static activation / KV ranges when the recipe asks for them (same pass), and install the
// simulated quantized inference (stage 2b/2c): per-token (or per-tensor) activation quantization
// at every block-linear input, the online Hadamards, and the KV-cache quantizer. The embedding,
// final norm and head stay float (QuaRot keeps lm_head in FP16).
//
// The block functions are what the method (methods/quarot/quarot_method.h) runs in a job's block
// tasks, one block in memory at a time. A whole model is quantized by a job (runner/), as every
// method's is; PrepareModel applies the function-preserving transforms to an in-memory model
// (tests, references).
//
// Every function takes a quarot recipe (InvalidArgument otherwise). Thread-safety: the
// functions mutate the block / model passed in; single-threaded apart from LibTorch's intra-op
// threads.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/recipe.h"
#include "common/status.h"
#include "methods/quarot/quarot_spec.h"
#include "engine/model/llama.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/rotate.h"
#include "kernels/gpu_backend.h"
#include "engine/quant/block_task.h"

namespace qcal::methods::quarot {

// The recipe's QuaRot settings; InvalidArgument naming the recipe when it is another method's.
StatusOr<const QuarotConfig*> QuarotSettings(const Recipe& recipe);

// The float transforms of one block, before it is quantized: norm fusion and R1/R2/R4's fused
// halves (RotateAndMarkBlock), then, for `kv_cache.k_sort`, K-sort (Algorithm 1: W_k/W_q
// rows and the RoPE tables per KV head, V rows with o_proj columns). Function-preserving; the
// online halves are installed on the DecoderBlock (qsim::InstallOnlineRotations).
Status PrepareBlockWeights(model::BlockWeights& weights, const LlamaConfig& config,
                           const Recipe& recipe, const qsim::RotationPlan& plan, int64_t layer);

// PrepareBlockWeights + online rotations on every block, and the non-block weights
// (qsim::RotateNonBlockWeights), in place: the whole float model transformed.
Status PrepareModel(model::LlamaModel& model, const Recipe& recipe,
                    const qsim::RotationPlan& plan);

// The static activation quantizer's parameters of linear `kind`'s input in block `layer` (the
// quantizer InstallQuantizedInference installs there). InvalidArgument when the recipe is not
// static or the block has no calibrated ranges.
// The block's calibrated key and value ranges (a static KV cache's; InvalidArgument otherwise).
StatusOr<qsim::KvStaticRanges> StaticKvRanges(const model::BlockWeights& weights,
                                              const QuarotConfig& q, int64_t layer);

StatusOr<qsim::FixedQuantParams> StaticInputQuantParams(const model::BlockWeights& weights,
                                                        const QuarotConfig& q, int64_t layer,
                                                        model::LinearKind kind);

// Installs the inference-time pieces of a quarot recipe on a block whose weights are final
// (rotated, rounded or float; down_proj may already carry its R4 ActQuantLinear): the R3 hook,
// the KV-cache quantizer, and an ActQuantLinear on each of the seven linears (online R4 on
// down_proj; the recipe's activation quantizer, static ones from the block's extra ranges).
// Idempotent: existing ActQuantLinear wrappers are replaced. InvalidArgument when a static
// recipe's ranges are missing.
Status InstallQuantizedInference(model::DecoderBlock& block, const LlamaConfig& config,
                                 int64_t layer, const Recipe& recipe,
                                 const qsim::RotationPlan& plan);

// One block of the sequential loop, on a block prepared by PrepareBlockWeights with its online
// rotations installed: collects the block's Hessians from *x (its calibration inputs
// [N, S, hidden], the outputs of the quantized blocks before it) when the recipe needs them,
// rounds every linear (rtn / gptq / none, with the Hessian of what it really multiplies: T·H·Tᵀ
// behind an online transform T), leaves the quantized weights in the block (with the static
// ranges in extra when the recipe is static), and, when `propagate`, replaces *x by the quantized
// block's outputs (float activations, as QuaRot calibrates). x may be null when
// the recipe needs no calibration (QuarotConfig::sequential() false: no GPTQ, no static ranges). The result's metrics are filled; its weights are empty
// (they are in the block). `gpu`: the rank's backend (null: the CPU) for the Hessians and GPTQ.
// `progress` (optional): (done, total, step) after each of its steps (the Hessians, the
// rounding, the propagation).
StatusOr<quant::BlockTaskResult> QuantizeRotatedBlock(
    model::DecoderBlock& block, const model::Rope& rope, const Recipe& recipe,
    const qsim::RotationPlan& plan, int64_t layer, at::Tensor* x, int64_t batch, bool propagate,
    kernels::GpuBackend* gpu = nullptr,
    const std::function<void(int64_t, int64_t, const std::string&)>& progress = nullptr);

// The outputs of a block whose weights are final (rounded, read back from a shard) for inputs
// x, as the sequential loop propagates them (float activations, online Hadamards installed).
StatusOr<at::Tensor> PropagateFinishedBlock(model::DecoderBlock& block, const model::Rope& rope,
                                            const qsim::RotationPlan& plan, int64_t layer,
                                            const at::Tensor& x, int64_t batch);

}  // namespace qcal::methods::quarot
