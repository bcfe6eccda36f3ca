// Block-floating-point K cache (block-quantization-k-sort §II-B, §III): keys stored as BFP12
// (4-bit sign-magnitude mantissas, one 8-bit shared exponent per block of channels), queries
// computed in BFP16 (8-bit mantissas), blocks along head_dim inside one head and one token.
// Combined with K-sort (engine/qsim/ksort.h), which reorders each head's channels so that a
// block holds channels of similar magnitude, outlier channels stop costing the precision of the
// whole head.
//
// The rounding is exactly kernels/bfp.h's (the CPU reference; a test checks bit equality):
// shared exponent E = floor(log2 max|x|) clamped to [-127, 127], scale 2^(E-p+2), mantissas
// round-to-nearest-even clamped to ±(2^(p-1)-1). This file applies it to [..., head_dim] tensors
// with LibTorch ops (vectorised), for the simulated quantized attention.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/hf_config.h"
#include "common/quant_specs.h"
#include "common/status.h"
#include "kernels/bfp.h"
#include "engine/model/llama.h"
#include "engine/qsim/kv_quantizer.h"

namespace qcal::qsim {

// Quantize→dequantize of x [..., n] (float32, any device) in BFP blocks of format.block_size
// consecutive elements along the last dimension; blocks never cross the last dimension (the
// last block of a row is shorter when block_size does not divide n). Returns a new float32
// tensor of x's shape. Finite inputs give exactly kernels::BfpQuantizeDequantize's values per
// row; non-finite inputs give unspecified (non-crashing) values. Precondition: the format is
// valid (ValidateBfpFormat) and x has >= 1 dimension.
at::Tensor BfpFakeQuantizeLastDim(const at::Tensor& x, const kernels::BfpFormat& format);

// The attention hook (kv_quantizer.h): keys after RoPE in `key_format` (BFP12: Bfp12(block))
// when given, queries in `query_format` (the paper's BFP16: Bfp16(block)) when given, so the q·kᵀ
// product runs on BFP operands; values pass through unchanged (the paper quantizes the K cache
// only). Stateless apart from the formats: the K-sort permutation is a weight transform (ksort.h)
// applied to the model beforehand, so blocks are simply consecutive channels.
class BfpKvQuantizer final : public KvQuantizer {
 public:
  BfpKvQuantizer(std::optional<kernels::BfpFormat> key_format,
                 std::optional<kernels::BfpFormat> query_format);
  at::Tensor Apply(const at::Tensor& x, KvRole role) const override;
  std::string Describe() const override;
  const std::optional<kernels::BfpFormat>& key_format() const { return key_format_; }
  const std::optional<kernels::BfpFormat>& query_format() const { return query_format_; }

 private:
  std::optional<kernels::BfpFormat> key_format_;
  std::optional<kernels::BfpFormat> query_format_;
};

// A K cache of pre-RoPE keys (the paper's deployment: keys are stored as k_proj produces them and
// rotated after being read back): wraps a block's k_proj and BFP-quantizes its output per KV head
// ([..., kv_heads·head_dim] viewed as [..., kv_heads, head_dim], blocks along head_dim).
// DenseWeight() is the wrapped float weight (quantization acts on the output, not the weight).
class BfpKeyProjection final : public model::Linear {
 public:
  // Precondition: k_proj->out_features() is a multiple of head_dim; the format is valid.
  BfpKeyProjection(std::unique_ptr<model::Linear> k_proj, int64_t head_dim,
                   kernels::BfpFormat format);
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }
  const model::Linear& stored() const override { return inner_->stored(); }
  const kernels::BfpFormat& format() const { return format_; }
  const model::Linear& inner() const { return *inner_; }
  std::unique_ptr<model::Linear> release_inner() { return std::move(inner_); }

 private:
  std::unique_ptr<model::Linear> inner_;
  int64_t head_dim_;
  kernels::BfpFormat format_;
};

// Where the K cache is quantized.
enum class KeyQuantPoint {
  kPreRope,   // the paper: k_proj output, before RoPE (BfpKeyProjection)
  kPostRope,  // an HF-style cache of rotated keys (and QuaRot's): the attention hook
};

struct BfpKeyCacheOptions {
  int key_bits = 4;    // mantissa bits of the keys (4 = BFP12); >= 16: float keys
  int query_bits = 8;  // of the queries (8 = BFP16), after RoPE; >= 16: float queries
  int64_t block = 0;   // block size along head_dim, keys and queries (0 = head_dim)
  KeyQuantPoint point = KeyQuantPoint::kPreRope;
};

// Installs the BFP K cache on every block of `model` (after any K-sort: ApplyKSort needs the
// dense k_proj). Keeps the blocks' other hooks. InvalidArgument for bits outside [2, 8] (below
// 16), a block outside [0, head_dim], or a model that already has a BFP key projection. Returns
// a one-line description.
StatusOr<std::string> InstallBfpKeyCache(model::LlamaModel& model,
                                         const BfpKeyCacheOptions& options);

// The keys' format of `kv_cache.format: bfp`: `spec.bits` mantissa bits (BFP12: bits 4) in blocks
// of `spec.group` channels (0 = head_dim). InvalidArgument for bits outside [2, 8] or a group
// outside [0, head_dim].
StatusOr<kernels::BfpFormat> BfpKeyFormat(const KvCacheSpec& spec, const LlamaConfig& config,
                                          int64_t layer);

// The factory MakeKvQuantizer (kv_quantizer.cc) calls for `kv_cache.format: bfp`: queries in
// BFP16 with the keys' blocks (as in the paper), values float, and keys in BfpKeyFormat(spec)
// when `spec.key_point` is post_rope (the hook sits after RoPE and R3). With key_point pre_rope
// (the default) the hook leaves keys alone: the pipeline wraps k_proj in a BfpKeyProjection
// (methods/quarot InstallQuantizedInference). The spec's k_sort flag is not handled here either: the
// pipeline K-sorts the float blocks first (methods/quarot PrepareBlockWeights).
StatusOr<std::shared_ptr<const KvQuantizer>> MakeBfpKvQuantizer(const KvCacheSpec& spec,
                                                                const LlamaConfig& config,
                                                                int64_t layer);

}  // namespace qcal::qsim
