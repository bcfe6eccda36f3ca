// QuaRot end to end on a loaded model (QuaRot §4; method quarot recipes, jobs/README.md):
// rotate (stage 1, worker/quarot/rotate.h), quantize the weights block by block with RTN or GPTQ
// (stage 2a, worker/quant/block_task.h) — GPTQ calibrated sequentially: block l's Hessians are
// collected on the outputs of blocks 0..l-1 *already quantized* (QuaRot's gptq_fwrd), with float
// activations as QuaRot calibrates —, calibrate static activation / KV ranges when the recipe
// asks for them (same pass), and install the simulated quantized inference (stage 2b/2c):
// per-token (or per-tensor) activation quantization at every block-linear input, the online
// Hadamards, and the KV-cache quantizer. The embedding, final norm and head stay float (QuaRot
// keeps lm_head in FP16).
//
// The sequential loop is offered with callbacks so that a job can persist every finished block
// and resume (a resumed block is read back and only propagated through).
//
// Thread-safety: mutates the model passed in; single-threaded apart from LibTorch's intra-op
// threads.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/recipe.h"
#include "common/status.h"
#include "worker/model/llama.h"
#include "worker/quant/block_task.h"
#include "worker/quarot/rotate.h"

namespace qcal::quarot {

// Names of the per-block tensors (model::BlockWeights::extra) holding calibrated static ranges.
//   kActRangesKey: [4, 2] F64, (lo, hi) of the four linear inputs in calib::HessianKind order
//                  (qkv, o, gate_up, down — down after the online R4 transform).
//   kKvRangesKey:  [2, 2] F64, (lo, hi) of keys (after RoPE and R3) and values.
//   kRotationsKey: [4] F64, the rotations applied to the block (R1..R4 as 1/0), set by
//                  RotateBlockWeights; quant::QuantizeBlock refuses a quarot block without it
//                  (an unrotated block handed over by a job without the quarot branch).
inline constexpr char kActRangesKey[] = "quarot.act_ranges";
inline constexpr char kKvRangesKey[] = "quarot.kv_ranges";
inline constexpr char kRotationsKey[] = "quarot.rotations";
// Not an extra but BlockWeights::rope_perm, stored beside them: [kv_heads, head_dim] F64 (whole
// numbers), the K-sort channel permutation of a `kv_cache.k_sort` recipe's block.
inline constexpr char kRopePermKey[] = "quarot.rope_perm";

// Whether the recipe needs calibration data at all (GPTQ weights or static ranges).
bool NeedsCalibration(const Recipe& recipe);

// Installs the inference-time pieces of a quarot recipe on a block whose weights are final
// (rotated, rounded or float; down_proj may already carry its R4 ActQuantLinear): the R3 hook,
// the KV-cache quantizer, and an ActQuantLinear on each of the seven linears (online R4 on
// down_proj; the recipe's activation quantizer, static ones from the block's extra ranges).
// Idempotent: existing ActQuantLinear wrappers are replaced. InvalidArgument when a static
// recipe's ranges are missing.
Status InstallQuantizedInference(model::DecoderBlock& block, const LlamaConfig& config,
                                 int64_t layer, const Recipe& recipe, const RotationPlan& plan);

struct SequentialCallbacks {
  // Block `layer` as a previous run finished it (read back from its shard: rounded weights,
  // norms, extras; down_proj without its R4 wrapper is fine), or std::nullopt to quantize it.
  std::function<StatusOr<std::optional<model::BlockWeights>>(int64_t layer)> load_finished;
  // After block `layer` is quantized (and its static ranges are in weights.extra): persist it.
  // `weights` holds the rounded linears (down_proj wrapped in its R4 ActQuantLinear when R4 is
  // on; quarot::WeightCarrier gives the rounded layer).
  std::function<Status(const quant::BlockTaskResult& result)> on_block_done;
  std::function<void(int64_t done, int64_t total)> progress;
};

struct QuarotReport {
  RotationPlan plan;
  std::vector<quant::BlockTaskResult> blocks;  // metrics only (weights moved into the model)
  std::vector<bool> resumed;
  int64_t calib_tokens = 0;
  double seconds = 0;
};

// The float transforms a recipe makes before any block is quantized: RotateModel(plan), then,
// for `kv_cache.k_sort`, K-sort (ApplyKSort, Algorithm 1: W_k/W_q rows and the RoPE tables per
// KV head, V rows with o_proj columns). Function-preserving; every process of a job runs it once
// on its float model.
Status PrepareModel(model::LlamaModel& model, const Recipe& recipe, const RotationPlan& plan);

// One block of the sequential loop on a model already prepared by PrepareModel(plan): collects
// block `layer`'s Hessians from *x (its calibration inputs [N, S, hidden], the outputs of the
// quantized blocks before it) when the recipe needs them, quantizes it (quant::QuantizeBlock),
// leaves the quantized weights in the model's block (with the static ranges in extra when the
// recipe is static), and, when `propagate`, replaces *x by the quantized block's outputs (float
// activations, as QuaRot calibrates). x may be null when NeedsCalibration(recipe) is false. The
// result's metrics are filled; its weights are empty (they are in the model). The job's block
// step (worker/quant/job_steps.h) runs this with x read from the job directory.
StatusOr<quant::BlockTaskResult> QuantizeRotatedBlock(model::LlamaModel& model,
                                                      const Recipe& recipe,
                                                      const RotationPlan& plan, int64_t layer,
                                                      at::Tensor* x, int64_t batch,
                                                      bool propagate);

// The outputs of block `layer` (its weights final: rounded, read back from a shard) for inputs
// x, as the sequential loop propagates them (float activations, online Hadamards installed).
StatusOr<at::Tensor> PropagateFinishedBlock(model::LlamaModel& model, const RotationPlan& plan,
                                            int64_t layer, const at::Tensor& x, int64_t batch);

// The first block's calibration inputs: the embedding of `calib_tokens` [N, S] int64 (BOS
// first). InvalidArgument for missing or malformed tokens.
StatusOr<at::Tensor> EmbedCalibrationTokens(const model::LlamaModel& model, const Recipe& recipe,
                                            const at::Tensor& calib_tokens);

// The whole pipeline on `model` (loaded float, unmodified): rotate per the recipe, quantize every
// block, calibrate, install. `calib_tokens` [N, S] int64 (BOS first) may be undefined when
// NeedsCalibration(recipe) is false. `batch`: sequences per forward during calibration.
StatusOr<QuarotReport> QuantizeModel(model::LlamaModel& model, const Recipe& recipe,
                                     const at::Tensor& calib_tokens, int64_t batch,
                                     const SequentialCallbacks& callbacks = {});

}  // namespace qcal::quarot
