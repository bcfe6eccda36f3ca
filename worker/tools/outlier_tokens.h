// Token-wise activation outliers and PrefixQuant's prefix (PrefixQuant §3–4, Eq. 3; the reference's
// get_prefixed_tokens, ../shared/reference/prefixquant-spinquant-notes.md (a)).
//
// For one sequence and one layer, let M_t = max_c |X[t, c]| over the channels of the down_proj
// input X (silu(gate x) ⊙ up x) of token t. Token t is an outlier when M_t / median_t(M) > η.
// Measured over a set of sequences:
//   * per layer, the largest ratio and the token id and position where it occurs, the mean count
//     of outlier tokens per sequence (position 0 included), and the largest ratio of every token
//     id (over all its occurrences);
//   * o = ceil(max over layers of the mean count);
//   * the ids at outlier positions other than 0, counted once per (layer, sequence, position);
//     the prefix is the top-min(o, #distinct ids) ids by count (ties: smaller id first) followed
//     by BOS. The reference's corner case is kept: when there is exactly one distinct id and its
//     count is below 0.1 × the number of sequences, it is dropped.
//
// With a prefix installed on the model (model::InstallPrefixKv), sequences are measured after
// it: the statistics are of the sequences' own tokens (the prefix is in the KV cache, not among
// them).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common/status.h"
#include "worker/model/llama.h"

namespace qcal::tools {

inline constexpr double kDefaultOutlierThreshold = 64.0;  // η, the reference's default

struct TokenOutlierLayer {
  double max_ratio = 0;        // largest M_t / median over every measured token
  int32_t max_token = -1;      // its token id
  int64_t max_position = -1;   // its position in its sequence
  double mean_count = 0;       // outlier tokens per sequence (position 0 included)
  // The largest ratio of each token id, over its occurrences (the top few are reported).
  std::map<int32_t, double> ratio_by_token;
  // The largest ratio of the tokens not at position 0.
  double max_ratio_after_first = 0;
};

struct TokenOutlierReport {
  double eta = kDefaultOutlierThreshold;
  int64_t sequences = 0;
  int64_t tokens = 0;
  std::vector<TokenOutlierLayer> layers;
  std::map<int32_t, int64_t> outlier_id_counts;  // positions > 0, over layers and sequences
  int64_t o = 0;                                  // ceil(max_l mean_count)
  double MaxRatio() const;                        // over layers
};

// Runs every sequence (token ids; any length >= 2 up to the model's context) through the model,
// one at a time, and measures the statistics above. The model's down_proj linears are wrapped for
// the duration of the call (the model must not be used by another thread). InvalidArgument for
// no sequences, a sequence shorter than 2 or longer than the context, or eta <= 0.
StatusOr<TokenOutlierReport> MeasureTokenOutliers(model::LlamaModel& model,
                                                  const std::vector<std::vector<int32_t>>& sequences,
                                                  double eta = kDefaultOutlierThreshold);

// The prefix of `report` (above): the chosen outlier ids followed by bos_id. Just [bos_id] when
// no token other than the first is an outlier.
std::vector<int32_t> PrefixTokens(const TokenOutlierReport& report, int32_t bos_id);

// Windows of `tokens` of `ctx` tokens each: BOS + ctx-1 text tokens (with_bos) or ctx text
// tokens; the last window is shorter, and dropped when it would hold fewer than 2 tokens. At
// most max_windows windows (<= 0: all).
std::vector<std::vector<int32_t>> TextWindows(const std::vector<int32_t>& tokens, int64_t ctx,
                                              bool with_bos, int32_t bos_id,
                                              int64_t max_windows = 0);

}  // namespace qcal::tools
