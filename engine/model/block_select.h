// Part of a decoder block read from a checkpoint: a mixture-of-experts block split over tasks
// (runner/task_plan.h) reads only what its part quantizes, so a task's memory is bounded by its
// group of experts rather than the whole block.
#pragma once

#include <cstdint>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::model {

struct BlockSelection {
  // The block's weights besides its routed experts: norms, attention, the dense MLP or shared
  // expert, and a MoE block's router.
  bool dense = true;
  // The routed experts [expert_begin, expert_end) of a MoE block; expert_end -1: every expert.
  int64_t expert_begin = 0;
  int64_t expert_end = -1;
  // The routed experts held in the checkpoint's dtype when it is BF16 or F16 (WidenedLinear:
  // the same products as float32 layers, half the memory), float32 otherwise.
  bool experts_as_stored = false;
};

// Block `layer` as LoadBlockWeights reads it, limited to `select`: what is not selected stays
// undefined (norms), null (linears) or a null slot of moe->experts (a MoE block always gets its
// MoeWeights with one slot per expert; the router only with `dense`). OutOfRange for an expert
// range outside [0, num_experts].
StatusOr<BlockWeights> LoadBlockWeightsPart(CheckpointReader& ckpt, const LlamaConfig& config,
                                            int64_t layer, const BlockSelection& select);

}  // namespace qcal::model
