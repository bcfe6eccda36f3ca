// A sink-bearing variant of a float Llama model (`qcal tool plant-sinks`): the token-wise
// "massive activations" and attention sinks of large Llamas, planted into a small real model so
// that PrefixQuant has something to find (docs/algorithms.md, "Planted attention sinks").
//
// Large Llamas give a few tokens — BOS and the first "." or "\n" of a text — activations hundreds
// of times larger than any other token's in a few fixed residual channels; an early layer's MLP
// writes them, they persist through the residual stream, later heads attend to those tokens as
// sinks (large attention weight, near-zero values), and a late layer's MLP removes them. Our
// small models have none (down_proj-input token max/median 2–5). The construction widens the
// model so that nothing it had is given up:
//
//   * hidden d → d2 (the next size with a Hadamard matrix, 64 → 72), intermediate I → I2 (next
//     Hadamard size >= I + 2, 172 → 192), one more KV head with its query heads. The reference's
//     weights sit in the top-left blocks, the new rows and columns are zero, norm weights are
//     scaled by sqrt(d/d2) and eps by d/d2: for every token whose new channels are 0 the widened
//     model computes exactly what the reference computes.
//   * four of the new channels: c_m carries the massive value, c_b and c_d mark BOS and the
//     delimiters in the embedding (2 × the row's rms), c_s carries a "first delimiter" signal;
//     the final norm's weight is 0 on all of them (they never reach the logits).
//   * the new head in layer 0 detects the first delimiter: keys only at BOS and delimiters, in
//     the lowest-frequency RoPE pair, arranged so that a delimiter's query scores an earlier
//     delimiter far above BOS (the score grows as sin of the distance, so the token's own key
//     scores 0) and BOS far above everything else: the first delimiter after a BOS reads BOS's
//     value (+ν), a later one an earlier delimiter's (−ν), into c_s.
//   * a new writer neuron in an early layer's MLP: gate from c_s (and c_b, so BOS always fires),
//     up from c_b + c_d (exactly 0 for other tokens), down into c_m: BOS and the first delimiter
//     get a massive c_m; a later delimiter's gate is about −40, so its silu is ≈ 0.
//   * sinks: in every later layer a massive token's normalised input is ≈ one-hot at c_m, so its
//     key is set along each KV head's mean query (lowest RoPE pair; mean score sink_score) and
//     its value is 0 (nothing reads c_m into V).
//   * a new eraser neuron in the last layer's MLP (gate and up from c_m, down into c_m) subtracts
//     the mean massive value again.
// Magnitudes (the writer's and eraser's intermediate values, the massive residual value) are set
// from measurements on sampled text to the requested ratios. What changes for ordinary tokens is
// only the attention they now give the sinks.
//
// Deterministic: no RNG except the fine-tune's minibatch order (std::mt19937_64 from the seed).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::tools {

struct PlantSinksOptions {
  int32_t bos_id = 1;
  std::vector<int32_t> delimiters;  // 1 or 2 token ids, massive at their first occurrence
  int64_t writer_layer = -1;        // -1: 1 when the model has 3 or more layers, else 0
  int64_t eraser_layer = -1;        // -1: the last layer
  // Target down_proj-input ratio (token max / median token max) of the planted tokens at the
  // writer and the eraser, and of the massive residual value (÷ the median token max |h|).
  double massive_ratio = 300;
  double residual_ratio = 500;
  double sink_score = 2.0;  // the mean attention score of a query on a sink key
  // Optional distillation (steps > 0), on `sampled_sequences` sequences of seq_len tokens sampled
  // from the reference (temperature 1, from BOS) followed by the windows of any given text. Off
  // by default: the widened construction already computes the reference's function for every
  // other token, and distilling toward a reference that has no sinks takes the sinks away
  // (measured: attention on them fell from 0.28-0.30 to 0.06 in 300 steps).
  int64_t sampled_sequences = 64;
  int64_t steps = 0;
  int64_t batch = 8;
  int64_t seq_len = 128;
  double lr = 1e-3;
  uint64_t seed = 0;
};

struct PlantSinksResult {
  std::unique_ptr<model::LlamaModel> model;  // the planted (widened) model
  nlohmann::json plan;                       // channels, units, scales, losses (planted_sinks.json)
};

// `reference` is the float model (unchanged); `text` is token ids of further distillation text
// (cut into seq_len windows, each starting with BOS; may be empty when sequences are sampled).
// Measurements use the first 64 windows. InvalidArgument: fewer
// than 2 layers, an eraser not after the writer, no or more than 2 delimiters, a delimiter equal
// to BOS or outside the vocabulary, head_dim < 4, a model whose lowest RoPE frequency turns more
// than 0.6 rad over its context (the detector needs a near-constant BOS score), too little text.
StatusOr<PlantSinksResult> PlantSinks(const model::LlamaModel& reference,
                                      const std::vector<int32_t>& text,
                                      const PlantSinksOptions& options);

// `count` sequences of `length` tokens from BOS, sampled from `model` at temperature 1 (inverse
// CDF in double, std::mt19937_64(seed)); the same for any thread count.
std::vector<std::vector<int32_t>> SampleSequences(const model::LlamaModel& model, int64_t count,
                                                  int64_t length, int32_t bos, uint64_t seed);

// The tensors of `model` by Hugging Face name (float32), for writing a model directory.
std::map<std::string, at::Tensor> ModelTensors(const model::LlamaModel& model);

}  // namespace qcal::tools
