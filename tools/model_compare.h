// A quantized (or transformed) model against its float reference on the same text: both
// perplexities and the mean KL divergence KL(p_reference ‖ p_model) of the next-token
// distributions. The KL measures the damage quantization does independently of how well the
// float model fits the text — perplexity does not when the model is far out of domain
// (aidreams260K on TinyStories: perplexity 231, and key quantization noise can lower it).
//
// Windows follow eval::EvaluatePerplexity exactly (both conventions, max_tokens), one window per
// forward (batch is ignored), so `ppl_model` equals what `qcal eval` reports for the model. A
// model with an installed prefix that ends with BOS (PrefixQuant) reads each window that starts
// with BOS without it, as EvaluatePerplexity runs it, and that window's first text token is then
// scored in neither model (the prefixed model has no prediction for it).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "engine/eval/perplexity.h"
#include "engine/model/llama.h"

namespace qcal::tools {

struct ModelComparison {
  int64_t tokens_scored = 0;
  int64_t windows = 0;
  double nll_reference = 0, nll_model = 0;  // mean over scored tokens
  double ppl_reference = 0, ppl_model = 0;
  double mean_kl = 0;  // nats per scored token, KL(reference ‖ model)
  double seconds = 0;
};

// InvalidArgument when the vocabularies differ, ctx < 2 or beyond either model's positions, or
// no window fits (as EvaluatePerplexity).
StatusOr<ModelComparison> CompareToReference(const model::LlamaModel& reference,
                                             const model::LlamaModel& model,
                                             const std::vector<int32_t>& text_tokens,
                                             const eval::PerplexityOptions& options,
                                             const eval::ProgressFn& progress = nullptr);

}  // namespace qcal::tools
