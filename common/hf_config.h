// Hugging Face config.json for the Llama family: LlamaForCausalLM (model_type "llama"),
// MixtralForCausalLM ("mixtral"), Llama4ForCausalLM ("llama4_text") and the text model of
// Llama4ForConditionalGeneration ("llama4", its text_config).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace qcal {

// config.json's rope_scaling: absent or null is plain RoPE. `linear` divides every inverse
// frequency by `factor`; `llama3` (Llama 3.1 and later) divides the low frequencies (wavelength
// above original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
// (wavelength below original_max_position_embeddings / high_freq_factor) and interpolates
// smoothly in between (no band when the two factors are equal), as Hugging
// Face's _compute_llama3_parameters does. Neither changes the
// attention scale.
struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The most decoder blocks a config may declare (Llama 3.1 405B has 126).
inline constexpr int64_t kMaxHiddenLayers = 1024;

// Which Llama-family layout a config describes (docs/formats.md, "Input checkpoints").
//   kLlama:   LlamaForCausalLM (Llama 2, Llama 3.x): dense blocks.
//   kMixtral: MixtralForCausalLM: every block's MLP is block_sparse_moe, a softmax router over
//             num_local_experts experts (w1 gate, w3 up, w2 down), the top k renormalized and
//             multiplied into the experts' outputs.
//   kLlama4:  Llama4ForCausalLM, or the text model of Llama4ForConditionalGeneration (tensors
//             under "language_model.", the config's text_config): RoPE on interleaved pairs,
//             NoPE layers, L2 qk-norm, chunked attention; MoE layers with a router whose top-k
//             logits through a sigmoid scale each chosen expert's input, fused experts and a
//             shared expert; dense layers of intermediate_size_mlp.
enum class ModelFamily { kLlama, kMixtral, kLlama4 };
const char* ModelFamilyName(ModelFamily family);  // "llama", "mixtral", "llama4"

// How a mixture-of-experts block weighs its experts (above).
enum class RouterKind { kSoftmaxTopK, kSigmoidTopKInput };

struct LlamaConfig {
  std::string architecture = "LlamaForCausalLM";
  std::string model_type = "llama";
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads when absent
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads when absent
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::string torch_dtype = "float32";
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;
  // --- Mixture of experts and Llama 4 (defaults: a dense Llama) ---
  ModelFamily family = ModelFamily::kLlama;
  // Where the text model's tensors live: "" or "language_model." (Llama4ForConditionalGeneration,
  // whose vision tower and projector sit beside it and are not part of the text model).
  std::string tensor_prefix;
  int64_t num_experts = 0;         // num_local_experts; 0 for a dense model
  int64_t experts_per_token = 0;   // num_experts_per_tok (top k)
  RouterKind router = RouterKind::kSoftmaxTopK;
  bool shared_expert = false;      // Llama 4: feed_forward.shared_expert beside the routed ones
  int64_t intermediate_size_mlp = 0;  // Llama 4's dense layers (else intermediate_size)
  std::vector<bool> moe_layers;    // per layer: a MoE block (empty: none)
  bool rope_interleaved = false;   // RoPE on pairs (2i, 2i+1) rather than (i, i + d/2)
  std::vector<bool> nope_layers;   // per layer: no RoPE (empty: RoPE on every layer)
  bool use_qk_norm = false;        // L2 norm of q and k heads after RoPE, on RoPE layers
  bool attn_temperature_tuning = false;  // NoPE layers: q *= log1p(⌊(pos+1)/floor⌋)·scale + 1
  double floor_scale = 8192;
  double attn_scale = 0.1;
  int64_t attention_chunk_size = 0;  // RoPE layers attend within chunks of this many (0: no)

  // The whole parsed document, so that unknown keys (quantization_config, ...) survive a
  // read-modify-write.
  nlohmann::json raw;

  bool is_moe() const { return num_experts > 0; }
  bool IsMoeLayer(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(moe_layers.size()) && moe_layers[layer];
  }
  bool UsesRope(int64_t layer) const {
    return !(layer >= 0 && layer < static_cast<int64_t>(nope_layers.size()) && nope_layers[layer]);
  }
  // The intermediate size of layer `layer`'s dense MLP (Llama 4's intermediate_size_mlp).
  int64_t MlpSize(int64_t layer) const {
    return family == ModelFamily::kLlama4 && !IsMoeLayer(layer) ? intermediate_size_mlp
                                                                 : intermediate_size;
  }
  // A checkpoint tensor's name: "model.norm.weight" -> tensor_prefix + "model.norm.weight".
  std::string TensorName(std::string_view name) const {
    return tensor_prefix + std::string(name);
  }
  // Where MoE block `layer`'s router is stored, without ".weight", behind tensor_prefix:
  // Mixtral "model.layers.3.block_sparse_moe.gate", Llama 4 "model.layers.3.feed_forward.router".
  std::string RouterModule(int64_t layer) const;
  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t gqa_groups() const { return num_attention_heads / num_key_value_heads; }
};

// Parses and validates. Absent Mixtral and Llama 4 keys take Hugging Face's defaults
// (MixtralConfig, Llama4TextConfig: rope_theta 1e6 / 5e5, rms_norm_eps 1e-5, 8 / 16 experts,
// top 2 / 1; Llama 4: NoPE every 4th layer, qk-norm, temperature tuning, 8192-token chunks, MoE on
// every layer). Errors are InvalidArgument naming `source` and the field: missing
// required field, wrong JSON type, non-positive sizes, heads not dividing, unsupported
// architecture/model_type, a rope_scaling type other than linear and llama3 (named, with the
// supported ones) or with missing or invalid parameters, attention_bias / mlp_bias true, a
// sliding_window shorter than max_position_embeddings, non-JSON text.
StatusOr<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source);
// Reads <dir>/config.json (or a path to the file itself).
StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);
// Serialises (starting from `raw` so unknown keys are kept; a Llama4ForConditionalGeneration's
// text fields go into its text_config).
nlohmann::json LlamaConfigToJson(const LlamaConfig& config);

}  // namespace qcal
