// The KV-cache quantizer interface of the simulated quantized attention (QuaRot §4 stage 2c):
// keys and values are quantized as they would be stored in the cache and dequantized as
// attention reads them back, so the forward pass computes with exactly the values an engine with
// a quantized cache would see.
//
// Where the forward pass calls it (engine/model/llama.cc, DecoderBlock::Attention, when the
// block's hooks hold a quantizer):
//   k = R3(RoPE(x W_kᵀ))  (R3 = the online per-head Hadamard, when on)  → Apply(k, kKey)
//   v = x W_vᵀ            (R2 is fused into W_v, when on)                → Apply(v, kValue)
//   q = R3(RoPE(x W_qᵀ))·(1/√d)                                          → Apply(q, kQuery)
// before GQA grouping, scores and softmax. Queries are not cached; kQuery lets a format compute
// q·kᵀ in its own arithmetic (the K-sort paper's BFP16 queries). Quantizers that leave queries
// alone return x itself for kQuery.
//
// Implementations: Fp8KvQuantizer (engine/qsim/fp8_kv.h: E4M3, static per-tensor scales, what
// compressed-tensors' kv_cache_scheme describes), IntKvQuantizer (engine/qsim/act_quant.h: symmetric or asymmetric integer,
// per group of `group` channels within a head (QuaRot: asymmetric, group = head_dim, clip 0.95),
// per token, or per tensor with static calibrated ranges) and the block-floating-point keys with
// K-sort (engine/qsim/bfp_kv.h). Both are built by MakeKvQuantizer from the recipe's kv_cache
// section.
//
// Contract for implementations:
//   * Apply never modifies x and returns a float32 tensor of x's shape on x's device (x itself
//     when the role passes through unchanged).
//   * Causality: a token's dequantized entry may depend only on that token's own values (and on
//     fixed, calibrated parameters), never on other tokens, so prefilling a sequence at once
//     gives the same cache as decoding it token by token.
//   * Deterministic; thread-safe for concurrent Apply calls (a loaded model is shared).
//   * One instance serves one decoder block (per-layer state such as static ranges or a K-sort
//     permutation lives inside it); DecoderBlock holds it through a shared_ptr.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/quant_specs.h"
#include "engine/model/llama.h"
#include "common/status.h"

namespace qcal::qsim {

// The interface lives in the model module (engine/model/llama.h, model::KvCacheHook); the
// quantizers here implement it.
using KvRole = model::KvRole;
using model::KvRoleName;
using KvQuantizer = model::KvCacheHook;

// Static per-tensor ranges of one block's keys and values, measured on calibration data (the
// min and max over every calibration token, before clipping). Only `kv_cache.static: true`
// recipes use them.
struct KvStaticRanges {
  double lo[2] = {0, 0};  // indexed by KvRole (kKey, kValue)
  double hi[2] = {0, 0};
};

// The quantizer for decoder block `layer` of a model with `config`, from the recipe's kv_cache
// section. Returns nullptr when the spec quantizes nothing (bits >= 16). `ranges` must be given
// for static specs (InvalidArgument otherwise). InvalidArgument for settings that do not fit the
// model (a group that does not divide head_dim, ...); Unimplemented for a format this build does
// not provide.
StatusOr<std::shared_ptr<const KvQuantizer>> MakeKvQuantizer(const KvCacheSpec& spec,
                                                             const LlamaConfig& config,
                                                             int64_t layer,
                                                             const KvStaticRanges* ranges);

}  // namespace qcal::qsim
