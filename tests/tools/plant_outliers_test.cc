// qcal tool plant-outliers (tools/plant_outliers.h): the planted variant of each real
// model computes the same logits (1e-5 relative) while its activation outlier ratios rise.
#include "tools/plant_outliers.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "tests/model_fixtures.h"
#include "tools/outlier_stats.h"

namespace qcal::tools {
namespace {

using testing::LoadModelOrDie;
using testing::RealModelDir;

TEST(MaxOverMedian, Definition) {
  EXPECT_DOUBLE_EQ(MaxOverMedian({1, 2, 3}), 1.5);
  EXPECT_DOUBLE_EQ(MaxOverMedian({1, 2, 3, 10}), 4.0);  // median (2 + 3) / 2
  EXPECT_DOUBLE_EQ(MaxOverMedian({0, 0}), 0.0);
  EXPECT_TRUE(std::isinf(MaxOverMedian({0, 0, 1})));
}

LlamaConfig SmallConfig() {
  LlamaConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  return c;
}

TEST(PlanOutliers, SeededDistinctInRange) {
  const LlamaConfig c = SmallConfig();
  PlantOutliersOptions o;
  o.down_channels = 5;
  o.v_channels = 3;
  o.k_pairs = 2;
  o.seed = 7;
  auto a = PlanOutliers(c, o), b = PlanOutliers(c, o);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), 3u);
  bool layers_differ = false;
  for (size_t l = 0; l < a->size(); ++l) {
    const LayerOutlierPlan& p = (*a)[l];
    EXPECT_EQ(p.down, (*b)[l].down);
    EXPECT_EQ(p.v, (*b)[l].v);
    EXPECT_EQ(p.k_pairs, (*b)[l].k_pairs);
    ASSERT_EQ(p.down.size(), 5u);
    ASSERT_EQ(p.v.size(), 3u);
    ASSERT_EQ(p.k_pairs.size(), 4u);  // 2 per KV head
    EXPECT_TRUE(std::adjacent_find(p.down.begin(), p.down.end()) == p.down.end());
    EXPECT_GE(p.down.front(), 0);
    EXPECT_LT(p.down.back(), 24);
    EXPECT_LT(p.v.back(), 8);
    EXPECT_EQ(p.k_pairs[0] / 2, 0);  // KV head 0's pairs, then head 1's
    EXPECT_EQ(p.k_pairs[2] / 2, 1);
    layers_differ |= l > 0 && p.down != (*a)[0].down;
  }
  EXPECT_TRUE(layers_differ);
  o.seed = 8;
  auto other = PlanOutliers(c, o);
  ASSERT_TRUE(other.ok());
  bool seeds_differ = false;
  for (size_t l = 0; l < a->size(); ++l) seeds_differ |= (*other)[l].down != (*a)[l].down;
  EXPECT_TRUE(seeds_differ);
}

TEST(PlanOutliers, RejectsBadOptions) {
  const LlamaConfig c = SmallConfig();
  PlantOutliersOptions o;
  o.alpha = 0;
  EXPECT_FALSE(PlanOutliers(c, o).ok());
  o = {};
  o.beta = std::nan("");
  EXPECT_FALSE(PlanOutliers(c, o).ok());
  o = {};
  o.k_pairs = 3;  // head_dim 4 has 2 pairs
  auto s = PlanOutliers(c, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.status().message()).find("--k-pairs"), std::string::npos);
  o = {};
  o.down_channels = 25;
  EXPECT_FALSE(PlanOutliers(c, o).ok());
}

// GQA: one v row of KV head 1 must divide the o_proj columns of both query heads 2 and 3, and a
// K pair of KV head 0 the W_q rows of query heads 0 and 1.
TEST(PlantOutliersInLayer, TouchesExactlyTheCoupledWeights) {
  const LlamaConfig c = SmallConfig();
  LayerOutlierPlan plan;
  plan.down = {5};
  plan.v = {4 + 3};    // KV head 1, channel 3
  plan.k_pairs = {1};  // KV head 0, pair (1, 3)
  PlantOutliersOptions o;
  o.alpha = 4;
  o.beta = 8;
  at::Tensor w[6] = {at::ones({16, 16}), at::ones({8, 16}),  at::ones({8, 16}),
                     at::ones({16, 16}), at::ones({24, 16}), at::ones({16, 24})};
  at::Tensor orig[6];
  for (int i = 0; i < 6; ++i) orig[i] = w[i].clone();
  ASSERT_TRUE(PlantOutliersInLayer(c, plan, o, w[0], w[1], w[2], w[3], w[4], w[5]).ok());
  at::Tensor expect[6];
  for (int i = 0; i < 6; ++i) expect[i] = orig[i].clone();
  for (int h : {0, 1}) {
    for (int ch : {1, 3}) expect[0][h * 4 + ch].fill_(1.0 / 8);
  }
  for (int ch : {1, 3}) expect[1][ch].fill_(8);
  expect[2][7].fill_(4);
  for (int h : {2, 3}) expect[3].select(1, h * 4 + 3).fill_(0.25);
  expect[4][5].fill_(4);
  expect[5].select(1, 5).fill_(0.25);
  const char* names[6] = {"q", "k", "v", "o", "up", "down"};
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(w[i].equal(expect[i])) << names[i];
  at::Tensor bad = at::ones({3, 3});
  EXPECT_FALSE(PlantOutliersInLayer(c, plan, o, bad, w[1], w[2], w[3], w[4], w[5]).ok());
}

class PlantOutliersRealModel : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { model::SetComputeThreads(1); }
};

TEST_P(PlantOutliersRealModel, SameLogitsAndOutlierRatiosRise) {
  const std::string src = RealModelDir(GetParam());
  const std::string out = testing::MakeTempDir("planted") + "/" + GetParam();
  PlantOutliersOptions o;  // α = β = 50
  auto r = PlantOutliers(src, out, o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const char* f :
       {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
        "generation_config.json", "planted_outliers.json"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + f)) << f;
  }
  auto plan_text = ReadFile(out + "/planted_outliers.json");
  ASSERT_TRUE(plan_text.ok());
  EXPECT_EQ(nlohmann::json::parse(*plan_text)["layers"].size(),
            static_cast<size_t>(r->config.num_hidden_layers));

  auto base = LoadModelOrDie(src);
  auto planted = LoadModelOrDie(out);
  ASSERT_TRUE(base && planted);
  const std::vector<int32_t> tokens = testing::StoryTokens(src, 2000);
  const at::Tensor ids = testing::WithBos(tokens, 128);
  const at::Tensor want = base->Forward(ids);
  const double diff = testing::RelMaxDiff(want, planted->Forward(ids));
  std::printf("[ planted  ] %s: logits max rel diff %.2e\n", GetParam().c_str(), diff);
  EXPECT_LE(diff, 1e-5);

  const int64_t ctx = std::min<int64_t>(128, r->config.max_position_embeddings);
  auto before = MeasureOutlierStats(*base, tokens, ctx, 1);
  auto after = MeasureOutlierStats(*planted, tokens, ctx, 1);
  ASSERT_TRUE(before.ok() && after.ok());
  const LayerOutlierStats b = before->Max(), a = after->Max();
  std::printf(
      "[ outliers ] %s max/median (max over layers): down_proj in %.1f -> %.1f, o_proj in "
      "%.1f -> %.1f, K %.1f -> %.1f\n",
      GetParam().c_str(), b.down_input, a.down_input, b.o_input, a.o_input, b.k, a.k);
  // Every layer's ratio rises, and the model-wide max by at least 5x.
  for (size_t l = 0; l < before->layers.size(); ++l) {
    EXPECT_GT(after->layers[l].down_input, before->layers[l].down_input) << "layer " << l;
    EXPECT_GT(after->layers[l].o_input, before->layers[l].o_input) << "layer " << l;
    EXPECT_GT(after->layers[l].k, before->layers[l].k) << "layer " << l;
  }
  EXPECT_GT(a.down_input, 5 * b.down_input);
  EXPECT_GT(a.o_input, 5 * b.o_input);
  EXPECT_GT(a.k, 5 * b.k);
  // The wrappers are gone again: the model still computes the same logits.
  EXPECT_TRUE(base->Forward(ids).equal(want));
}

INSTANTIATE_TEST_SUITE_P(Models, PlantOutliersRealModel,
                         ::testing::Values("stories260K", "aidreams260K"));

TEST(PlantOutliers, ErrorsNameTheProblem) {
  const std::string src = RealModelDir("stories260K");
  auto same = PlantOutliers(src, src, {});
  ASSERT_FALSE(same.ok());
  EXPECT_NE(std::string(same.status().message()).find("input model directory"), std::string::npos);
  // A "quantized" model directory is refused.
  const std::string q = testing::MakeTempDir("quantized");
  auto cfg = ReadFile(src + "/config.json");
  ASSERT_TRUE(cfg.ok());
  nlohmann::json j = nlohmann::json::parse(*cfg);
  j["quantization_config"] = {{"quant_method", "qcal"}};
  ASSERT_TRUE(WriteFileAtomic(q + "/config.json", j.dump()).ok());
  auto quant = PlantOutliers(q, q + "/out", {});
  ASSERT_FALSE(quant.ok());
  EXPECT_NE(std::string(quant.status().message()).find("quantization_config"), std::string::npos);
  auto missing = PlantOutliers(q + "/nope", q + "/out", {});
  EXPECT_FALSE(missing.ok());
}

}  // namespace
}  // namespace qcal::tools
