// K-sort (Soloveychik, "Accurate Block Quantization in LLMs with Outliers", Algorithm 1): a
// function-preserving permutation of the key channels of every KV head that puts channels of
// similar magnitude into the same block-floating-point block of the K cache.
//
// Per decoder layer and KV head g (head_dim d, half-split RoPE: channels i and i + d/2 form the
// pair rotated by frequency θ_i):
//   1. N_c = ‖W_k[g·d + c, :]‖ for every channel c of the head;
//   2. a permutation π of the head's channels sorting them by N (descending);
//   3. W_k's rows of the head are permuted by π (new channel j = old channel π(j));
//   4. W_q's rows are permuted by the same π in every query head that reads KV head g (GQA);
//   5. RoPE follows the channels: the block carries rope_perm [kv_heads, d] (new channel j of
//      head g holds half-split channel rope_perm[g][j]), and the forward rotates each channel with
//      its old frequency, partner and sine sign (Rope::Apply(x, perm), engine/model/llama.h).
// Since q and k are permuted identically and rotated consistently, every qᵀk and hence the model
// are unchanged (up to float summation order).
//
// Two orders:
//   * kChannels (default): Algorithm 1 literally — argsort of the d row norms. Exact for the
//     paper's deployment, a cache of pre-RoPE keys (bfp_kv.h, KeyQuantPoint::kPreRope), where a
//     channel's magnitude is what its W_k row norm predicts.
//   * kPairs: RoPE pairs kept adjacent — pairs sorted by √(N_i² + N_{i+d/2}²), new channels
//     (2m, 2m+1) = old (σ(m), σ(m) + d/2), so a block of even size holds whole pairs. Meant for
//     a cache of post-RoPE keys, where RoPE mixes a pair's two channels; measured worse than
//     kChannels on our real models (docs/results.md) because their large key channels sit in
//     the slowest-rotating pairs, whose two channels RoPE barely mixes within the context.
// Values (optional, the paper's §III remark): per KV head, v_proj rows sorted by norm
// (descending) and o_proj's columns of every query head of that KV head permuted identically.
//
// Composes: a block that is already K-sorted (or carries any rope_perm) is permuted again and its
// rope_perm updated, so the model stays exact.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::qsim {

enum class KSortOrder { kPairs, kChannels };

struct KSortOptions {
  KSortOrder order = KSortOrder::kChannels;
  bool sort_values = true;  // permute v_proj rows with o_proj columns as well
};

// π for every KV head: [kv_heads, head_dim] int64, row g a permutation of [0, head_dim) (new
// channel j = old channel π[g][j]), from W_k [kv_heads·head_dim, hidden] (float32). Ties keep the
// lower index first (stable). InvalidArgument on a shape mismatch or an odd head_dim.
StatusOr<at::Tensor> KSortPermutation(const at::Tensor& w_k, int64_t kv_heads, int64_t head_dim,
                                      KSortOrder order);

// Per KV head, rows of w [kv_heads·head_dim, hidden] by norm, descending (stable).
StatusOr<at::Tensor> RowNormPermutation(const at::Tensor& w, int64_t kv_heads, int64_t head_dim);

// Applies per-head permutations to a block's weights in place: W_k rows by key_perm, W_q rows of
// every query head by its KV head's key_perm, rope_perm composed; if value_perm is defined, W_v
// rows by it and W_o columns of every query head by its KV head's value_perm. The block's
// linears must be dense (FailedPrecondition otherwise: K-sort runs on the float model, before
// weight quantization).
Status PermuteBlockHeads(const LlamaConfig& config, model::BlockWeights& weights,
                         const at::Tensor& key_perm, const at::Tensor& value_perm);

// K-sort of one block's weights, in place (the key and, with sort_values, value permutations
// from its own W_k and W_v). Returns the key permutation.
StatusOr<at::Tensor> KSortBlock(const LlamaConfig& config, model::BlockWeights& weights,
                                const KSortOptions& options = {});

// K-sort of every block of the model, in place. Returns the key permutation of every layer.
StatusOr<std::vector<at::Tensor>> ApplyKSort(model::LlamaModel& model,
                                             const KSortOptions& options = {});

}  // namespace qcal::qsim
