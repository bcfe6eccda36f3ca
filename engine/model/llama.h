// The Llama-family forward pass in LibTorch (CPU float32; the same code runs on CUDA tensors),
// organised per decoder block because the block is the unit of work that quantization jobs
// distribute: a block can be loaded alone from the checkpoint shards and run on [batch, seq,
// hidden] activations.
//
// Layout and maths follow Hugging Face's LlamaForCausalLM: RMSNorm (x * rsqrt(mean(x²) + eps) *
// w), RoPE on half-split pairs (i, i + head_dim/2) with inv_freq = theta^(-2i/head_dim), grouped
// query attention (query head h reads KV head h / (heads / kv_heads)), causal softmax attention,
// SwiGLU MLP (down(silu(gate(x)) * up(x))), tied or separate head.
//
// Thread-safety: a loaded model is immutable during Forward and may be shared by threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace qcal::model {

// y = x Wᵀ for x [..., in_features] -> [..., out_features]. An interface, so that quantized
// layers (decoded codebooks, integer weights, online transforms) replace dense ones in a block
// without changing the block.
class Linear {
 public:
  virtual ~Linear() = default;
  virtual at::Tensor Forward(const at::Tensor& x) const = 0;
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  // The effective dense weight [out, in] in float32 (quantized layers decode theirs).
  virtual at::Tensor DenseWeight() const = 0;
  // Real-valued parameters of a quantized layer that fine-tuning may tune while its codes stay
  // fixed (QuIP#'s sign vectors su/sv): handles to the tensors Forward uses. Empty by default.
  virtual std::vector<at::Tensor> TunableVectors() { return {}; }
  // Moves the tensors Forward computes with to `device` (a GPU rank's LibTorch work keeps a
  // block resident there; the results come back to the CPU for writing). Handles returned by
  // TunableVectors before the move are stale after it. Nothing changes when they are there
  // already, so on the CPU it is free and exact. Unimplemented (the default) for a layer that
  // cannot move; Forward then still runs on a device input, copying its weights every call.
  virtual Status MoveTo(const at::Device& device);

  // --- storage (the layer formats of docs/formats.md; methods/layer_format.h reads them back)
  // The layer that holds the weights: itself, or for a wrapper that adds an online transform or
  // an activation/KV quantizer in front of a layer (act_quant.h, bfp_kv.h, ...), the wrapped
  // layer's stored().
  virtual const Linear& stored() const { return *this; }
  // The name of the layer format this layer is stored in ("dense", "scalar", "quip": the
  // quantization_config "format" a loader looks up), or nullptr for a layer that is not
  // stored (a wrapper, a training-time view).
  virtual const char* layer_format() const { return nullptr; }
  // Writes the layer's tensors under `prefix` ("model.layers.3.self_attn.q_proj") in its
  // format. Unimplemented for a layer without one.
  virtual Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const;
};

class DenseLinear final : public Linear {
 public:
  explicit DenseLinear(at::Tensor weight);  // [out, in] float32, contiguous
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override;
  int64_t out_features() const override;
  at::Tensor DenseWeight() const override { return weight_; }
  Status MoveTo(const at::Device& device) override;
  // "<prefix>.weight" [out, in] F32.
  const char* layer_format() const override { return "dense"; }
  Status AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const override;

 private:
  at::Tensor weight_;
};

// A dense layer held in a 16-bit float dtype (BF16 or F16: the checkpoint's) and widened to
// float32 for each Forward: the products of the DenseLinear of the widened weight, bit for bit
// (widening is exact), at half its memory and the cost of the widening per call. Expert-parallel
// calibration holds a rank's routed experts this way (BlockSelection::experts_as_stored). Not a
// stored layer format.
class WidenedLinear final : public Linear {
 public:
  explicit WidenedLinear(at::Tensor weight);  // [out, in] BF16 or F16
  at::Tensor Forward(const at::Tensor& x) const override;
  int64_t in_features() const override { return weight_.size(1); }
  int64_t out_features() const override { return weight_.size(0); }
  at::Tensor DenseWeight() const override;  // the widened float32 weight
  const at::Tensor& stored_weight() const { return weight_; }

 private:
  at::Tensor weight_;
};

// The seven linears of a decoder block, in Hugging Face naming.
enum class LinearKind { kQ, kK, kV, kO, kGate, kUp, kDown };
inline constexpr LinearKind kAllLinears[] = {LinearKind::kQ,    LinearKind::kK,  LinearKind::kV,
                                             LinearKind::kO,    LinearKind::kGate,
                                             LinearKind::kUp,   LinearKind::kDown};
// "self_attn.q_proj", ..., "mlp.down_proj"
const char* LinearName(LinearKind kind);
// The [out_features, in_features] of a linear of a block of `config`.
std::vector<int64_t> LinearShape(const LlamaConfig& config, LinearKind kind);
// The same for block `layer` (Llama 4's dense layers are intermediate_size_mlp wide).
std::vector<int64_t> LinearShape(const LlamaConfig& config, LinearKind kind, int64_t layer);
// Whether block `layer` of `config` has dense linear `kind` (a Mixtral MoE block has no dense
// MLP beside its experts; a Llama 4 MoE block's MLP linears are its shared expert).
bool BlockHasLinear(const LlamaConfig& config, int64_t layer, LinearKind kind);
// Where a linear of block `layer` is stored in `config`'s checkpoints, without ".weight":
// "model.layers.3.mlp.gate_proj" (Llama, Mixtral's attention), "model.layers.3.feed_forward.
// gate_proj" (a Llama 4 dense layer), "model.layers.3.feed_forward.shared_expert.gate_proj" (a
// Llama 4 MoE layer's shared expert), behind config.tensor_prefix.
std::string LinearTensorName(const LlamaConfig& config, int64_t layer, LinearKind kind);

// The routed experts of a mixture-of-experts block (hf_config.h ModelFamily): a float router
// and, per expert, a SwiGLU MLP of intermediate_size (down(silu(gate(x)) * up(x))).
enum class ExpertLinear { kGate = 0, kUp = 1, kDown = 2 };
inline constexpr ExpertLinear kExpertLinears[] = {ExpertLinear::kGate, ExpertLinear::kUp,
                                                  ExpertLinear::kDown};
// The dense MLP linear an expert linear corresponds to (same role, same [out, in] shape at
// intermediate_size): kGate -> LinearKind::kGate, ...
LinearKind ExpertLinearKind(ExpertLinear k);
// An expert linear's name in qcal's metrics and messages, whatever the family:
// "experts.3.gate_proj", "experts.3.up_proj", "experts.3.down_proj".
std::string ExpertLinearName(int64_t expert, ExpertLinear k);
// Where routed expert `expert`'s linear of MoE block `layer` is stored, without ".weight", behind
// config.tensor_prefix: Mixtral "model.layers.3.block_sparse_moe.experts.5.w1" (w1 gate, w3 up,
// w2 down); Llama 4 "model.layers.3.feed_forward.experts.5.gate_proj" (the per-expert names
// vLLM's Llama 4 loader reads for quantized checkpoints; the float checkpoint fuses them into
// experts.gate_up_proj / experts.down_proj).
std::string ExpertTensorName(const LlamaConfig& config, int64_t layer, int64_t expert,
                             ExpertLinear k);
struct ExpertWeights {
  std::unique_ptr<Linear> linears[3];  // indexed by ExpertLinear
  Linear& linear(ExpertLinear k) const { return *linears[static_cast<int>(k)]; }
};
struct MoeWeights {
  at::Tensor router;                  // [experts, hidden] float32, kept in full precision
  std::vector<ExpertWeights> experts;
};
// One expert on its rows x [m, hidden]: down(silu(gate(x)) · up(x)), as the block computes it.
at::Tensor ExpertForward(const ExpertWeights& ex, const at::Tensor& x);
// One forward call's work for a MoE block's routed experts, for BlockHooks::run_experts: the
// normalised hidden state the feed-forward reads ([..., hidden]) and, per expert, the rows the
// router sends it (int64 [m_e] indices into h's flattened rows, ascending) and the input its
// gate/up read ([m_e, hidden]; Llama 4's scaled by the router weights). Both undefined for an
// expert the call sends no row.
struct ExpertCall {
  at::Tensor h;
  std::vector<at::Tensor> rows;
  std::vector<at::Tensor> inputs;
};
// Runs a call's experts: outputs[e] = ExpertForward(expert e, inputs[e]) ([m_e, hidden], before
// Mixtral's routing weights multiply in), one per expert (undefined where inputs[e] is).
using ExpertRunner = std::function<std::vector<at::Tensor>(const ExpertCall& call)>;

// A MoE block's routing of n tokens: the top-k experts of each token, and the weight each
// chosen expert gets (Mixtral: its renormalized softmax probability, multiplied into its output;
// Llama 4: the sigmoid of its logit, multiplied into its input).
struct Routing {
  at::Tensor experts;  // [n, k] int64
  at::Tensor weights;  // [n, k] float32
};

struct BlockWeights {
  int64_t layer = 0;      // which block of the model (its attention and MLP variant)
  at::Tensor input_norm;  // [hidden]
  at::Tensor post_norm;   // [hidden]
  // Indexed by LinearKind. In a MoE block the MLP linears are the shared expert (Llama 4) or
  // null (Mixtral, which has none).
  std::unique_ptr<Linear> linears[7];
  std::unique_ptr<MoeWeights> moe;  // the routed experts of a MoE block; null for a dense one
  // K-sort (engine/qsim/ksort.h): channel j of KV head g holds the half-split RoPE channel
  // rope_perm[g][j]; query heads use their KV head's row. [kv_heads, head_dim] int64, or
  // undefined for the identity (every model not K-sorted).
  at::Tensor rope_perm;
  // Further per-block tensors of quantized inference, stored in the block's shard as
  // model.layers.N.<key> (QuaRot's calibrated static ranges: methods/quarot/checkpoint.h). The
  // float forward pass ignores them.
  std::map<std::string, at::Tensor> extra;
  Linear& linear(LinearKind k) const { return *linears[static_cast<int>(k)]; }
  bool has(LinearKind k) const { return linears[static_cast<int>(k)] != nullptr; }
};

// Rotary embedding tables for positions [0, max_positions).
// Rotary position embedding tables (half-split layout, as Hugging Face's rotate_half), with the
// config's rope_scaling applied to the inverse frequencies (hf_config.h RopeScaling). Tables cover
// min(max_positions, kMaxRopePositions) positions.
// A model's tables (Rope(config)) also cover kMaxPrefixTokens positions past its context, where
// the tokens of a full-length sequence sit behind a prefix (PrefixKv).
inline constexpr int64_t kMaxRopePositions = 32768;
inline constexpr int64_t kMaxPrefixTokens = 64;
class Rope {
 public:
  // interleaved: the pairs (2i, 2i+1) rotate by frequency i (Llama 4) instead of (i, i + d/2).
  Rope(int64_t head_dim, double theta, int64_t max_positions,
       const RopeScaling& scaling = RopeScaling(), bool interleaved = false);
  explicit Rope(const LlamaConfig& config)
      : Rope(config.head_dim, config.rope_theta,
             std::min(config.max_position_embeddings, kMaxRopePositions) + kMaxPrefixTokens,
             config.rope_scaling, config.rope_interleaved) {}
  // x [batch, heads, seq, head_dim] at positions [offset, offset + seq) -> rotated copy.
  // offset + seq must not exceed max_positions().
  at::Tensor Apply(const at::Tensor& x, int64_t offset = 0) const;
  // As Apply, with the channels of each head permuted: channel j of head h holds the half-split
  // channel perm[h][j]. perm [heads, head_dim] int64; undefined = Apply(x, offset).
  at::Tensor Apply(const at::Tensor& x, const at::Tensor& perm, int64_t offset = 0) const;
  int64_t max_positions() const { return max_positions_; }
  bool interleaved() const { return interleaved_; }
  // The tables Apply multiplies by: [max_positions, head_dim] float32 (cos and sin of position ·
  // the half-split inverse frequencies, repeated for both halves).
  const at::Tensor& cos_table() const { return cos_; }
  const at::Tensor& sin_table() const { return sin_; }

 private:
  int64_t max_positions_;
  bool interleaved_ = false;
  at::Tensor cos_, sin_;  // [max_positions, head_dim]
};

// What attention reads back from the KV cache: DecoderBlock::Attention calls the block's
// KvCacheHook (when it has one) on keys, values and queries before GQA grouping, scores and
// softmax:
//   k = M(RoPE(x W_kᵀ))      (M = BlockHooks::qk_rotation, when set) → Apply(k, kKey)
//   v = x W_vᵀ                                                      → Apply(v, kValue)
//   q = M(RoPE(x W_qᵀ))·(1/√d)                                      → Apply(q, kQuery)
// Implementations (engine/qsim/kv_quantizer.h) quantize and dequantize keys and values as a
// quantized cache would store them; queries are not cached (kQuery lets a format compute q·kᵀ in
// its own arithmetic; others return x itself).
// Contract: Apply never modifies x and returns a float32 tensor of x's shape on x's device;
// a token's entry depends only on that token's values and fixed parameters (causal); thread-safe.
enum class KvRole { kKey = 0, kValue = 1, kQuery = 2 };
const char* KvRoleName(KvRole role);  // "key" / "value" / "query"

class KvCacheHook {
 public:
  virtual ~KvCacheHook() = default;
  // x: [batch, kv_heads, seq, head_dim] (keys, values) or [batch, heads, seq, head_dim] (queries).
  virtual at::Tensor Apply(const at::Tensor& x, KvRole role) const = 0;
  virtual std::string Describe() const = 0;  // one line for logs, "int4 asym per_group(8)"
};

// Keys and values of tokens that sit in front of every sequence in the KV cache (PrefixQuant's
// prefixed outlier tokens), as attention reads them: K after RoPE at positions 0..o-1 (and after
// BlockHooks::qk_rotation), V as projected; full precision, never passed through the KvCacheHook.
// With a prefix installed, a block's own tokens sit at positions o, o+1, ... and every query
// attends to the o prefix entries and causally to its sequence.
struct PrefixKv {
  std::vector<int32_t> tokens;  // the prefixed token ids, in order
  at::Tensor k, v;              // [kv_heads, o, head_dim] float32
  int64_t length() const { return k.defined() ? k.size(1) : 0; }
};

// Optional per-block steps of a transformed or simulated-quantized forward pass. The default
// (empty) hooks leave the forward pass exactly the float one. Activation quantization and online
// transforms of a linear's input are not hooks: they wrap the block's Linears.
struct BlockHooks {
  // An orthogonal [head_dim, head_dim] matrix M applied to every query and key head after RoPE,
  // q_h ← q_h·M and k_h ← k_h·M; it cancels in q·kᵀ (QuaRot's R3). Undefined: none.
  at::Tensor qk_rotation;
  // The KV cache as attention reads it back. Null: a float cache.
  std::shared_ptr<const KvCacheHook> kv_cache;
  // Prefixed keys and values (above). Null: none; positions start at 0.
  std::shared_ptr<const PrefixKv> prefix;
  // A MoE block calls it with each forward pass's routing (its tokens' rows flattened in order)
  // before the experts run: what analyses of the routing read (tools/expert_load.h). Empty: none.
  std::function<void(const Routing&)> on_routing;
  // Where a MoE block's routed experts run. Empty: here, one expert at a time in expert order
  // (only its rows in memory). Set: every expert's input is made first, the runner computes the
  // outputs (calibration: on the ranks that own the experts, engine/calib/expert_parallel.h; or
  // stand-ins), and they are combined in the same order, so a runner that computes
  // ExpertForward gives the same bits.
  ExpertRunner run_experts;
};

// A decoder block of block `weights.layer` of `config`: a dense Llama block, or (hf_config.h
// ModelFamily) a Mixtral or Llama 4 one: Llama 4's NoPE layers (no RoPE; queries scaled by the
// temperature log1p(⌊(pos + 1) / floor_scale⌋) · attn_scale + 1 when attn_temperature_tuning), its
// L2 qk-norm of RoPE layers' heads (x · rsqrt(mean(x²) + eps), after RoPE), its chunked attention
// on RoPE layers (a query reads keys of its own attention_chunk_size-long chunk of positions),
// and a MoE feed-forward (BlockWeights::moe): Route, then each expert on its tokens, summed in
// expert order, plus the shared expert.
class DecoderBlock {
 public:
  DecoderBlock(const LlamaConfig& config, BlockWeights weights);
  // x [batch, seq, hidden] float -> [batch, seq, hidden]; positions are 0..seq-1, causal (o..
  // o+seq-1 after a prefix of o tokens, hooks().prefix, which every query also attends to).
  at::Tensor Forward(const at::Tensor& x, const Rope& rope) const;
  // The keys and values this block's attention computes for x [batch, seq, hidden] at positions
  // offset..offset+seq-1, before any KvCacheHook and ignoring any installed prefix: K after RoPE
  // and qk_rotation, [batch, kv_heads, seq, head_dim] each. (A prefix's K/V: PrefixKvOf.)
  std::pair<at::Tensor, at::Tensor> KeysValues(const at::Tensor& x, const Rope& rope,
                                               int64_t offset) const;
  // The same with the queries: {q [batch, heads, seq, head_dim] scaled by 1/√head_dim (after
  // RoPE and qk_rotation), k, v}, as attention computes them before any KvCacheHook.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> Projections(const at::Tensor& x, const Rope& rope,
                                                             int64_t offset) const;
  // The feed-forward of normalised h [..., hidden]: the dense MLP, or the MoE layer.
  at::Tensor FeedForward(const at::Tensor& h) const;
  // A MoE block's routing of normalised h [..., hidden] (its rows flattened, in order).
  Routing Route(const at::Tensor& h) const;
  // The routed experts' sum for normalised h [..., hidden] given its routing (without the shared
  // expert), the experts run where hooks().run_experts says. `expert_inputs`, when set, is called
  // with each expert's index, its token rows (into the flattened h) and the input its gate/up
  // read ([rows, hidden], Llama 4's scaled by the router) before the expert runs. A routing that
  // names an expert outside the block throws (c10::Error).
  using ExpertInputFn =
      std::function<void(int64_t expert, const at::Tensor& rows, const at::Tensor& input)>;
  at::Tensor RoutedExperts(const at::Tensor& h, const Routing& routing,
                           const ExpertInputFn& expert_inputs = nullptr) const;
  bool is_moe() const { return weights_.moe != nullptr; }
  // A MoE block's router: how scores are made and where they multiply (Routing), and top k.
  RouterKind router_kind() const { return router_; }
  // A dense Llama block (RoPE on every layer, no qk-norm, temperature or attention chunks, no
  // experts): what the device block forward (kernels/block_forward_cuda.h) computes.
  bool plain_llama() const {
    return !is_moe() && rope_ && !qk_norm_ && !temperature_ && chunk_ == 0;
  }
  int64_t layer() const { return weights_.layer; }
  const BlockWeights& weights() const { return weights_; }
  BlockWeights& mutable_weights() { return weights_; }
  const BlockHooks& hooks() const { return hooks_; }
  // Moves the block's norms, linears (Linear::MoveTo) and K-sort permutation to `device`; the
  // hooks' tables (R3, a prefix's K/V) follow the input on every call. Errors: a linear that
  // cannot move, or a quantized KV cache (its simulation runs on the host). A failed move may
  // leave some tensors moved: move back to where they were before using the block.
  Status MoveTo(const at::Device& device);
  void set_hooks(BlockHooks hooks) { hooks_ = std::move(hooks); }
  int64_t head_dim() const { return head_dim_; }
  int64_t heads() const { return heads_; }
  int64_t kv_heads() const { return kv_heads_; }
  double rms_eps() const { return eps_; }

 private:
  at::Tensor Attention(const at::Tensor& h, const Rope& rope) const;
  // q [b, H, s, d] (scaled by 1/√d), k and v [b, KV, s, d] of normalised h at positions offset..,
  // after RoPE and qk_rotation, before the KV hook.
  void Project(const at::Tensor& h, const Rope& rope, int64_t offset, at::Tensor* q, at::Tensor* k,
               at::Tensor* v) const;
  at::Tensor Mlp(const at::Tensor& h) const;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  // The attention and feed-forward variant of this layer (the class comment); a dense Llama
  // block has rope_ and nothing else.
  bool rope_ = true;
  bool qk_norm_ = false;
  bool temperature_ = false;
  double floor_scale_ = 8192, attn_scale_ = 0.1;
  int64_t chunk_ = 0;
  RouterKind router_ = RouterKind::kSoftmaxTopK;
  int64_t top_k_ = 0;
  BlockWeights weights_;
  BlockHooks hooks_;
};

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Reads one tensor as float32 and checks its shape. Errors name the tensor and the checkpoint.
StatusOr<at::Tensor> LoadTensorF32(CheckpointReader& ckpt, const std::string& name,
                                   const std::vector<int64_t>& expected_shape);
// Slab `index` of a stacked tensor (expected_shape [n, ...], any floating dtype) as float32
// [...]: one expert of Llama 4's fused experts, converted and its pages released without the
// whole stack in memory. Errors as LoadTensorF32.
StatusOr<at::Tensor> LoadSlabF32(CheckpointReader& ckpt, const std::string& name,
                                 const std::vector<int64_t>& expected_shape, int64_t index);
// InvalidArgument naming `path` and tensor `name` when float32 `t` holds a NaN or infinity.
Status CheckFinite(const at::Tensor& t, const std::string& path, const std::string& name);
// Loads decoder block `layer` alone (only its tensors are read): Llama's seven linears, and for
// a MoE layer its router and experts (Mixtral's per-expert w1/w3/w2; Llama 4's fused tensors
// split per expert) beside the shared expert.
StatusOr<BlockWeights> LoadBlockWeights(CheckpointReader& ckpt, const LlamaConfig& config,
                                        int64_t layer);

// The weights outside the decoder blocks.
struct NonBlockWeights {
  at::Tensor embed;       // [vocab, hidden]
  at::Tensor final_norm;  // [hidden]
  at::Tensor head;        // [vocab, hidden]; the same tensor as embed when tied
  bool head_tied = false;
};

class LlamaModel {
 public:
  // Loads config.json and every tensor of a Hugging Face model directory.
  static StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& dir);
  LlamaModel(LlamaConfig config, at::Tensor embed, std::vector<DecoderBlock> blocks,
             at::Tensor final_norm, std::unique_ptr<Linear> head);

  const LlamaConfig& config() const { return config_; }
  const Rope& rope() const { return rope_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const DecoderBlock& block(int64_t i) const { return blocks_[i]; }
  DecoderBlock& mutable_block(int64_t i) { return blocks_[i]; }

  // ids [batch, seq] int64 -> hidden [batch, seq, hidden].
  at::Tensor Embed(const at::Tensor& ids) const;
  // Final RMSNorm + head: [batch, seq, hidden] -> logits [batch, seq, vocab].
  at::Tensor Head(const at::Tensor& hidden) const;
  // Whole model: ids [batch, seq] int64 -> logits [batch, seq, vocab] float32, on the
  // model's device (ids may be anywhere).
  at::Tensor Forward(const at::Tensor& ids) const;
  // Moves every tensor the forward uses (embeddings, blocks, final norm, head) to `device`, all
  // or nothing: on an error the model is moved back where it was.
  Status MoveTo(const at::Device& device);
  at::Device device() const { return embed_.device(); }

  // The non-block weights, for whole-model transforms (QuaRot's norm fusion and rotation).
  const at::Tensor& embed_weight() const { return embed_; }  // [vocab, hidden]
  const at::Tensor& final_norm() const { return final_norm_; }  // [hidden]
  const Linear& head() const { return *head_; }
  void set_embed_weight(at::Tensor embed) { embed_ = std::move(embed); }
  void set_final_norm(at::Tensor norm) { final_norm_ = std::move(norm); }
  void set_head(std::unique_ptr<Linear> head) { head_ = std::move(head); }

 private:
  LlamaConfig config_;
  at::Tensor embed_;
  std::vector<DecoderBlock> blocks_;
  at::Tensor final_norm_;
  std::unique_ptr<Linear> head_;
  Rope rope_;
};

// The prefix of `tokens` for every block of `model` (which must have no prefix installed): the
// tokens run through the model's blocks as they are (hooks included) at positions 0..o-1, and
// each block's K/V of them kept (DecoderBlock::KeysValues). InvalidArgument for no tokens, an id
// outside the vocabulary, or more than kMaxPrefixTokens tokens.
StatusOr<std::vector<std::shared_ptr<const PrefixKv>>> ComputePrefixKv(
    const LlamaModel& model, const std::vector<int32_t>& tokens);
// Installs prefix[i] on block i (replacing any). InvalidArgument when the counts or shapes
// disagree with the model.
Status InstallPrefixKv(LlamaModel& model,
                       const std::vector<std::shared_ptr<const PrefixKv>>& prefix);
// The prefix length installed on the model's blocks (0: none).
int64_t PrefixLength(const LlamaModel& model);

// Greedy decoding from `prompt` (which should start with BOS; with a prefix installed, a leading
// BOS is dropped when the prefix ends with it, and positions count the prefix): appends up to `max_new_tokens`
// argmax tokens, stopping early when `stop_token` (BOS for llama2.c models, or EOS) is produced.
// Returns prompt + generated tokens (a stop token is not appended).
std::vector<int32_t> GenerateGreedy(const LlamaModel& model, const std::vector<int32_t>& prompt,
                                    int64_t max_new_tokens, int32_t stop_token);

// Sets LibTorch's intra-op threads (0: $QCAL_NUM_THREADS if set, else the CPUs of the affinity
// mask) and pins the BLAS library to one thread (kernels/blas_threads.h). The thread count is a
// speed setting only: every result is the same bits for any value (docs/architecture.md,
// "Determinism"). Call it before any numeric work in a process.
void SetComputeThreads(int threads);

// x [..., in] · weightᵀ [in, out]. Without autograd, the rows of x are cut into fixed chunks of
// kLinearChunkRows, each one single-threaded GEMM, run in parallel: the bits of a row's output
// depend only on the shapes, never on the thread count or the affinity. With autograd (x or
// the weight requiring grad) it is at::matmul on one BLAS thread.
inline constexpr int64_t kLinearChunkRows = 256;
at::Tensor LinearRows(const at::Tensor& x, const at::Tensor& weight);

// Where LibTorch computes for `requested` ("auto", "cpu", "cuda", "cuda:N", as --device takes
// it): auto is cuda:0 when this build's LibTorch has CUDA and sees a device, else the CPU.
// Unavailable when CUDA is asked for and this LibTorch has none (Debian's 1.13 is CPU-only),
// InvalidArgument for anything else.
StatusOr<at::Device> ResolveTorchDevice(const std::string& requested);

// Σ t in double, the same bits for any thread count (LibTorch's whole-tensor sum() splits the
// elements by the thread count once there are more than 32768).
double SumToDouble(const at::Tensor& t);

// The thread count that runs `config` fastest on CPU: $QCAL_NUM_THREADS if set; 1 for small
// models (hidden_size < 512), whose per-op work is too small to split across threads (measured:
// stories260K evaluates 2.4x faster on 1 thread than on 2); else the CPUs of the affinity mask.
int AutoComputeThreads(const LlamaConfig& config);

}  // namespace qcal::model
