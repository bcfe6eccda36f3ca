// What each method says inference computes, as data (methods/parts.h ServedForward): the online
// steps an export format must express, which of them act on linear inputs only, the input
// quantizer and the block Hadamards. export/ decides from this alone (tests/export/export_test.sh
// checks the files it writes).
#include <string>

#include <gtest/gtest.h>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "methods/method_factory.h"
#include "methods/registry.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

LlamaConfig SmallConfig() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = 16;
  c.num_hidden_layers = 2;
  c.vocab_size = 512;
  c.max_position_embeddings = 512;
  return c;
}

methods::ServedForward Served(const std::string& job) {
  auto recipe = LoadRecipe(testing::SourceDir() + "/jobs/" + job + ".yaml");
  EXPECT_TRUE(recipe.ok()) << recipe.status();
  if (!recipe.ok()) return {};
  auto method = methods::MakeMethod(*recipe, SmallConfig());
  EXPECT_TRUE(method.ok()) << method.status();
  if (!method.ok()) return {};
  auto served = (*method)->inference().Served();
  EXPECT_TRUE(served.ok()) << served.status();
  return served.ok() ? *served : methods::ServedForward();
}

std::string Steps(const methods::ServedForward& s) {
  std::string out;
  for (const auto& step : s.online) {
    out += (out.empty() ? "" : " | ") + step.what + (step.on_linear_inputs ? " [inputs]" : "");
  }
  return out;
}

TEST(ServedForwardTest, WeightOnlyMethodsComputeAPlainForward) {
  for (const char* job : {"rtn-4bit", "gptq-4bit", "quip-e8p-2bit", "quarot-w4a16-r12"}) {
    SCOPED_TRACE(job);
    const methods::ServedForward s = Served(job);
    EXPECT_EQ(Steps(s), "");
    EXPECT_FALSE(s.linear_inputs.has_value());
    EXPECT_TRUE(s.input_hadamards.empty());
  }
}

TEST(ServedForwardTest, QuarotW8A8WithBlockR4IsAllOnLinearInputs) {
  const methods::ServedForward s = Served("quarot-w8a8-wchannel-atensor-static-r124b");
  EXPECT_EQ(Steps(s), "the online Hadamard R4 on the down_proj input [inputs] | "
                      "8-bit activation quantization [inputs]");
  ASSERT_TRUE(s.linear_inputs.has_value());
  EXPECT_EQ(s.linear_inputs->bits, 8);
  EXPECT_TRUE(s.linear_inputs->is_static);
  EXPECT_EQ(s.linear_inputs->granularity, "per_tensor");
  ASSERT_EQ(s.input_hadamards.size(), 1u);
  EXPECT_EQ(s.input_hadamards[0].linear, model::LinearKind::kDown);
  // r4_block: auto, the largest power of two dividing the intermediate size (128 here).
  EXPECT_EQ(s.input_hadamards[0].block, 128);
}

TEST(ServedForwardTest, QuarotW4A4KV4HasStepsNoFormatCarries) {
  const methods::ServedForward s = Served("quarot-w4a4kv4");
  EXPECT_EQ(Steps(s),
            "the online Hadamard R3 on queries and keys | the online Hadamard R4 on the down_proj "
            "input (of the whole intermediate size; rotation.r4_block makes it block-diagonal) | "
            "4-bit activation quantization [inputs] | 4-bit int KV-cache quantization");
  ASSERT_TRUE(s.linear_inputs.has_value());
  EXPECT_EQ(s.linear_inputs->bits, 4);
  EXPECT_TRUE(s.input_hadamards.empty());  // R4 of the whole size is not block-diagonal
}

TEST(ServedForwardTest, PrefixQuantIsNeverAPlainForward) {
  EXPECT_EQ(Steps(Served("prefixquant-w4a4kv4")),
            "static activation and KV quantization | online Hadamards | a prefixed KV cache");
  EXPECT_EQ(Steps(Served("prefixquant-w4a4kv4-noprefix")),
            "static activation and KV quantization | online Hadamards");
}

}  // namespace
}  // namespace qcal
