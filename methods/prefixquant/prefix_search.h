// PrefixQuant's global phase "prefix" (notes (a), (b)): the outlier-token search over the
// calibration sequences and the prefix's keys and values, on the float model as the method
// prepares it (rotated), streamed one block at a time.
//
//   1. Data-parallel: each rank takes its canonical chunks of the calibration sequences
//      (comm::SliceForRank over chunks of `batch`), runs them through the prepared float blocks
//      and measures, per layer, the token max|x| of the down_proj input before R4
//      (qsim::AddTokenOutliers). The integer counts (outliers per layer, outlier ids) are summed
//      over the ranks exactly, so every rank derives the same o and the same prefix
//      (qsim::PrefixTokens: the top-o ids, then BOS) for any number of ranks.
//   2. The prefix tokens go through the prepared float blocks at positions 0..P-1; each block's
//      K (after RoPE and R3) and V are kept in float32, never quantized.
// Products: "tokens" [P], "k" and "v" [layers, kv_heads, P, head_dim], "outliers" [layers]
// (outlier tokens per layer over all sequences) and "sequences" [1].
#pragma once

#include "common/status.h"
#include "methods/method.h"
#include "methods/prefixquant/prefixquant_spec.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::prefixquant {

StatusOr<PhaseProducts> RunPrefixSearch(const ModelTransform& method, const PrefixquantConfig& q,
                                        const qsim::RotationPlan& plan,
                                        const GlobalPhaseInputs& in);

// Block `layer`'s prefix from the phase's products (InvalidArgument naming what is wrong).
StatusOr<std::shared_ptr<const model::PrefixKv>> PrefixOfLayer(const PhaseProducts& products,
                                                               const LlamaConfig& config,
                                                               int64_t layer);

}  // namespace qcal::methods::prefixquant
