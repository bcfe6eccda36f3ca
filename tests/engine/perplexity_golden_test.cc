// Perplexity on the real models against the independent reference (--bos-per-window), plus the
// window arithmetic of both conventions.
#include <cmath>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/eval/perplexity.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

struct PplCase {
  std::string model;
  std::string data_key;   // golden key fragment
  std::string data_path;  // under shared/
  int64_t ctx;
};

std::ostream& operator<<(std::ostream& os, const PplCase& c) {
  return os << c.model << "/" << c.data_key;
}

class PerplexityGoldenTest : public ::testing::TestWithParam<PplCase> {};

TEST_P(PerplexityGoldenTest, MatchesReferenceWithinPointOnePercent) {
  const PplCase& c = GetParam();
  auto golden_text = ReadFile(testing::SharedDir() + "/golden/reference.json");
  ASSERT_TRUE(golden_text.ok()) << golden_text.status();
  const auto golden = nlohmann::json::parse(*golden_text)[c.model][
      "ppl_" + c.data_key + "_ctx" + std::to_string(c.ctx)];

  const std::string dir = testing::RealModelDir(c.model);
  auto model = model::LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  model::SetComputeThreads(model::AutoComputeThreads((*model)->config()));
  auto tokenizer = LoadTokenizerFromModelDir(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto text = ReadTextFile(testing::SharedDir() + "/" + c.data_path);
  ASSERT_TRUE(text.ok()) << text.status();
  std::vector<int32_t> tokens = (*tokenizer)->Encode(*text);
  EXPECT_EQ(static_cast<int64_t>(tokens.size()), golden["tokens_encoded"].get<int64_t>());

  eval::PerplexityOptions opt;
  opt.ctx = c.ctx;
  opt.bos_per_window = true;
  auto r = eval::EvaluatePerplexity(**model, tokens, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens_scored, golden["tokens_scored"].get<int64_t>());
  const double want = golden["ppl"].get<double>();
  EXPECT_LT(std::abs(r->perplexity - want) / want, 1e-3)
      << "ours " << r->perplexity << " golden " << want;
  EXPECT_NEAR(r->mean_nll, golden["mean_nll"].get<double>(), 1e-3);
  std::printf("%s %s ctx %lld: ppl %.4f (golden %.4f), %lld tokens in %.1f s\n", c.model.c_str(),
              c.data_key.c_str(), (long long)c.ctx, r->perplexity, want,
              (long long)r->tokens_scored, r->seconds);
}

INSTANTIATE_TEST_SUITE_P(
    RealModels, PerplexityGoldenTest,
    ::testing::Values(
        PplCase{"stories260K", "tinystories_sample",
                "data/tinystories/TinyStories-valid.sample30k.txt", 512},
        PplCase{"aidreams260K", "tinystories_sample",
                "data/tinystories/TinyStories-valid.sample30k.txt", 128},
        PplCase{"stories260K", "wikitext2_test_joined", "data/wikitext2/wiki.test.joined.txt", 512},
        PplCase{"aidreams260K", "wikitext2_test_joined", "data/wikitext2/wiki.test.joined.txt",
                128}),
    [](const ::testing::TestParamInfo<PplCase>& info) {
      return info.param.model + "_" + info.param.data_key;
    });

// Window arithmetic, independent of the numbers.
TEST(PerplexityWindowsTest, CountsFollowBothConventions) {
  const std::string dir = testing::RealModelDir("stories260K");
  auto model = model::LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 3 + (i * 7919) % 500;

  eval::PerplexityOptions opt;
  opt.ctx = 128;
  // Default: BOS + 1000 tokens = 1001 stream tokens -> 7 full windows of 128, 127 targets each.
  auto r = eval::EvaluatePerplexity(**model, tokens, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->windows, 7);
  EXPECT_EQ(r->tokens_scored, 7 * 127);
  EXPECT_GT(r->perplexity, 1.0);

  // BOS per window: every text token scored; ceil(1000 / 127) = 8 windows.
  opt.bos_per_window = true;
  r = eval::EvaluatePerplexity(**model, tokens, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->windows, 8);
  EXPECT_EQ(r->tokens_scored, 1000);

  // --max-tokens limits the text used; batch size does not change the result.
  opt.max_tokens = 300;
  opt.batch = 1;
  auto a = eval::EvaluatePerplexity(**model, tokens, opt);
  opt.batch = 3;
  auto b = eval::EvaluatePerplexity(**model, tokens, opt);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens_scored, 300);
  EXPECT_NEAR(a->mean_nll, b->mean_nll, 1e-5);

  // Errors are clear.
  opt.ctx = 4096;
  auto too_long = eval::EvaluatePerplexity(**model, tokens, opt);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("max_position_embeddings"), std::string::npos);
  opt.ctx = 128;
  opt.bos_per_window = false;
  auto too_short = eval::EvaluatePerplexity(**model, std::vector<int32_t>(10, 5), opt);
  ASSERT_FALSE(too_short.ok());
  EXPECT_NE(too_short.status().message().find("not one window"), std::string::npos);
}

}  // namespace
}  // namespace qcal
