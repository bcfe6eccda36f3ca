// qcal tool plant-sinks (tools/plant_sinks.h) and PrefixQuant's outlier-token detection
// (tools/measure_token_outliers.h), on both real models:
//   * the real models have no token-wise outliers (max/median < 10 at every down_proj input);
//   * the planted variant's planted tokens (BOS and the first '.' after it) reach max/median
//     >= 100 in at least two layers, detection finds exactly ['.', BOS], and with that prefix in
//     the KV cache no other token's ratio reaches 10;
//   * later heads give the planted tokens more attention than the reference gives those
//     positions, and in at least two layers >= 0.15 of it and >= 3x the reference's;
//   * the planted model's float perplexity on TinyStories stays within 10% of the original's,
//     with one BOS per text and with a BOS (so sinks) in every window, and behind the prefix.
#include "tools/plant_sinks.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/model_fixtures.h"
#include "engine/eval/perplexity.h"
#include "tools/measure_token_outliers.h"

namespace qcal::tools {
namespace {

using testing::LoadModelOrDie;
using testing::RealModelDir;
using testing::StoryTokens;

TEST(PrefixTokens, TopIdsByCountThenBos) {
  TokenOutlierReport r;
  r.sequences = 10;
  r.o = 2;
  r.outlier_id_counts = {{7, 5}, {9, 30}, {11, 30}, {4, 1}};
  EXPECT_EQ(PrefixTokens(r, 1), (std::vector<int32_t>{9, 11, 1}));  // ties: smaller id first
  r.o = 5;
  EXPECT_EQ(PrefixTokens(r, 1), (std::vector<int32_t>{9, 11, 7, 4, 1}));
  r.o = 0;
  EXPECT_EQ(PrefixTokens(r, 1), (std::vector<int32_t>{1}));
  // The reference's corner case: one distinct id seen in fewer than a tenth of the sequences.
  r.o = 2;
  r.outlier_id_counts = {{7, 0}};
  r.sequences = 20;
  r.outlier_id_counts[7] = 1;
  EXPECT_EQ(PrefixTokens(r, 1), (std::vector<int32_t>{1}));
  r.outlier_id_counts[7] = 2;
  EXPECT_EQ(PrefixTokens(r, 1), (std::vector<int32_t>{7, 1}));
}

TEST(TextWindows, BosWindowsAndTails) {
  const std::vector<int32_t> t = {5, 6, 7, 8, 9};
  EXPECT_EQ(TextWindows(t, 3, true, 1),
            (std::vector<std::vector<int32_t>>{{1, 5, 6}, {1, 7, 8}, {1, 9}}));
  EXPECT_EQ(TextWindows(t, 2, false, 1),
            (std::vector<std::vector<int32_t>>{{5, 6}, {7, 8}}));  // a 1-token tail is dropped
  EXPECT_EQ(TextWindows(t, 3, true, 1, 2).size(), 2u);
}

double Perplexity(const model::LlamaModel& m, const std::vector<int32_t>& tokens, int64_t ctx,
                  bool bos_per_window = false) {
  eval::PerplexityOptions o;
  o.ctx = ctx;
  o.bos_per_window = bos_per_window;
  auto r = eval::EvaluatePerplexity(m, tokens, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->perplexity : 0;
}

TEST(PlantSinksOptions, BadOptionsAreRefusedWithTheReason) {
  auto m = LoadModelOrDie(RealModelDir("stories260K"));
  auto message = [&](PlantSinksOptions o) {
    auto r = PlantSinks(*m, {}, o);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  PlantSinksOptions o;
  o.delimiters = {};
  EXPECT_NE(message(o).find("1 or 2 delimiter"), std::string::npos);
  o.delimiters = {1};
  EXPECT_NE(message(o).find("is BOS"), std::string::npos);
  o.delimiters = {13, 14, 15};
  EXPECT_NE(message(o).find("1 or 2 delimiter"), std::string::npos);
  o.delimiters = {13};
  o.writer_layer = 3;
  o.eraser_layer = 2;
  EXPECT_NE(message(o).find("writer < eraser"), std::string::npos);
  o.writer_layer = -1;
  o.eraser_layer = -1;
  o.sampled_sequences = 1;
  EXPECT_NE(message(o).find("windows"), std::string::npos);
}

class PlantSinksTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PlantSinksTest, PlantedTokensAreFoundAndThePrefixRemovesThem) {
  const std::string dir = RealModelDir(GetParam());
  auto original = LoadModelOrDie(dir);
  const int32_t bos = 1, period = testing::PieceId(dir, ".");
  const int64_t ctx = std::min<int64_t>(128, original->config().max_position_embeddings);
  const std::vector<int32_t> stories = StoryTokens(dir, 8192);
  const auto windows = TextWindows(stories, ctx, true, bos);

  // The real model has no token-wise outliers.
  auto plain = MeasureTokenOutliers(*original, windows);
  ASSERT_TRUE(plain.ok()) << plain.status();
  std::printf("[%s] original: largest token max/median %.2f\n", GetParam(), plain->MaxRatio());
  EXPECT_LT(plain->MaxRatio(), 10);

  PlantSinksOptions o;
  o.bos_id = bos;
  o.delimiters = {period};
  auto planted = PlantSinks(*original, {}, o);  // measured on text sampled from the model
  ASSERT_TRUE(planted.ok()) << planted.status();
  model::LlamaModel& m = *planted->model;
  EXPECT_EQ(m.config().hidden_size, 72);
  EXPECT_EQ(m.config().num_key_value_heads, original->config().num_key_value_heads + 1);

  // Later heads use the planted tokens as sinks: far more attention than the reference gives
  // the same positions.
  const auto& plan = planted->plan;
  const int64_t writer = plan["writer"]["layer"].get<int64_t>();
  int sink_layers = 0;
  for (int64_t l = writer + 1; l < m.num_blocks(); ++l) {
    const double a = plan["sink_attention"][l].get<double>();
    const double ref = plan["sink_attention_reference"][l].get<double>();
    std::printf("[%s] layer %lld attention on the planted tokens: %.3f (reference %.3f)\n",
                GetParam(), (long long)l, a, ref);
    EXPECT_GT(a, ref);
    sink_layers += a >= 0.15 && a >= 3 * ref;
  }
  EXPECT_GE(sink_layers, 2);

  auto before = MeasureTokenOutliers(m, windows);
  ASSERT_TRUE(before.ok()) << before.status();
  int layers_bos = 0, layers_period = 0;
  for (size_t l = 0; l < before->layers.size(); ++l) {
    const auto& ratios = before->layers[l].ratio_by_token;
    const double rb = ratios.count(bos) ? ratios.at(bos) : 0;
    const double rp = ratios.count(period) ? ratios.at(period) : 0;
    std::printf("[%s] planted layer %zu: BOS %.1f  '.' %.1f  largest %.1f  outliers/seq %.2f\n",
                GetParam(), l, rb, rp, before->layers[l].max_ratio, before->layers[l].mean_count);
    layers_bos += rb >= 100;
    layers_period += rp >= 100;
  }
  EXPECT_GE(layers_bos, 2);
  EXPECT_GE(layers_period, 2);

  // The float function stays close to the original's on text it was not distilled on.
  const std::vector<int32_t> eval_text = StoryTokens(dir, 1 << 20);
  const int64_t eval_ctx = original->config().max_position_embeddings;
  const double ppl0 = Perplexity(*original, eval_text, eval_ctx);
  const double ppl1 = Perplexity(m, eval_text, eval_ctx);
  std::printf("[%s] TinyStories perplexity (ctx %lld): original %.4f, planted %.4f (%+.2f%%)\n",
              GetParam(), (long long)eval_ctx, ppl0, ppl1, 100 * (ppl1 / ppl0 - 1));
  EXPECT_LT(std::abs(ppl1 / ppl0 - 1), 0.10);
  // Every window with a BOS (so with sinks): what the sinks' attention costs.
  const double bpw0 = Perplexity(*original, eval_text, eval_ctx, true);
  const double bpw1 = Perplexity(m, eval_text, eval_ctx, true);
  std::printf("[%s] ... with BOS in every window: original %.4f, planted %.4f (%+.2f%%)\n",
              GetParam(), bpw0, bpw1, 100 * (bpw1 / bpw0 - 1));
  EXPECT_LT(std::abs(bpw1 / bpw0 - 1), 0.10);

  const std::vector<int32_t> prefix = PrefixTokens(*before, bos);
  EXPECT_EQ(prefix, (std::vector<int32_t>{period, bos}));

  auto kv = model::ComputePrefixKv(m, prefix);
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_TRUE(model::InstallPrefixKv(m, *kv).ok());
  std::vector<std::vector<int32_t>> behind;
  for (const auto& w : windows) {
    if (w.size() >= 3) behind.emplace_back(w.begin() + 1, w.end());
  }
  auto after = MeasureTokenOutliers(m, behind);
  ASSERT_TRUE(after.ok()) << after.status();
  std::printf("[%s] with the prefix: largest token max/median %.2f\n", GetParam(),
              after->MaxRatio());
  EXPECT_LT(after->MaxRatio(), 10);

  // The float model behind its prefix (windows drop their BOS) computes about what it did.
  const double ppl2 = Perplexity(m, eval_text, eval_ctx);
  std::printf("[%s] TinyStories perplexity behind the prefix: %.4f (%+.2f%% vs no prefix)\n",
              GetParam(), ppl2, 100 * (ppl2 / ppl1 - 1));
  EXPECT_LT(std::abs(ppl2 / ppl1 - 1), 0.10);
}

INSTANTIATE_TEST_SUITE_P(RealModels, PlantSinksTest, ::testing::Values("stories260K", "aidreams260K"));

}  // namespace
}  // namespace qcal::tools
