// Activation outlier statistics of a float model: how far its largest channel stands out.
//
// For an activation X [tokens, channels] the magnitude of channel c is m_c = max_t |X[t, c]| (the
// quantity a per-tensor or per-token scale must cover), and the outlier ratio is
// max_c m_c / median_c m_c (median of an even count = mean of the two middle values). Measured,
// per decoder layer, at the three places the rotation methods target:
//   * down_proj input (silu(gate x) ⊙ up x) — QuaRot's R4;
//   * o_proj input (attention output, heads concatenated) — R2;
//   * K: k_proj output before RoPE, all KV heads' channels — R3 and K-sort.
// Llama-2-7B shows ratios in the hundreds at the down_proj input; our tiny real models 2–7.
//
// Measurement wraps the block's Linear objects (k_proj, o_proj, down_proj) with recording
// wrappers for the duration of the call and restores them afterwards, so the forward code is not
// touched. The model must not be used by another thread during the call.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::tools {

struct LayerOutlierStats {
  double down_input = 0;  // max/median channel ratio of the down_proj input
  double o_input = 0;     // of the o_proj input
  double k = 0;           // of K (k_proj output, pre-RoPE)
};

struct OutlierStats {
  std::vector<LayerOutlierStats> layers;
  int64_t tokens = 0;
  // Max over layers, per place.
  LayerOutlierStats Max() const;
};

// max/median over the channels of `magnitudes` (>= 1 values). 0/0 (all zero) gives 0;
// x/0 with x > 0 gives +inf.
double MaxOverMedian(std::vector<double> magnitudes);

// Runs `tokens` through the model in windows of `ctx` (each window BOS + ctx-1 tokens, the last
// one shorter) and measures the statistics above. InvalidArgument for ctx < 2, ctx beyond the
// model's positions, no tokens, or a block whose k/o/down linear is missing.
StatusOr<OutlierStats> MeasureOutlierStats(model::LlamaModel& model,
                                           const std::vector<int32_t>& tokens, int64_t ctx,
                                           int32_t bos_id);

}  // namespace qcal::tools
