// Token-wise activation outliers and PrefixQuant's prefix (PrefixQuant §3–4, Eq. 3; the reference's
// get_prefixed_tokens, ../shared/reference/prefixquant-spinquant-notes.md (a)).
//
// The statistics and the prefix rule are engine/qsim/token_outliers.h's (shared with the prefixquant
// method's prefix search); this file measures them on an in-memory model.
//
// With a prefix installed on the model (model::InstallPrefixKv), sequences are measured after
// it: the statistics are of the sequences' own tokens (the prefix is in the KV cache, not among
// them).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/qsim/token_outliers.h"

namespace qcal::tools {

using qsim::kDefaultOutlierThreshold;
using qsim::PrefixTokens;
using qsim::TokenOutlierLayer;
using qsim::TokenOutlierReport;

// Runs every sequence (token ids; any length >= 2 up to the model's context) through the model,
// one at a time, and measures the statistics above. The model's down_proj linears are wrapped for
// the duration of the call (the model must not be used by another thread). InvalidArgument for
// no sequences, a sequence shorter than 2 or longer than the context, or eta <= 0.
StatusOr<TokenOutlierReport> MeasureTokenOutliers(model::LlamaModel& model,
                                                  const std::vector<std::vector<int32_t>>& sequences,
                                                  double eta = kDefaultOutlierThreshold);

// Windows of `tokens` of `ctx` tokens each: BOS + ctx-1 text tokens (with_bos) or ctx text
// tokens; the last window is shorter, and dropped when it would hold fewer than 2 tokens. At
// most max_windows windows (<= 0: all).
std::vector<std::vector<int32_t>> TextWindows(const std::vector<int32_t>& tokens, int64_t ctx,
                                              bool with_bos, int32_t bos_id,
                                              int64_t max_windows = 0);

}  // namespace qcal::tools
