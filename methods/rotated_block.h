// What the rotation methods (quarot, spinquant, prefixquant) keep beside a rotated block's
// linears: model::BlockWeights::extra tensors, stored in the block's shard as
// model.layers.<l>.<key> (docs/formats.md "QuaRot checkpoints"). The names are part of the
// checkpoint format and never change.
#pragma once

#include <cstdint>

#include "common/hf_config.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods {

// [4, 2] F64, (lo, hi) of the four linear inputs in calib::HessianKind order (qkv, o, gate_up,
// down — down after the online R4 transform): calibrated static ranges.
inline constexpr char kActRangesKey[] = "quarot.act_ranges";
// [2, 2] F64, (lo, hi) of keys (after RoPE and R3) and values.
inline constexpr char kKvRangesKey[] = "quarot.kv_ranges";
// [4] F64, the rotations applied to the block (R1..R4 as 1/0), set by RotateAndMarkBlock; the
// quantizers refuse a rotation method's block without it.
inline constexpr char kRotationsKey[] = "quarot.rotations";
// Not an extra but BlockWeights::rope_perm, stored beside them: [kv_heads, head_dim] F64 (whole
// numbers), the K-sort channel permutation of a `kv_cache.k_sort` recipe's block.
inline constexpr char kRopePermKey[] = "quarot.rope_perm";

// qsim::RotateBlockWeights (norm fusion, R1, R2, R4's fused half), then records the plan's
// R1..R4 under kRotationsKey.
Status RotateAndMarkBlock(model::BlockWeights& weights, const LlamaConfig& config,
                          const qsim::RotationPlan& plan, int64_t layer);

}  // namespace qcal::methods
