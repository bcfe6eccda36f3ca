#include "common/hf_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io_util.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"

namespace qcal {
namespace {

using io::JsonParseErrorMessage;
using io::Printable;
using io::ToAbsl;

using json = nlohmann::json;

constexpr char kLlamaArchitecture[] = "LlamaForCausalLM";
// Sizes beyond int32 are never real and would overflow products such as q_dim() downstream.
constexpr int64_t kMaxSize = int64_t{1} << 31;

std::string JsonTypeName(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

// Field readers. Each returns InvalidArgument "<source>: field '<key>' ..." on a wrong type.
// Optional fields treat JSON null like absence (Hugging Face writes null for "unset").
class FieldReader {
 public:
  FieldReader(const json& root, absl::string_view source) : root_(root), source_(source) {}

  Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", message));
  }

  const json* Get(const char* key) const {
    const auto it = root_.find(key);
    if (it == root_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Status TypeError(const char* key, absl::string_view expected, const json& value) const {
    return Error(
        absl::StrCat("field '", key, "' must be ", expected, ", got ", JsonTypeName(value)));
  }

  Status Int(const char* key, const json& value, int64_t* out) const {
    // Unsigned first: nlohmann's get_ptr<number_integer_t*> also answers for unsigned values,
    // reinterpreting their bits as signed.
    if (const auto* u = value.get_ptr<const json::number_unsigned_t*>()) {
      if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(absl::StrCat("field '", key, "' is out of range: ", *u));
      }
      *out = static_cast<int64_t>(*u);
      return absl::OkStatus();
    }
    if (const auto* i = value.get_ptr<const json::number_integer_t*>()) {
      *out = *i;
      return absl::OkStatus();
    }
    return TypeError(key, "an integer", value);
  }

  Status RequiredSize(const char* key, int64_t* out) const {
    const auto it = root_.find(key);
    if (it == root_.end()) return Error(absl::StrCat("missing required field '", key, "'"));
    QCAL_RETURN_IF_ERROR(Int(key, *it, out));
    return CheckSize(key, *out);
  }

  Status OptionalSize(const char* key, int64_t default_value, int64_t* out) const {
    const json* value = Get(key);
    if (value == nullptr) {
      *out = default_value;
      return absl::OkStatus();
    }
    QCAL_RETURN_IF_ERROR(Int(key, *value, out));
    return CheckSize(key, *out);
  }

  Status CheckSize(const char* key, int64_t value) const {
    if (value <= 0) return Error(absl::StrCat("field '", key, "' must be positive, got ", value));
    if (value > kMaxSize) {
      return Error(absl::StrCat("field '", key, "' is unreasonably large: ", value));
    }
    return absl::OkStatus();
  }

  Status OptionalPositiveNumber(const char* key, double default_value, double* out) const {
    const json* value = Get(key);
    if (value == nullptr) {
      *out = default_value;
      return absl::OkStatus();
    }
    if (!value->is_number()) return TypeError(key, "a number", *value);
    *out = value->get<double>();  // numeric conversion; cannot throw for a number
    if (!(*out > 0) || !std::isfinite(*out)) {
      return Error(absl::StrCat("field '", key, "' must be a positive finite number, got ", *out));
    }
    return absl::OkStatus();
  }

  Status OptionalBool(const char* key, bool default_value, bool* out) const {
    const json* value = Get(key);
    if (value == nullptr) {
      *out = default_value;
      return absl::OkStatus();
    }
    const auto* b = value->get_ptr<const json::boolean_t*>();
    if (b == nullptr) return TypeError(key, "a boolean", *value);
    *out = *b;
    return absl::OkStatus();
  }

  Status OptionalString(const char* key, const std::string& default_value,
                        std::string* out) const {
    const json* value = Get(key);
    if (value == nullptr) {
      *out = default_value;
      return absl::OkStatus();
    }
    const auto* s = value->get_ptr<const json::string_t*>();
    if (s == nullptr) return TypeError(key, "a string", *value);
    *out = *s;
    return absl::OkStatus();
  }

  // Token ids: an integer, or (Llama 3 style) a non-empty list of integers of which the first is
  // taken as the primary id.
  Status OptionalTokenId(const char* key, int64_t default_value, int64_t* out) const {
    const json* value = Get(key);
    if (value == nullptr) {
      *out = default_value;
      return absl::OkStatus();
    }
    if (value->is_array()) {
      if (value->empty()) return Error(absl::StrCat("field '", key, "' is an empty list"));
      for (const json& element : *value) {
        int64_t id = 0;
        QCAL_RETURN_IF_ERROR(Int(key, element, &id));
        if (id < 0) return Error(absl::StrCat("field '", key, "' holds a negative id ", id));
      }
      return Int(key, (*value)[0], out);
    }
    QCAL_RETURN_IF_ERROR(Int(key, *value, out));
    if (*out < 0) return Error(absl::StrCat("field '", key, "' must be non-negative, got ", *out));
    return absl::OkStatus();
  }

 private:
  const json& root_;
  absl::string_view source_;
};

// The architectures qcal reads, their model_type and family.
struct Architecture {
  const char* name;
  const char* model_type;
  ModelFamily family;
};
constexpr Architecture kArchitectures[] = {
    {kLlamaArchitecture, "llama", ModelFamily::kLlama},
    {"MixtralForCausalLM", "mixtral", ModelFamily::kMixtral},
    {"Llama4ForCausalLM", "llama4_text", ModelFamily::kLlama4},
    {"Llama4ForConditionalGeneration", "llama4", ModelFamily::kLlama4},
};

Status Unsupported(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      source, ": unsupported architecture '", Printable(what),
      "' (qcal supports LlamaForCausalLM, MixtralForCausalLM, Llama4ForCausalLM and "
      "Llama4ForConditionalGeneration)"));
}

// A list of layer indices (moe_layers) or of 0/1 flags per layer (no_rope_layers).
Status LayerList(const FieldReader& fields, const char* key, const json& value, int64_t layers,
                 bool flags, std::vector<bool>* out) {
  if (!value.is_array()) return fields.TypeError(key, "a list of integers", value);
  out->assign(layers, false);
  if (flags && static_cast<int64_t>(value.size()) != layers) {
    return fields.Error(absl::StrCat("field '", key, "' has ", value.size(), " entries for ",
                                     layers, " layers"));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    int64_t v = 0;
    QCAL_RETURN_IF_ERROR(fields.Int(key, value[i], &v));
    if (flags) {
      if (v != 0 && v != 1) {
        return fields.Error(absl::StrCat("field '", key, "'[", i, "] is ", v, ", not 0 or 1"));
      }
      (*out)[i] = v == 1;
    } else {
      if (v < 0 || v >= layers) {
        return fields.Error(absl::StrCat("field '", key, "' names layer ", v, ", outside [0, ",
                                         layers, ")"));
      }
      (*out)[v] = true;
    }
  }
  return absl::OkStatus();
}

// The experts and, for Llama 4, the attention variants (hf_config.h). Hugging Face's defaults for
// absent keys (MixtralConfig, Llama4TextConfig).
Status ParseMoeFields(const FieldReader& fields, const json& text, LlamaConfig* c) {
  const int64_t layers = c->num_hidden_layers;
  const bool llama4 = c->family == ModelFamily::kLlama4;
  QCAL_RETURN_IF_ERROR(fields.OptionalSize("num_local_experts", llama4 ? 16 : 8, &c->num_experts));
  QCAL_RETURN_IF_ERROR(
      fields.OptionalSize("num_experts_per_tok", llama4 ? 1 : 2, &c->experts_per_token));
  if (c->experts_per_token > c->num_experts) {
    return fields.Error(absl::StrCat("num_experts_per_tok ", c->experts_per_token,
                                     " exceeds num_local_experts ", c->num_experts));
  }
  if (!llama4) {
    c->router = RouterKind::kSoftmaxTopK;
    c->moe_layers.assign(layers, true);
    return absl::OkStatus();
  }
  c->router = RouterKind::kSigmoidTopKInput;
  c->shared_expert = true;
  c->rope_interleaved = true;
  QCAL_RETURN_IF_ERROR(
      fields.OptionalSize("intermediate_size_mlp", 16384, &c->intermediate_size_mlp));
  if (const json* moe = fields.Get("moe_layers")) {
    QCAL_RETURN_IF_ERROR(LayerList(fields, "moe_layers", *moe, layers, false, &c->moe_layers));
  } else {
    int64_t step = 1;
    QCAL_RETURN_IF_ERROR(fields.OptionalSize("interleave_moe_layer_step", 1, &step));
    c->moe_layers.assign(layers, false);
    for (int64_t l = step - 1; l < layers; l += step) c->moe_layers[l] = true;
  }
  // no_rope_layers[l] == 0 marks a NoPE layer; absent or empty: every no_rope_layer_interval-th.
  const json* no_rope = fields.Get("no_rope_layers");
  std::vector<bool> rope;
  if (no_rope != nullptr && !(no_rope->is_array() && no_rope->empty())) {
    QCAL_RETURN_IF_ERROR(LayerList(fields, "no_rope_layers", *no_rope, layers, true, &rope));
  } else {
    int64_t interval = 4;
    QCAL_RETURN_IF_ERROR(fields.OptionalSize("no_rope_layer_interval", 4, &interval));
    rope.assign(layers, false);
    for (int64_t l = 0; l < layers; ++l) rope[l] = (l + 1) % interval != 0;
  }
  c->nope_layers.assign(layers, false);
  for (int64_t l = 0; l < layers; ++l) c->nope_layers[l] = !rope[l];
  QCAL_RETURN_IF_ERROR(fields.OptionalBool("use_qk_norm", true, &c->use_qk_norm));
  // Meta's own configs write attn_temperature_tuning as an integer (4); any nonzero is on.
  if (const json* tuning = fields.Get("attn_temperature_tuning");
      tuning != nullptr && tuning->is_number_integer()) {
    c->attn_temperature_tuning = tuning->get<int64_t>() != 0;
  } else {
    QCAL_RETURN_IF_ERROR(
        fields.OptionalBool("attn_temperature_tuning", true, &c->attn_temperature_tuning));
  }
  QCAL_RETURN_IF_ERROR(fields.OptionalPositiveNumber("floor_scale", 8192, &c->floor_scale));
  QCAL_RETURN_IF_ERROR(fields.OptionalPositiveNumber("attn_scale", 0.1, &c->attn_scale));
  // attention_chunk_size: absent is 8192; null is none.
  const auto chunk = text.find("attention_chunk_size");
  if (chunk == text.end()) {
    c->attention_chunk_size = 8192;
  } else if (!chunk->is_null()) {
    QCAL_RETURN_IF_ERROR(fields.OptionalSize("attention_chunk_size", 8192,
                                             &c->attention_chunk_size));
  }
  // layer_types, when given, must say what the flags above imply: chunked attention on RoPE
  // layers, full attention on NoPE layers.
  if (const json* types = fields.Get("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers) {
      return fields.Error(absl::StrCat("field 'layer_types' must list ", layers, " strings"));
    }
    for (int64_t l = 0; l < layers; ++l) {
      const std::string want = c->UsesRope(l) ? "chunked_attention" : "full_attention";
      if (!(*types)[l].is_string() || (*types)[l].get<std::string>() != want) {
        return fields.Error(absl::StrCat("layer_types[", l, "] is ", (*types)[l].dump(),
                                         "; qcal supports ", want, " there (layer ", l, " is a ",
                                         c->UsesRope(l) ? "RoPE" : "NoPE", " layer)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// rope_scaling (see RopeScaling in hf_config.h). Null is absent; "default" is plain RoPE.
Status ParseRopeScaling(const FieldReader& fields, RopeScaling* out) {
  const json* rs = fields.Get("rope_scaling");
  if (rs == nullptr) return absl::OkStatus();
  if (!rs->is_object()) return fields.TypeError("rope_scaling", "an object or null", *rs);
  // Hugging Face writes "rope_type" (older files "type").
  const char* type_key = rs->contains("rope_type") ? "rope_type" : "type";
  auto type_it = rs->find(type_key);
  if (type_it == rs->end() || !type_it->is_string()) {
    return fields.Error("rope_scaling has no 'rope_type' string");
  }
  const std::string type = type_it->get<std::string>();
  if (type == "default") return absl::OkStatus();
  if (type != "linear" && type != "llama3") {
    return fields.Error(absl::StrCat("rope_scaling type '", Printable(type),
                                     "' is unsupported (supported: llama3, linear; absent or null "
                                     "for plain RoPE)"));
  }
  auto number = [&](const char* key, double* value) -> Status {
    auto it = rs->find(key);
    if (it == rs->end() || !it->is_number() || !std::isfinite(it->get<double>()) ||
        it->get<double>() <= 0) {
      return fields.Error(absl::StrCat("rope_scaling type '", type, "' needs '", key,
                                       "', a positive number"));
    }
    *value = it->get<double>();
    return absl::OkStatus();
  };
  QCAL_RETURN_IF_ERROR(number("factor", &out->factor));
  if (type == "linear") {
    out->type = RopeScaling::Type::kLinear;
    return absl::OkStatus();
  }
  out->type = RopeScaling::Type::kLlama3;
  QCAL_RETURN_IF_ERROR(number("low_freq_factor", &out->low_freq_factor));
  QCAL_RETURN_IF_ERROR(number("high_freq_factor", &out->high_freq_factor));
  double original = 0;
  QCAL_RETURN_IF_ERROR(number("original_max_position_embeddings", &original));
  if (original != std::floor(original) || original > 1e9) {
    return fields.Error("rope_scaling original_max_position_embeddings must be an integer");
  }
  out->original_max_position_embeddings = static_cast<int64_t>(original);
  // Equal factors leave no band to interpolate in (transformers computes them the same way).
  if (out->high_freq_factor < out->low_freq_factor) {
    return fields.Error(absl::StrCat("rope_scaling high_freq_factor ", out->high_freq_factor,
                                     " must not be below low_freq_factor ", out->low_freq_factor));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<LlamaConfig> ParseLlamaConfig(std::string_view json_text,
                                       std::string_view source_view) {
  const absl::string_view source = ToAbsl(source_view);
  json root = json::parse(json_text.data(), json_text.data() + json_text.size(), nullptr, false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid JSON: ", JsonParseErrorMessage(json_text)));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": must be a JSON object, got ", JsonTypeName(root)));
  }
  const FieldReader top(root, source);
  LlamaConfig config;

  // Architecture: "architectures" must list one qcal reads; without it, model_type decides.
  std::string model_type;
  QCAL_RETURN_IF_ERROR(top.OptionalString("model_type", "", &model_type));
  const Architecture* arch = nullptr;
  if (const json* architectures = top.Get("architectures")) {
    if (!architectures->is_array()) {
      return top.TypeError("architectures", "a list of strings", *architectures);
    }
    std::vector<std::string> names;
    for (const json& element : *architectures) {
      const auto* name = element.get_ptr<const json::string_t*>();
      if (name == nullptr) return top.TypeError("architectures", "a list of strings", element);
      names.push_back(*name);
    }
    for (const Architecture& a : kArchitectures) {
      if (arch == nullptr && std::find(names.begin(), names.end(), a.name) != names.end()) arch = &a;
    }
    if (arch == nullptr) {
      return Unsupported(source, names.empty() ? "(empty list)" : absl::StrJoin(names, ", "));
    }
  } else {
    for (const Architecture& a : kArchitectures) {
      if (model_type == a.model_type) arch = &a;
    }
    if (arch == nullptr) {
      return Unsupported(source, model_type.empty()
                                     ? "(neither architectures nor model_type given)"
                                     : model_type);
    }
  }
  config.architecture = arch->name;
  config.model_type = model_type.empty() ? arch->model_type : model_type;
  config.family = arch->family;

  // Llama4ForConditionalGeneration: the text model is described by text_config and its tensors
  // sit under language_model.
  const json* text = &root;
  std::string text_source(source);
  if (config.architecture == std::string("Llama4ForConditionalGeneration")) {
    text = top.Get("text_config");
    if (text == nullptr || !text->is_object()) {
      return top.Error("Llama4ForConditionalGeneration needs a 'text_config' object");
    }
    text_source = absl::StrCat(source, ": text_config");
    config.tensor_prefix = "language_model.";
  }
  const FieldReader fields(*text, text_source);
  const bool dense = config.family == ModelFamily::kLlama;

  QCAL_RETURN_IF_ERROR(fields.RequiredSize("hidden_size", &config.hidden_size));
  QCAL_RETURN_IF_ERROR(fields.RequiredSize("intermediate_size", &config.intermediate_size));
  QCAL_RETURN_IF_ERROR(fields.RequiredSize("num_hidden_layers", &config.num_hidden_layers));
  // The deepest Llama (3.1 405B) has 126 blocks; a count far beyond any model is a damaged or
  // wrong config, said as such rather than as a missing tensor later.
  if (config.num_hidden_layers > kMaxHiddenLayers) {
    return fields.Error(absl::StrCat("num_hidden_layers ", config.num_hidden_layers,
                                     " is implausible (Llama models have at most 126 blocks; qcal "
                                     "accepts up to ", kMaxHiddenLayers, ")"));
  }
  QCAL_RETURN_IF_ERROR(fields.RequiredSize("num_attention_heads", &config.num_attention_heads));
  QCAL_RETURN_IF_ERROR(fields.RequiredSize("vocab_size", &config.vocab_size));
  QCAL_RETURN_IF_ERROR(fields.OptionalSize("num_key_value_heads", config.num_attention_heads,
                                           &config.num_key_value_heads));
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return fields.Error(absl::StrCat("num_attention_heads ", config.num_attention_heads,
                                     " is not divisible by num_key_value_heads ",
                                     config.num_key_value_heads));
  }
  if (fields.Get("head_dim") != nullptr) {
    QCAL_RETURN_IF_ERROR(fields.OptionalSize("head_dim", 0, &config.head_dim));
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return fields.Error(absl::StrCat("hidden_size ", config.hidden_size,
                                       " is not divisible by num_attention_heads ",
                                       config.num_attention_heads, " (and head_dim is absent)"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  QCAL_RETURN_IF_ERROR(
      fields.OptionalPositiveNumber("rms_norm_eps", dense ? 1e-6 : 1e-5, &config.rms_norm_eps));
  const double theta = config.family == ModelFamily::kMixtral  ? 1e6
                       : config.family == ModelFamily::kLlama4 ? 5e5
                                                               : 1e4;
  QCAL_RETURN_IF_ERROR(fields.OptionalPositiveNumber("rope_theta", theta, &config.rope_theta));
  QCAL_RETURN_IF_ERROR(
      fields.OptionalBool("tie_word_embeddings", false, &config.tie_word_embeddings));
  QCAL_RETURN_IF_ERROR(fields.OptionalSize("max_position_embeddings", 2048,
                                           &config.max_position_embeddings));
  QCAL_RETURN_IF_ERROR(fields.OptionalString("torch_dtype", "float32", &config.torch_dtype));
  QCAL_RETURN_IF_ERROR(fields.OptionalTokenId("bos_token_id", 1, &config.bos_token_id));
  QCAL_RETURN_IF_ERROR(fields.OptionalTokenId("eos_token_id", 2, &config.eos_token_id));

  QCAL_RETURN_IF_ERROR(ParseRopeScaling(fields, &config.rope_scaling));
  // Features the Llama implementation does not have: refuse rather than compute wrong numbers.
  if (const json* window = fields.Get("sliding_window")) {
    if (!window->is_number_integer()) {
      return fields.TypeError("sliding_window", "an integer or null", *window);
    }
    if (window->get<int64_t>() < config.max_position_embeddings) {
      return fields.Error(absl::StrCat(
          "sliding_window ", window->get<int64_t>(), " is shorter than max_position_embeddings ",
          config.max_position_embeddings, "; sliding-window attention is unsupported"));
    }
  }
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    bool enabled = false;
    QCAL_RETURN_IF_ERROR(fields.OptionalBool(bias, false, &enabled));
    if (enabled) return fields.Error(absl::StrCat(bias, "=true is unsupported"));
  }
  std::string hidden_act;
  QCAL_RETURN_IF_ERROR(fields.OptionalString("hidden_act", "silu", &hidden_act));
  if (hidden_act != "silu") {
    return fields.Error(
        absl::StrCat("hidden_act '", Printable(hidden_act), "' is unsupported (expected silu)"));
  }

  if (!dense) QCAL_RETURN_IF_ERROR(ParseMoeFields(fields, *text, &config));

  config.raw = std::move(root);
  return config;
}

const char* ModelFamilyName(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama: return "llama";
    case ModelFamily::kMixtral: return "mixtral";
    case ModelFamily::kLlama4: return "llama4";
  }
  return "?";
}

StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path) {
  std::string file = path;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    file = (!path.empty() && path.back() == '/') ? path + "config.json" : path + "/config.json";
  }
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
  return ParseLlamaConfig(text, file);
}

json LlamaConfigToJson(const LlamaConfig& config) {
  json root = config.raw.is_object() ? config.raw : json::object();
  root["architectures"] = json::array({config.architecture});
  root["model_type"] = config.model_type;
  const bool nested = !config.tensor_prefix.empty();
  if (nested && !root["text_config"].is_object()) root["text_config"] = json::object();
  json& j = nested ? root["text_config"] : root;
  j["hidden_size"] = config.hidden_size;
  j["intermediate_size"] = config.intermediate_size;
  j["num_hidden_layers"] = config.num_hidden_layers;
  j["num_attention_heads"] = config.num_attention_heads;
  j["num_key_value_heads"] = config.num_key_value_heads;
  j["head_dim"] = config.head_dim;
  j["rms_norm_eps"] = config.rms_norm_eps;
  j["rope_theta"] = config.rope_theta;
  j["vocab_size"] = config.vocab_size;
  j["tie_word_embeddings"] = config.tie_word_embeddings;
  j["max_position_embeddings"] = config.max_position_embeddings;
  j["torch_dtype"] = config.torch_dtype;
  j["bos_token_id"] = config.bos_token_id;
  // Keep a list of eos ids (Llama 3) when its primary id is unchanged.
  const auto eos = j.find("eos_token_id");
  const bool keep_eos_list = eos != j.end() && eos->is_array() && !eos->empty() &&
                             (*eos)[0].is_number_integer() &&
                             (*eos)[0].get<int64_t>() == config.eos_token_id;
  if (!keep_eos_list) j["eos_token_id"] = config.eos_token_id;
  return root;
}

std::string LlamaConfig::RouterModule(int64_t layer) const {
  return TensorName(absl::StrCat("model.layers.", layer, ".",
                                 family == ModelFamily::kMixtral ? "block_sparse_moe.gate"
                                                                 : "feed_forward.router"));
}

}  // namespace qcal
