// Token-wise activation outliers and PrefixQuant's prefix (PrefixQuant §3–4, Eq. 3; the reference's
// get_prefixed_tokens, ../shared/reference/prefixquant-spinquant-notes.md (a)): the statistics
// shared by `qcal tool outlier-stats --token-stats` (tools/measure_token_outliers.h, an in-memory
// model) and the prefixquant method's prefix search (a job's global phase over the streamed
// model, data-parallel over ranks).
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
// The counts are integers, so reports of disjoint sets of sequences merge exactly (MergeCounts).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace qcal::qsim {

inline constexpr double kDefaultOutlierThreshold = 64.0;  // η, the reference's default

struct TokenOutlierLayer {
  double max_ratio = 0;        // largest M_t / median over every measured token
  int32_t max_token = -1;      // its token id
  int64_t max_position = -1;   // its position in its sequence
  int64_t count = 0;           // outlier tokens over all sequences (position 0 included)
  double mean_count = 0;       // count / sequences (FinishTokenOutliers)
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

// An empty report for `layers` layers.
TokenOutlierReport NewTokenOutlierReport(int64_t layers, double eta);

// Adds layer `layer`'s statistic of one sequence of n tokens: token_max[t] = M_t, ids[t] its token.
// (Counts sequences and tokens only for layer 0.)
void AddTokenOutliers(TokenOutlierReport* report, int64_t layer, const double* token_max,
                      const int32_t* ids, int64_t n);

// mean_count per layer and o, from the counts and the number of sequences.
void FinishTokenOutliers(TokenOutlierReport* report);

// The prefix of `report` (above): the chosen outlier ids followed by bos_id. Just [bos_id] when
// no token other than the first is an outlier.
std::vector<int32_t> PrefixTokens(const TokenOutlierReport& report, int32_t bos_id);

}  // namespace qcal::qsim
