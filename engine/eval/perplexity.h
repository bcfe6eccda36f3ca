// Perplexity of a causal language model over a token stream.
//
// Two windowing conventions:
//  * default (GPTQ / QuIP# / QuaRot): the text is tokenized once with one BOS at the start;
//    the stream is cut into non-overlapping windows of `ctx` tokens, the incomplete tail is
//    dropped, and within each window tokens 1..ctx-1 are predicted from their prefix.
//  * bos_per_window (llama2.c style, the golden numbers): windows start at 0, ctx-1, 2(ctx-1), …
//    of the text tokens (no BOS in the stream); each window is BOS + the next ctx-1 tokens (the
//    last may be shorter) and every token after BOS is predicted, so every text token is scored.
// perplexity = exp(mean NLL over all predicted tokens); NLL is summed in double.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"

namespace qcal::eval {

struct PerplexityOptions {
  int64_t ctx = 512;
  bool bos_per_window = false;
  int64_t max_tokens = -1;  // use at most this many text tokens (-1: all)
  int64_t batch = 1;        // windows per forward pass (1 is fastest on CPU for small models)
  int32_t bos_id = 1;
};

struct PerplexityResult {
  int64_t tokens_encoded = 0;  // text tokens available (after max_tokens)
  int64_t tokens_scored = 0;   // predicted tokens
  int64_t windows = 0;
  double mean_nll = 0;
  double perplexity = 0;
  double seconds = 0;
  double tokens_per_s = 0;  // scored tokens per second of model time
};

// progress(done_windows, total_windows) is called after each batch.
using ProgressFn = std::function<void(int64_t, int64_t)>;

// InvalidArgument when ctx < 2, ctx exceeds the model's max positions, or no window fits.
// With a prefix installed on the model (model::PrefixKv, PrefixQuant) every window attends to
// prefix + window and the prefix is never scored; when the prefix ends with BOS, a window that
// starts with BOS runs without it (the prefix's BOS stands for it) and its first text token,
// which only the BOS predicted, is not scored (tokens_scored says how many were).
StatusOr<PerplexityResult> EvaluatePerplexity(const model::LlamaModel& model,
                                              const std::vector<int32_t>& text_tokens,
                                              const PerplexityOptions& options,
                                              const ProgressFn& progress = nullptr);

struct StreamOptions {
  // The windows' activations held in memory; above it, the file spill_path holds them.
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();
  std::string spill_path;
  std::function<void(int64_t block, int64_t blocks)> block_progress;
  // Where each block runs (the activations stay on the host between blocks); a block that cannot
  // move there (Linear::MoveTo) runs on the host, said once. The head runs on the host.
  at::Device device = at::kCPU;
};

// The same result, bit for bit, with one block of the model in memory at a time: every window
// is embedded, then every block (read from `source` when the walk reaches it) runs over every
// window, then the head scores them. Memory: one block, the head at the end, and the windows'
// activations (spilled above the budget).
StatusOr<PerplexityResult> EvaluatePerplexityStreamed(model::ModelSource& source,
                                                      const std::vector<int32_t>& text_tokens,
                                                      const PerplexityOptions& options,
                                                      const StreamOptions& stream,
                                                      const ProgressFn& progress = nullptr);

}  // namespace qcal::eval
