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
                    "LlamaForCausalLM)"});
  j = Minimal();
  j.erase("architectures");
  j["model_type"] = "gpt2";
  ExpectInvalid(j, {"unsupported architecture 'gpt2' (qcal supports LlamaForCausalLM)"});
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
  ExpectInvalid(j, {"high_freq_factor 0.5 must exceed low_freq_factor 1"});
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
