// QuaRot stage 1 leaves the float model's function unchanged (computational invariance, QuaRot
// §3.4): norm fusion, R1 (randomized Hadamard of the hidden size, fused), R2 (per-head Hadamard on
// v/o, fused), R3 (online per-head Hadamard on q and k after RoPE) and R4 (online Hadamard before
// down_proj, its inverse fused), each alone and all together, on both real models and on
// synthetic models whose sizes force the fallbacks.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/text.h"
#include "common/tokenizer.h"
#include "kernels/hadamard.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/model/llama.h"
#include "engine/qsim/act_quant.h"
#include "methods/registry.h"
#include "methods/method_factory.h"
#include "engine/qsim/rotate.h"
#include "methods/rotated_block.h"

namespace qcal {
namespace {

struct Variant {
  const char* name;
  bool r1, r2, r3, r4;
};
constexpr Variant kVariants[] = {
    {"all", true, true, true, true}, {"r1", true, false, false, false},
    {"r2", false, true, false, false}, {"r3", false, false, true, false},
    {"r4", false, false, false, true}, {"r1_r2", true, true, false, false},
};

// max |a − b| / max |b|.
class RealModelRotationTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
  }

  std::string ModelDir(const std::string& name) { return testing::RealModelDir(name); }

  // Two windows of TinyStories text (BOS + 95 tokens each).
  at::Tensor Tokens(const std::string& dir) {
    auto tok = LoadTokenizerFromModelDir(dir);
    EXPECT_TRUE(tok.ok()) << tok.status();
    auto text = ReadTextFile(testing::SharedDir() +
                             "/data/tinystories/TinyStories-valid.sample30k.txt");
    EXPECT_TRUE(text.ok()) << text.status();
    std::vector<int32_t> ids = (*tok)->Encode(text->substr(0, 4000));
    EXPECT_GE(ids.size(), 190u);
    at::Tensor t = at::empty({2, 96}, at::kLong);
    for (int64_t b = 0; b < 2; ++b) {
      t[b][0] = (*tok)->bos_id();
      for (int64_t j = 1; j < 96; ++j) t[b][j] = ids[b * 95 + j - 1];
    }
    return t;
  }

};

TEST_P(RealModelRotationTest, RotatedFloatModelGivesTheSameLogits) {
  const std::string dir = ModelDir(GetParam());
  auto reference = model::LlamaModel::Load(dir);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const at::Tensor ids = Tokens(dir);
  const at::Tensor want = (*reference)->Forward(ids);
  ASSERT_GT(want.abs().max().item<double>(), 0.0);
  const LlamaConfig& config = (*reference)->config();
  // Every size of both models has a Hadamard matrix: hidden 64, head_dim 8 / 16, FFN 172.
  ASSERT_TRUE(PlanHadamard(config.intermediate_size).IsHadamard());
  for (const Variant& v : kVariants) {
    RotationSpec spec;
    spec.r1 = v.r1;
    spec.r2 = v.r2;
    spec.r3 = v.r3;
    spec.r4 = v.r4;
    spec.seed = 1234;
    auto plan = qsim::PlanRotations(spec, config);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->warnings.empty()) << plan->Describe();
    EXPECT_EQ(plan->r1, v.r1);
    EXPECT_EQ(plan->r4, v.r4);
    auto rotated = model::LlamaModel::Load(dir);
    ASSERT_TRUE(rotated.ok());
    ASSERT_TRUE(qsim::RotateModel(**rotated, *plan).ok());
    // The transforms really changed the weights (a test that could not fail otherwise).
    if (v.r1) {
      EXPECT_FALSE(at::allclose((*rotated)->embed_weight(), (*reference)->embed_weight()));
      EXPECT_TRUE(at::equal((*rotated)->final_norm(), at::ones_like((*rotated)->final_norm())));
    }
    if (v.r2) {
      const model::Linear& vr = (*rotated)->block(0).weights().linear(model::LinearKind::kV);
      const model::Linear& vo = (*reference)->block(0).weights().linear(model::LinearKind::kV);
      EXPECT_FALSE(at::allclose(vr.DenseWeight(), vo.DenseWeight()));
    }
    EXPECT_EQ((*rotated)->block(0).hooks().qk_rotation.defined(), v.r3);
    const model::Linear& down = (*rotated)->block(0).weights().linear(model::LinearKind::kDown);
    EXPECT_EQ(dynamic_cast<const qsim::ActQuantLinear*>(&down) != nullptr, v.r4);
    const at::Tensor got = (*rotated)->Forward(ids);
    const double rel = testing::RelMaxDiff(want, got);
    std::printf("%s %-6s max|Δlogits|/max|logits| = %.3g\n", GetParam().c_str(), v.name, rel);
    EXPECT_LT(rel, 1e-4) << GetParam() << " " << v.name;
  }
}

TEST_P(RealModelRotationTest, DifferentSeedsGiveDifferentWeightsSameFunction) {
  const std::string dir = ModelDir(GetParam());
  auto a = model::LlamaModel::Load(dir);
  auto b = model::LlamaModel::Load(dir);
  ASSERT_TRUE(a.ok() && b.ok());
  RotationSpec spec;
  spec.seed = 1;
  ASSERT_TRUE(qsim::RotateModel(**a, *qsim::PlanRotations(spec, (*a)->config())).ok());
  spec.seed = 2;
  ASSERT_TRUE(qsim::RotateModel(**b, *qsim::PlanRotations(spec, (*b)->config())).ok());
  EXPECT_FALSE(at::allclose((*a)->embed_weight(), (*b)->embed_weight()));
  const at::Tensor ids = Tokens(dir);
  EXPECT_LT(testing::RelMaxDiff((*b)->Forward(ids), (*a)->Forward(ids)), 1e-4);
}

// Learned rotations (issue 17: R1 and one R2 per block trained by Cayley SGD) fuse like the
// Hadamard ones: any orthogonal T1 / T2 leave the float function unchanged, with R3/R4 online.
TEST_P(RealModelRotationTest, LearnedRotationsFusedKeepTheFunction) {
  const std::string dir = ModelDir(GetParam());
  auto original = model::LlamaModel::Load(dir);
  auto learned = model::LlamaModel::Load(dir);
  auto hadamard = model::LlamaModel::Load(dir);
  ASSERT_TRUE(original.ok() && learned.ok() && hadamard.ok());
  const LlamaConfig& c = (*learned)->config();
  at::manual_seed(testing::TestSeed());
  auto random_orthogonal = [](int64_t batch, int64_t n) {
    auto [q, r] = at::linalg_qr(at::randn({batch, n, n}, at::kDouble));
    return (q * at::sign(r.diagonal(0, -2, -1)).unsqueeze(-2)).squeeze(0);
  };
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(qsim::RotateModel(**hadamard, *plan).ok());
  const at::Tensor t1 = random_orthogonal(1, c.hidden_size);
  const at::Tensor t2 = random_orthogonal(c.num_hidden_layers, c.head_dim);
  ASSERT_TRUE(qsim::SetLearnedRotations(&*plan, t1, t2, c.num_hidden_layers).ok());
  EXPECT_NE(plan->Describe().find("learned R1 R2"), std::string::npos) << plan->Describe();
  ASSERT_TRUE(qsim::RotateModel(**learned, *plan).ok());
  const at::Tensor ids = Tokens(dir);
  const at::Tensor want = (*original)->Forward(ids);
  const double diff = testing::RelMaxDiff((*learned)->Forward(ids), want);
  std::printf("[%s] learned R1/R2 fused: max relative logit difference %.3g\n",
              GetParam().c_str(), diff);
  EXPECT_LT(diff, 1e-4);
  EXPECT_FALSE(at::allclose((*learned)->embed_weight(), (*hadamard)->embed_weight()));

  // Bad learned rotations are refused with the reason.
  qsim::RotationPlan bad = *qsim::PlanRotations(RotationSpec{}, c);
  const at::Tensor not_orthogonal = t1 * 1.01;
  auto message = [](const Status& s) { return std::string(s.message()); };
  EXPECT_NE(message(qsim::SetLearnedRotations(&bad, not_orthogonal, at::Tensor(),
                                              c.num_hidden_layers))
                .find("not orthogonal"),
            std::string::npos);
  EXPECT_NE(message(qsim::SetLearnedRotations(&bad, at::Tensor(), t2.narrow(0, 0, 1),
                                              c.num_hidden_layers))
                .find("expected ["),
            std::string::npos);
  // A learned R2 needs the block's index.
  ASSERT_TRUE(qsim::SetLearnedRotations(&bad, at::Tensor(), t2, c.num_hidden_layers).ok());
  auto fresh = model::LlamaModel::Load(dir);
  ASSERT_TRUE(fresh.ok());
  EXPECT_FALSE(qsim::RotateBlockWeights((*fresh)->mutable_block(0).mutable_weights(), c, bad).ok());
}

INSTANTIATE_TEST_SUITE_P(Models, RealModelRotationTest,
                         ::testing::Values("stories260K", "aidreams260K"));

// A random model with the given sizes (GQA when kv_heads < heads).
std::unique_ptr<model::LlamaModel> RandomModel(int64_t hidden, int64_t heads, int64_t kv_heads,
                                               int64_t head_dim, int64_t ffn, uint64_t seed) {
  LlamaConfig c;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_hidden_layers = 2;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.vocab_size = 40;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  at::manual_seed(seed);
  auto w = [](std::vector<int64_t> shape, double scale) {
    return at::randn(shape, at::kFloat) * scale;
  };
  std::vector<model::DecoderBlock> blocks;
  for (int l = 0; l < 2; ++l) {
    model::BlockWeights b;
    b.input_norm = 1 + w({hidden}, 0.3);
    b.post_norm = 1 + w({hidden}, 0.3);
    const std::vector<int64_t> shapes[7] = {{c.q_dim(), hidden}, {c.kv_dim(), hidden},
                                            {c.kv_dim(), hidden}, {hidden, c.q_dim()},
                                            {ffn, hidden},        {ffn, hidden},
                                            {hidden, ffn}};
    for (int k = 0; k < 7; ++k) {
      b.linears[k] = std::make_unique<model::DenseLinear>(w(shapes[k], 0.2));
    }
    blocks.emplace_back(c, std::move(b));
  }
  at::Tensor embed = w({c.vocab_size, hidden}, 1.0);
  return std::make_unique<model::LlamaModel>(c, embed, std::move(blocks), 1 + w({hidden}, 0.3),
                                             std::make_unique<model::DenseLinear>(embed));
}

TEST(SyntheticRotationTest, FallbacksSkipOnlineRotationsAndKeepTheFunction) {
  // head_dim 6 (no Hadamard: R2 by the randomized FFT, R3 skipped), FFN 22 = 2·11 (R4 skipped),
  // hidden 24 = 2·12 (R1 with H_2 ⊗ H_12); GQA 4 heads over 2 KV heads.
  const uint64_t seed = testing::TestSeed();
  auto reference = RandomModel(24, 4, 2, 6, 22, seed);
  auto rotated = RandomModel(24, 4, 2, 6, 22, seed);
  RotationSpec spec;
  spec.seed = seed;
  auto plan = qsim::PlanRotations(spec, rotated->config());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->r1);
  EXPECT_TRUE(plan->r2);
  EXPECT_FALSE(plan->r3);
  EXPECT_FALSE(plan->r4);
  ASSERT_EQ(plan->warnings.size(), 3u) << plan->Describe();  // R2 via RFFT, R3 and R4 skipped
  ASSERT_TRUE(qsim::RotateModel(*rotated, *plan).ok());
  at::Tensor ids = at::randint(0, 40, {2, 20}, at::kLong);
  const at::Tensor want = reference->Forward(ids);
  EXPECT_LT(testing::RelMaxDiff(want, rotated->Forward(ids)), 1e-5);
  EXPECT_FALSE(at::allclose(rotated->embed_weight(), reference->embed_weight()));
}

TEST(SyntheticRotationTest, NonPowerOfTwoHadamardSizesRotateOnline) {
  // hidden 48 = 4·12, head_dim 12, FFN 28: every rotation applies through H_{2^k} ⊗ H_m.
  const uint64_t seed = testing::TestSeed();
  auto reference = RandomModel(48, 4, 4, 12, 28, seed);
  auto rotated = RandomModel(48, 4, 4, 12, 28, seed);
  RotationSpec spec;
  spec.seed = seed;
  auto plan = qsim::PlanRotations(spec, rotated->config());
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->r1 && plan->r2 && plan->r3 && plan->r4) << plan->Describe();
  EXPECT_TRUE(plan->warnings.empty());
  ASSERT_TRUE(qsim::RotateModel(*rotated, *plan).ok());
  at::Tensor ids = at::randint(0, 40, {2, 20}, at::kLong);
  EXPECT_LT(testing::RelMaxDiff(reference->Forward(ids), rotated->Forward(ids)), 1e-5);
}

// A float block's weights, copied (every linear dense).
model::BlockWeights DenseCopy(const model::BlockWeights& w) {
  model::BlockWeights c;
  c.input_norm = w.input_norm.clone();
  c.post_norm = w.post_norm.clone();
  for (int k = 0; k < 7; ++k) {
    c.linears[k] = std::make_unique<model::DenseLinear>(w.linears[k]->DenseWeight().clone());
  }
  return c;
}

TEST(SyntheticRotationTest, QuarotBlockTaskNeedsARotatedBlock) {
  // Through the method's parts (methods/parts.h): its quantizer refuses a block that did not go
  // through its transform, and quantizes it once it has.
  auto m = RandomModel(24, 4, 2, 6, 22, 3);
  auto recipe = ParseRecipe(
      "name: t\nmethod: quarot\nweights: rtn\nbits: 4\n"
      "rotation: {enabled: true, r1: true, r2: true, r3: false, r4: false, seed: 0}\n",
      "test recipe");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  auto method = methods::MakeMethod(*recipe, m->config());
  ASSERT_TRUE(method.ok()) << method.status();
  const model::Rope rope(m->config());
  methods::BlockInputs in;
  in.layer = 0;
  in.rope = &rope;
  auto refused = (*method)->quantizer().QuantizeBlock(DenseCopy(m->block(0).weights()), in);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  model::BlockWeights prepared = DenseCopy(m->block(0).weights());
  ASSERT_TRUE((*method)->transform().PrepareBlock(0, &prepared).ok());
  const at::Tensor flags = prepared.extra.at(methods::kRotationsKey);
  EXPECT_TRUE(at::equal(flags, at::tensor({1.0, 1.0, 0.0, 0.0}, at::kDouble)));  // R3/R4 off
  auto done = (*method)->quantizer().QuantizeBlock(std::move(prepared), in);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->linears.size(), 7u);
}

TEST(SyntheticRotationTest, OddSizesAreRefusedForOfflineRotations) {
  auto m = RandomModel(24, 4, 2, 6, 22, 1);
  LlamaConfig c = m->config();
  c.hidden_size = 25;
  RotationSpec spec;
  auto plan = qsim::PlanRotations(spec, c);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("R1"), std::string::npos) << plan.status();
  spec.r1 = false;  // R2/R3/R4 alone do not need the hidden size
  EXPECT_TRUE(qsim::PlanRotations(spec, c).ok());
  spec.enabled = false;
  spec.r1 = true;
  auto none = qsim::PlanRotations(spec, c);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->any());
}

}  // namespace
}  // namespace qcal
