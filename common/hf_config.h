// Hugging Face config.json for the Llama family (LlamaForCausalLM, model_type "llama").
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace qcal {

// config.json's rope_scaling: absent or null is plain RoPE. `linear` divides every inverse
// frequency by `factor`; `llama3` (Llama 3.1 and later) divides the low frequencies (wavelength
// above original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
// (wavelength below original_max_position_embeddings / high_freq_factor) and interpolates
// smoothly in between, as Hugging Face's _compute_llama3_parameters does. Neither changes the
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
  // The whole parsed document, so that unknown keys (quantization_config, ...) survive a
  // read-modify-write.
  nlohmann::json raw;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t gqa_groups() const { return num_attention_heads / num_key_value_heads; }
};

// Parses and validates. Errors are InvalidArgument naming `source` and the field: missing
// required field, wrong JSON type, non-positive sizes, heads not dividing, unsupported
// architecture/model_type, a rope_scaling type other than linear and llama3 (named, with the
// supported ones) or with missing or invalid parameters, attention_bias / mlp_bias true, a
// sliding_window shorter than max_position_embeddings, non-JSON text.
StatusOr<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source);
// Reads <dir>/config.json (or a path to the file itself).
StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);
// Serialises (starting from `raw` so unknown keys are kept).
nlohmann::json LlamaConfigToJson(const LlamaConfig& config);

}  // namespace qcal
