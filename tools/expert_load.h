// How a mixture-of-experts model routes a text (issue 53): per MoE layer, how many tokens each
// expert receives under the model's own routing. What calibration on that text can give each
// expert's Hessian: an expert that receives fewer tokens than it has inputs gets a
// rank-deficient Hessian (GPTQ's and BlockLDLQ's factorizations then rest on the damping alone),
// and one that receives none gets no Hessian at all -- the failure MoE quantizers meet on real
// calibration sets (llm-compressor #1864, GPTQModel #1376).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::tools {

struct ExpertLoad {
  int64_t tokens = 0;  // tokens of the text run through the model (each routed once per layer)
  int64_t top_k = 0;   // experts per token
  int64_t inputs = 0;  // an expert's gate/up inputs (hidden_size): the full-rank threshold
  struct Layer {
    int64_t layer = 0;
    std::vector<int64_t> counts;  // tokens routed to each expert; they sum to tokens · top_k
    int64_t min() const;
    int64_t max() const;
    // Experts with no token / with fewer tokens than `inputs` (a rank-deficient Hessian).
    std::vector<int64_t> Unrouted() const;
    std::vector<int64_t> BelowRank(int64_t inputs) const;
  };
  std::vector<Layer> layers;  // the MoE layers, in order
};

// Runs each window of token ids (each a sequence of its own, BOS first if the caller wants one)
// through `model` and counts the routing of every MoE layer. InvalidArgument for a dense model,
// an empty window list, a window longer than max_position_embeddings or an id outside the
// vocabulary. The model's hooks are left as they were.
StatusOr<ExpertLoad> MeasureExpertLoad(model::LlamaModel& model,
                                       const std::vector<std::vector<int32_t>>& windows);

}  // namespace qcal::tools
