// Tests for common/hf_config: parsing Llama config.json, defaults, every rejection, and writing
// back with unknown keys preserved.
#include "common/hf_config.h"
#include "tests/test_util.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace qcal {
namespace {

using json = nlohmann::json;

void ExpectError(const Status& status, absl::StatusCode code,
                 std::initializer_list<std::string> phrases) {
  ASSERT_FALSE(status.ok()) << "expected an error";
  EXPECT_EQ(status.code(), code) << status;
  const std::string message(status.message());
  for (const std::string& phrase : phrases) {
    EXPECT_NE(message.find(phrase), std::string::npos)
        << "message \"" << message << "\" lacks \"" << phrase << "\"";
  }
}

void ExpectInvalid(const json& config, std::initializer_list<std::string> phrases) {
  SCOPED_TRACE(config.dump());
  auto parsed = ParseLlamaConfig(config.dump(), "config.json");
  ExpectError(parsed.status(), absl::StatusCode::kInvalidArgument, phrases);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(std::string(parsed.status().message()).rfind("config.json: ", 0), 0u)
      << parsed.status().message();
}

// TinyLlama-1.1B's config.json (GQA: 32 heads, 4 kv heads).
const char kTinyLlama[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0",
  "use_cache": true,
  "vocab_size": 32000
})";

json Minimal() {
  return json{{"architectures", json::array({"LlamaForCausalLM"})},
              {"hidden_size", 64},
              {"intermediate_size", 172},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 8},
              {"vocab_size", 512}};
}

TEST(HfConfigTest, ParsesTinyLlama) {
  auto config = ParseLlamaConfig(kTinyLlama, "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "LlamaForCausalLM");
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->hidden_size, 2048);
  EXPECT_EQ(config->intermediate_size, 5632);
  EXPECT_EQ(config->num_hidden_layers, 22);
  EXPECT_EQ(config->num_attention_heads, 32);
  EXPECT_EQ(config->num_key_value_heads, 4);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 10000.0);
  EXPECT_EQ(config->vocab_size, 32000);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_EQ(config->max_position_embeddings, 2048);
  EXPECT_EQ(config->torch_dtype, "bfloat16");
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_EQ(config->eos_token_id, 2);
  EXPECT_EQ(config->q_dim(), 2048);
  EXPECT_EQ(config->kv_dim(), 256);
  EXPECT_EQ(config->gqa_groups(), 8);
  EXPECT_EQ(config->raw.at("transformers_version"), "4.35.0");
}

TEST(HfConfigTest, DefaultsForOptionalFields) {
  auto config = ParseLlamaConfig(Minimal().dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_key_value_heads, 8);
  EXPECT_EQ(config->head_dim, 8);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(config->rope_theta, 10000.0);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_EQ(config->max_position_embeddings, 2048);
  EXPECT_EQ(config->torch_dtype, "float32");
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_EQ(config->eos_token_id, 2);
  EXPECT_EQ(config->gqa_groups(), 1);
}

TEST(HfConfigTest, NullOptionalFieldsTakeDefaults) {
  json j = Minimal();
  j["num_key_value_heads"] = nullptr;
  j["torch_dtype"] = nullptr;
  j["bos_token_id"] = nullptr;
  auto config = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_key_value_heads, 8);
  EXPECT_EQ(config->torch_dtype, "float32");
  EXPECT_EQ(config->bos_token_id, 1);
}

TEST(HfConfigTest, ModelTypeWithoutArchitectures) {
  json j = Minimal();
  j.erase("architectures");
  j["model_type"] = "llama";
  auto config = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "LlamaForCausalLM");
}

TEST(HfConfigTest, ExplicitHeadDimNeedNotDivideHidden) {
  json j = Minimal();
  j["hidden_size"] = 100;
  j["num_attention_heads"] = 3;
  j["num_key_value_heads"] = 1;
  j["head_dim"] = 32;
  auto config = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 32);
  EXPECT_EQ(config->q_dim(), 96);
  EXPECT_EQ(config->kv_dim(), 32);
}

TEST(HfConfigTest, EosTokenList) {
  json j = Minimal();
  j["eos_token_id"] = {128001, 128008, 128009};
  auto config = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->eos_token_id, 128001);
  // Written back unchanged when the primary id is unchanged.
  EXPECT_EQ(LlamaConfigToJson(*config).at("eos_token_id"), j.at("eos_token_id"));
  j["eos_token_id"] = json::array();
  ExpectInvalid(j, {"field 'eos_token_id' is an empty list"});
  j["eos_token_id"] = {1, "2"};
  ExpectInvalid(j, {"field 'eos_token_id' must be an integer, got string"});
}

TEST(HfConfigTest, NotJson) {
  auto config = ParseLlamaConfig("{\"hidden_size\": 64,", "config.json");
  ExpectError(config.status(), absl::StatusCode::kInvalidArgument,
              {"config.json: not valid JSON: ", "syntax error", "line 1"});
  ExpectError(ParseLlamaConfig("", "config.json").status(), absl::StatusCode::kInvalidArgument,
              {"config.json: not valid JSON"});
}

TEST(HfConfigTest, NotAnObject) {
  ExpectError(ParseLlamaConfig("[1, 2]", "config.json").status(),
              absl::StatusCode::kInvalidArgument,
              {"config.json: must be a JSON object, got array"});
}

TEST(HfConfigTest, MissingRequiredFields) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "vocab_size"}) {
    json j = Minimal();
    j.erase(field);
    ExpectInvalid(j, {std::string("config.json: missing required field '") + field + "'"});
  }
}

TEST(HfConfigTest, WrongTypes) {
  json j = Minimal();
  j["hidden_size"] = "64";
  ExpectInvalid(j, {"field 'hidden_size' must be an integer, got string"});
  j = Minimal();
  j["hidden_size"] = 64.5;
  ExpectInvalid(j, {"field 'hidden_size' must be an integer, got number"});
  j = Minimal();
  j["vocab_size"] = nullptr;
  ExpectInvalid(j, {"field 'vocab_size' must be an integer, got null"});
  j = Minimal();
  j["num_key_value_heads"] = true;
  ExpectInvalid(j, {"field 'num_key_value_heads' must be an integer, got boolean"});
  j = Minimal();
  j["rms_norm_eps"] = "1e-5";
  ExpectInvalid(j, {"field 'rms_norm_eps' must be a number, got string"});
  j = Minimal();
  j["tie_word_embeddings"] = 1;
  ExpectInvalid(j, {"field 'tie_word_embeddings' must be a boolean, got integer"});
  j = Minimal();
  j["torch_dtype"] = 16;
  ExpectInvalid(j, {"field 'torch_dtype' must be a string, got integer"});
  j = Minimal();
  j["architectures"] = "LlamaForCausalLM";
  ExpectInvalid(j, {"field 'architectures' must be a list of strings, got string"});
  j = Minimal();
  j["hidden_size"] = 18446744073709551615ull;
  ExpectInvalid(j, {"field 'hidden_size' is out of range"});
}

TEST(HfConfigTest, NonPositiveSizes) {
  json j = Minimal();
  j["hidden_size"] = 0;
  ExpectInvalid(j, {"field 'hidden_size' must be positive, got 0"});
  j = Minimal();
  j["num_hidden_layers"] = -2;
  ExpectInvalid(j, {"field 'num_hidden_layers' must be positive, got -2"});
  j = Minimal();
  j["num_key_value_heads"] = 0;
  ExpectInvalid(j, {"field 'num_key_value_heads' must be positive, got 0"});
  j = Minimal();
  j["head_dim"] = -8;
  ExpectInvalid(j, {"field 'head_dim' must be positive"});
  j = Minimal();
  j["rms_norm_eps"] = 0.0;
  ExpectInvalid(j, {"field 'rms_norm_eps' must be a positive finite number"});
  j = Minimal();
  j["rope_theta"] = -1;
  ExpectInvalid(j, {"field 'rope_theta' must be a positive finite number"});
  j = Minimal();
  j["vocab_size"] = int64_t{1} << 40;
  ExpectInvalid(j, {"field 'vocab_size' is unreasonably large"});
}

TEST(HfConfigTest, HeadsNotDivisible) {
  json j = Minimal();
  j["num_key_value_heads"] = 3;
  ExpectInvalid(j, {"num_attention_heads 8 is not divisible by num_key_value_heads 3"});
  j = Minimal();
  j["hidden_size"] = 100;
  ExpectInvalid(j, {"hidden_size 100 is not divisible by num_attention_heads 8"});
}

TEST(HfConfigTest, UnsupportedArchitecture) {
  json j = Minimal();
  j["architectures"] = json::array({"MistralForCausalLM"});
  ExpectInvalid(j, {"config.json: unsupported architecture 'MistralForCausalLM' (qcal supports "
                    "LlamaForCausalLM, MixtralForCausalLM, Llama4ForCausalLM and "
                    "Llama4ForConditionalGeneration)"});
  j = Minimal();
  j.erase("architectures");
  j["model_type"] = "gpt2";
  ExpectInvalid(j, {"unsupported architecture 'gpt2' (qcal supports LlamaForCausalLM"});
  j = Minimal();
  j.erase("architectures");
  ExpectInvalid(j, {"unsupported architecture", "neither architectures nor model_type"});
  j = Minimal();
  j["architectures"] = json::array();
  ExpectInvalid(j, {"unsupported architecture '(empty list)'"});
}

TEST(HfConfigTest, UnsupportedFeatures) {
  json j = Minimal();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  ExpectInvalid(j, {"rope_scaling type 'yarn' is unsupported", "supported: llama3, linear"});
  for (const char* type : {"dynamic", "longrope", "su", "mrope"}) {
    j["rope_scaling"] = {{"type", type}, {"factor", 2.0}};
    ExpectInvalid(j, {absl::StrCat("rope_scaling type '", type, "' is unsupported")});
  }
  j["rope_scaling"] = {{"factor", 2.0}};
  ExpectInvalid(j, {"rope_scaling has no 'rope_type'"});
  j["rope_scaling"] = "linear";
  ExpectInvalid(j, {"rope_scaling"});
  j = Minimal();
  j["attention_bias"] = true;
  ExpectInvalid(j, {"attention_bias=true is unsupported"});
  j = Minimal();
  j["mlp_bias"] = true;
  ExpectInvalid(j, {"mlp_bias=true is unsupported"});
  j = Minimal();
  j["max_position_embeddings"] = 32768;
  j["sliding_window"] = 4096;
  ExpectInvalid(j, {"sliding_window 4096 is shorter than max_position_embeddings 32768"});
  j["sliding_window"] = "wide";
  ExpectInvalid(j, {"sliding_window"});
  j = Minimal();
  j["hidden_act"] = "gelu";
  ExpectInvalid(j, {"hidden_act 'gelu' is unsupported"});
}

TEST(HfConfigTest, RopeScalingParametersAreChecked) {
  json j = Minimal();
  const json llama3 = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  for (const char* key :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    j["rope_scaling"] = llama3;
    j["rope_scaling"].erase(key);
    ExpectInvalid(j, {"rope_scaling type 'llama3' needs", key});
    j["rope_scaling"] = llama3;
    j["rope_scaling"][key] = -1;
    ExpectInvalid(j, {key, "a positive number"});
  }
  j["rope_scaling"] = llama3;
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  ExpectInvalid(j, {"high_freq_factor 0.5 must not be below low_freq_factor 1"});
  j["rope_scaling"] = llama3;
  j["rope_scaling"]["original_max_position_embeddings"] = 8192.5;
  ExpectInvalid(j, {"original_max_position_embeddings must be an integer"});
  j["rope_scaling"] = {{"type", "linear"}};
  ExpectInvalid(j, {"rope_scaling type 'linear' needs 'factor'"});
}

// Llama 3.1-8B's and Llama 3.2-1B's config.json as Meta publishes them (values, not weights).
TEST(HfConfigTest, Llama31And32ConfigsAreAccepted) {
  const char kLlama31_8B[] = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";
  auto c = ParseLlamaConfig(kLlama31_8B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->eos_token_id, 128001);
  EXPECT_EQ(c->head_dim, 128);
  // The rewrite keeps rope_scaling and the eos list.
  const json out = LlamaConfigToJson(*c);
  EXPECT_EQ(out.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(out.at("eos_token_id"), json::parse("[128001, 128008, 128009]"));

  const char kLlama32_1B[] = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "sliding_window": null, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "vocab_size": 128256})";
  c = ParseLlamaConfig(kLlama32_1B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);

  json j = json::parse(kLlama31_8B);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  c = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 4.0);
  j["rope_scaling"] = {{"rope_type", "default"}};
  c = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  j["rope_scaling"] = nullptr;
  j["sliding_window"] = 131072;  // a window as long as the context is no window
  c = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
}

TEST(HfConfigTest, ToJsonKeepsUnknownKeysAndRoundTrips) {
  json j = json::parse(kTinyLlama);
  j["quantization_config"] = {{"quant_method", "qcal"}, {"bits", 2}};
  auto config = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  config->vocab_size = 32008;
  config->tie_word_embeddings = true;
  const json out = LlamaConfigToJson(*config);
  EXPECT_EQ(out.at("quantization_config"), j.at("quantization_config"));
  EXPECT_EQ(out.at("transformers_version"), "4.35.0");
  EXPECT_EQ(out.at("architectures"), json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(out.at("model_type"), "llama");
  EXPECT_EQ(out.at("vocab_size"), 32008);
  EXPECT_EQ(out.at("tie_word_embeddings"), true);
  EXPECT_EQ(out.at("head_dim"), 64);
  auto again = ParseLlamaConfig(out.dump(2), "config.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->vocab_size, 32008);
  EXPECT_EQ(again->num_key_value_heads, 4);
  EXPECT_TRUE(again->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(again->rms_norm_eps, 1e-5);
  EXPECT_EQ(again->torch_dtype, "bfloat16");
  EXPECT_EQ(again->raw.at("quantization_config").at("bits"), 2);
}

// Mixtral-8x7B-v0.1's config.json (issue 53).
const char kMixtral[] = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
})";

TEST(HfConfigTest, Mixtral) {
  auto c = ParseLlamaConfig(kMixtral, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "MixtralForCausalLM");
  EXPECT_EQ(c->family, ModelFamily::kMixtral);
  EXPECT_TRUE(c->is_moe());
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->experts_per_token, 2);
  EXPECT_EQ(c->router, RouterKind::kSoftmaxTopK);
  EXPECT_FALSE(c->shared_expert);
  EXPECT_FALSE(c->rope_interleaved);
  EXPECT_EQ(c->tensor_prefix, "");
  for (int64_t l = 0; l < 32; ++l) {
    EXPECT_TRUE(c->IsMoeLayer(l));
    EXPECT_TRUE(c->UsesRope(l));
    EXPECT_EQ(c->MlpSize(l), 14336);
  }
  EXPECT_EQ(c->attention_chunk_size, 0);
  // Absent keys take MixtralConfig's defaults.
  json j = json::parse(kMixtral);
  for (const char* k : {"num_local_experts", "num_experts_per_tok", "rope_theta", "rms_norm_eps"}) {
    j.erase(k);
  }
  c = ParseLlamaConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->experts_per_token, 2);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  j["num_experts_per_tok"] = 9;
  ExpectInvalid(j, {"num_experts_per_tok 9 exceeds num_local_experts 8"});
  j = json::parse(kMixtral);
  j["sliding_window"] = 4096;
  ExpectInvalid(j, {"sliding_window 4096", "unsupported"});
}

// A Llama 4 text config with Scout's sizes (Llama4TextConfig's defaults: hidden 5120, 16 experts,
// top 1, 40 heads / 8 KV heads), shortened to 8 layers, with equal rope_scaling frequency factors.
json Llama4Text() {
  return json::parse(R"({
    "attention_bias": false, "attention_chunk_size": 8192, "attn_scale": 0.1,
    "attn_temperature_tuning": true, "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760, "model_type": "llama4_text", "moe_layers": null,
    "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0], "num_attention_heads": 40,
    "num_experts_per_tok": 1, "num_hidden_layers": 8, "num_key_value_heads": 8,
    "num_local_experts": 16, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_qk_norm": true, "vocab_size": 202048
  })");
}

TEST(HfConfigTest, Llama4TextAndMultimodal) {
  json text = Llama4Text();
  text["architectures"] = json::array({"Llama4ForCausalLM"});
  auto c = ParseLlamaConfig(text.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kLlama4);
  EXPECT_EQ(c->router, RouterKind::kSigmoidTopKInput);
  EXPECT_TRUE(c->shared_expert && c->rope_interleaved && c->use_qk_norm &&
              c->attn_temperature_tuning);
  EXPECT_EQ(c->attention_chunk_size, 8192);
  EXPECT_EQ(c->eos_token_id, 200001);
  for (int64_t l = 0; l < 8; ++l) {
    EXPECT_TRUE(c->IsMoeLayer(l)) << l;
    EXPECT_EQ(c->UsesRope(l), (l + 1) % 4 != 0) << l;
    EXPECT_EQ(c->MlpSize(l), 8192) << l;
  }

  // Maverick's interleaving: MoE on every 2nd layer, the others dense of intermediate_size_mlp.
  json maverick = text;
  maverick["interleave_moe_layer_step"] = 2;
  c = ParseLlamaConfig(maverick.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  for (int64_t l = 0; l < 8; ++l) {
    EXPECT_EQ(c->IsMoeLayer(l), l % 2 == 1) << l;
    EXPECT_EQ(c->MlpSize(l), l % 2 == 1 ? 8192 : 16384) << l;
  }
  maverick["moe_layers"] = json::array({0, 5});
  c = ParseLlamaConfig(maverick.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->IsMoeLayer(0) && c->IsMoeLayer(5) && !c->IsMoeLayer(1));

  // Absent keys take Llama4TextConfig's defaults; a null chunk size is no chunking; Meta's
  // integer attn_temperature_tuning counts as on.
  json bare = text;
  for (const char* k : {"no_rope_layers", "use_qk_norm", "attn_temperature_tuning",
                        "attention_chunk_size", "rope_theta", "num_local_experts",
                        "num_experts_per_tok", "intermediate_size_mlp"}) {
    bare.erase(k);
  }
  c = ParseLlamaConfig(bare.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->attention_chunk_size, 8192);
  EXPECT_TRUE(c->use_qk_norm && c->attn_temperature_tuning);
  EXPECT_EQ(c->rope_theta, 5e5);
  EXPECT_EQ(c->num_experts, 16);
  EXPECT_EQ(c->experts_per_token, 1);
  EXPECT_EQ(c->intermediate_size_mlp, 16384);
  EXPECT_FALSE(c->UsesRope(3));
  EXPECT_TRUE(c->UsesRope(4));
  bare["attention_chunk_size"] = nullptr;
  bare["attn_temperature_tuning"] = 4;
  bare["no_rope_layer_interval"] = 2;
  c = ParseLlamaConfig(bare.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->attention_chunk_size, 0);
  EXPECT_TRUE(c->attn_temperature_tuning);
  EXPECT_FALSE(c->UsesRope(1));

  // The multimodal checkpoint: the text model in text_config, tensors under language_model.
  json mm = {{"architectures", json::array({"Llama4ForConditionalGeneration"})},
             {"model_type", "llama4"},
             {"text_config", text},
             {"vision_config", {{"model_type", "llama4_vision_model"}, {"hidden_size", 1408}}}};
  mm["text_config"].erase("architectures");
  c = ParseLlamaConfig(mm.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Llama4ForConditionalGeneration");
  EXPECT_EQ(c->tensor_prefix, "language_model.");
  EXPECT_EQ(c->hidden_size, 5120);
  EXPECT_EQ(c->TensorName("model.norm.weight"), "language_model.model.norm.weight");
  // Written back, the text fields stay in text_config and the vision config is untouched.
  const json out = LlamaConfigToJson(*c);
  EXPECT_FALSE(out.contains("hidden_size"));
  EXPECT_EQ(out["text_config"]["hidden_size"], 5120);
  EXPECT_EQ(out["vision_config"]["hidden_size"], 1408);
  auto again = ParseLlamaConfig(out.dump(), "config.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->num_experts, 16);

  // Errors name the field, under text_config for the multimodal layout.
  json bad = mm;
  bad.erase("text_config");
  ExpectInvalid(bad, {"Llama4ForConditionalGeneration needs a 'text_config' object"});
  bad = mm;
  bad["text_config"]["no_rope_layers"] = json::array({1, 1});
  ExpectInvalid(bad, {"config.json: text_config: field 'no_rope_layers' has 2 entries for 8 layers"});
  bad = mm;
  bad["text_config"]["no_rope_layers"][0] = 2;
  ExpectInvalid(bad, {"'no_rope_layers'[0] is 2, not 0 or 1"});
  bad = mm;
  bad["text_config"]["moe_layers"] = json::array({8});
  ExpectInvalid(bad, {"'moe_layers' names layer 8, outside [0, 8)"});
  bad = mm;
  bad["text_config"]["layer_types"] = json::array();
  for (int l = 0; l < 8; ++l) bad["text_config"]["layer_types"].push_back("full_attention");
  ExpectInvalid(bad, {"layer_types[0] is \"full_attention\"", "chunked_attention", "RoPE layer"});
  // Equal high and low frequency factors: no band to interpolate in.
  json scout = Llama4Text();
  scout["architectures"] = json::array({"Llama4ForCausalLM"});
  c = ParseLlamaConfig(scout.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c->rope_scaling.factor, 16.0);
}

TEST(HfConfigTest, ToJsonFromDefaultConstructedConfig) {
  LlamaConfig config;
  config.hidden_size = 16;
  config.intermediate_size = 32;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 2;
  config.head_dim = 8;
  config.vocab_size = 10;
  config.max_position_embeddings = 64;
  const json out = LlamaConfigToJson(config);  // raw is null: starts from an empty object
  auto parsed = ParseLlamaConfig(out.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->hidden_size, 16);
  EXPECT_EQ(parsed->max_position_embeddings, 64);
}

class HfConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = qcal::testing::MakeTempDir("qcal_hf_config");
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  std::string dir_;
};

TEST_F(HfConfigFileTest, LoadFromDirectoryOrFile) {
  {
    std::ofstream out(dir_ + "/config.json");
    out << kTinyLlama;
  }
  auto from_dir = LoadLlamaConfig(dir_);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->hidden_size, 2048);
  auto from_file = LoadLlamaConfig(dir_ + "/config.json");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->num_key_value_heads, 4);
}

TEST_F(HfConfigFileTest, ErrorsNameThePath) {
  ExpectError(LoadLlamaConfig(dir_).status(), absl::StatusCode::kNotFound,
              {dir_ + "/config.json"});
  {
    std::ofstream out(dir_ + "/config.json");
    out << R"({"architectures": ["LlamaForCausalLM"]})";
  }
  ExpectError(LoadLlamaConfig(dir_).status(), absl::StatusCode::kInvalidArgument,
              {dir_ + "/config.json: missing required field 'hidden_size'"});
}

}  // namespace
}  // namespace qcal
