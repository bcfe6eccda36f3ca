// QuaRot checkpoints (docs/formats.md, "QuaRot checkpoints"): the quantized-checkpoint layout
// (common/checkpoint_layout.h: one shard per block, shard 0 for the rest) holding the *rotated* model:
//   * shard 0: model.embed_tokens.weight (rotated by R1), model.norm.weight (ones after fusion),
//     lm_head.weight (always: the fused and rotated head is no longer the embedding), F32;
//   * block shards, under the model's tensor names (config.TensorName, LinearTensorName; a MoE
//     block's float32 router, rotated by R1, and each routed expert's gate/up/down as
//     ExpertTensorName): both RMSNorm weights (F32, ones after fusion), each linear as a
//     ScalarQuantLinear (codes packed two per byte at <= 4 bits, int8 above; F32 scales per
//     output channel) or, for weights: none, a dense .weight F32 (R4 and R2 already fused), and
//     the block's calibrated static ranges model.layers.N.quarot.act_ranges [4, 2] F64 /
//     quarot.kv_ranges [2, 2] F64 when the recipe is static;
//   * config.json: tie_word_embeddings false, quantization_config with method "quarot",
//     format "scalar" and the recipe (its rotation / activations / kv_cache sections), from which
//     a loader rebuilds the online transforms and quantizers.
// Shard 0 is written by the job (runner/: the method's row functions over the float tables), the
// blocks by the method's AppendBlockTensors. Loading (methods/method_factory.h LoadModel, through
// the method) runs the same simulated W·A·KV inference as the block task's quantized block
// (bit-identical; tested).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::quarot {

// One block's shard (atomic): norms, each linear's stored layer (model::Linear::stored(): the
// "scalar" or "dense" layer format, methods/layer_format.h), the block's extras and its K-sort rope_perm
// (kRopePermKey) when it has one. Returns the names.
StatusOr<std::vector<std::string>> WriteQuarotBlockShard(const std::string& path,
                                                         const LlamaConfig& config, int64_t layer,
                                                         const model::BlockWeights& weights);
// The same tensors, added to a writer (the method's BlockFormat).
Status AppendQuarotBlockTensors(const LlamaConfig& config, int64_t layer,
                                const model::BlockWeights& weights, SafetensorsWriter* writer);

// Reads block `layer` of a quarot checkpoint as stored: norms, rounded (or dense) linears without
// any online transform, extras. The method's BlockFormat::LoadBlock.
StatusOr<model::BlockWeights> LoadQuarotBlockWeights(CheckpointReader& ckpt,
                                                     const LlamaConfig& config, int64_t layer);

// Reads block `layer`'s extras (model.layers.N.quarot.*) into weights->extra, and its K-sort
// permutation into weights->rope_perm (InvalidArgument naming the file unless every row is a
// permutation of [0, head_dim)).
Status LoadQuarotBlockExtras(CheckpointReader& ckpt, const LlamaConfig& config, int64_t layer,
                             model::BlockWeights* weights);

// Checks that a block read back was made by this recipe: the rotations it records
// (kRotationsKey) are the plan's, and it has a K-sort permutation exactly when the recipe
// K-sorts. InvalidArgument naming `where` (the checkpoint) and the block.
Status CheckQuarotBlock(const std::string& where, int64_t layer, const model::BlockWeights& w,
                        const Recipe& recipe, const qsim::RotationPlan& plan);

}  // namespace qcal::methods::quarot
