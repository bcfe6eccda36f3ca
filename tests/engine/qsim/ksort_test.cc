// K-sort (engine/qsim/ksort.h) and BFP keys (engine/qsim/bfp_kv.h): the permutation leaves the
// float model unchanged, the tensor BFP quantizer equals the kernel reference bit for bit, and
// BFP12 keys lose less with K-sort — on the real models, on their outlier-planted variants and on
// a synthetic head_dim-128 attention layer with planted outlier channels.
#include "engine/qsim/ksort.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "kernels/bfp.h"
#include "tests/model_fixtures.h"
#include "engine/qsim/bfp_kv.h"
#include "tools/model_compare.h"
#include "tools/plant_outliers.h"

namespace qcal::qsim {
namespace {

using testing::LoadModelOrDie;
using testing::RealModelDir;
using testing::RelMaxDiff;
using tools::CompareToReference;
using tools::PlanOutliers;
using tools::PlantOutliers;
using tools::PlantOutliersInLayer;
using tools::PlantOutliersOptions;

// --- BFP on tensors vs the kernel reference -------------------------------------------------

TEST(BfpFakeQuantize, EqualsKernelReferenceBitForBit) {
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  std::mt19937_64 rng(seed);
  for (int p : {4, 8}) {
    for (int64_t n : {8, 16, 13, 128}) {
      for (int bs : {1, 2, 3, 4, 8, 16, 32, 64, 128}) {
        if (bs > n) continue;
        // Magnitudes over many binades, some zero rows and zero blocks, ties at .5.
        at::Tensor x =
            at::randn({3, 5, n}) * at::exp2(at::randint(-20, 20, {3, 5, 1}).to(at::kFloat));
        x[1][2].zero_();
        x[2].narrow(-1, 0, std::min<int64_t>(bs, n)).zero_();
        x[0][0][0] = 2.5f;  // with max 2.5 at p = 4: scale 2^-1, 5 → exact; others tie-rounded
        const kernels::BfpFormat f{bs, p};
        at::Tensor got = BfpFakeQuantizeLastDim(x, f);
        ASSERT_EQ(got.sizes(), x.sizes());
        at::Tensor xc = x.contiguous().view({-1, n});
        std::vector<float> want(n);
        for (int64_t r = 0; r < xc.size(0); ++r) {
          ASSERT_TRUE(
              kernels::BfpQuantizeDequantize(xc[r].data_ptr<float>(), n, f, want.data()).ok());
          at::Tensor g = got.view({-1, n})[r].contiguous();
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(g.data_ptr<float>()[i], want[i])
                << "p " << p << " n " << n << " block " << bs << " row " << r << " i " << i << " x "
                << xc[r][i].item<float>();
          }
        }
        ASSERT_GT(got.abs().max().item<float>(), 0.0f);
      }
    }
  }
}

TEST(BfpKvQuantizer, KeysAndQueriesQuantizedValuesUntouched) {
  at::manual_seed(testing::TestSeed());
  BfpKvQuantizer q(kernels::BfpFormat::Bfp12(4), kernels::BfpFormat::Bfp16(4));
  at::Tensor x = at::randn({2, 3, 5, 8});
  at::Tensor k = q.Apply(x, KvRole::kKey);
  at::Tensor qq = q.Apply(x, KvRole::kQuery);
  EXPECT_TRUE(k.equal(BfpFakeQuantizeLastDim(x, kernels::BfpFormat::Bfp12(4))));
  EXPECT_TRUE(qq.equal(BfpFakeQuantizeLastDim(x, kernels::BfpFormat::Bfp16(4))));
  EXPECT_FALSE(k.equal(x));
  EXPECT_LT((qq - x).abs().max().item<double>(), (k - x).abs().max().item<double>());
  EXPECT_TRUE(q.Apply(x, KvRole::kValue).equal(x));
  // Causal: a token's result does not depend on the other tokens.
  EXPECT_TRUE(q.Apply(x.narrow(2, 2, 1), KvRole::kKey).equal(k.narrow(2, 2, 1)));
}

TEST(MakeBfpKvQuantizer, FromSpec) {
  LlamaConfig c;
  c.head_dim = 8;
  KvCacheSpec s;
  s.format = "bfp";
  s.bits = 4;
  s.group = 0;
  s.key_point = "post_rope";  // keys in the hook, after RoPE
  auto q = MakeBfpKvQuantizer(s, c, 0);
  ASSERT_TRUE(q.ok()) << q.status();
  auto* bfp = dynamic_cast<const BfpKvQuantizer*>(q->get());
  ASSERT_NE(bfp, nullptr);
  ASSERT_TRUE(bfp->key_format().has_value());
  EXPECT_EQ(bfp->key_format()->block_size, 8);
  EXPECT_EQ(bfp->key_format()->mantissa_bits, 4);
  ASSERT_TRUE(bfp->query_format().has_value());
  EXPECT_EQ(bfp->query_format()->mantissa_bits, 8);
  // Pre-RoPE keys (the default): the hook quantizes queries only; k_proj carries the keys.
  s.key_point = "pre_rope";
  q = MakeBfpKvQuantizer(s, c, 0);
  ASSERT_TRUE(q.ok()) << q.status();
  bfp = dynamic_cast<const BfpKvQuantizer*>(q->get());
  ASSERT_NE(bfp, nullptr);
  EXPECT_FALSE(bfp->key_format().has_value());
  ASSERT_TRUE(bfp->query_format().has_value());
  s.key_point = "post_rope";
  s.group = 16;
  EXPECT_FALSE(MakeBfpKvQuantizer(s, c, 3).ok());
  s.group = 4;
  s.bits = 9;
  EXPECT_FALSE(MakeBfpKvQuantizer(s, c, 3).ok());
}

// Pre-RoPE key cache: k_proj's output quantized per KV head, blocks inside a head.
TEST(BfpKeyProjection, QuantizesEachHeadOfTheOutput) {
  at::manual_seed(testing::TestSeed());
  at::Tensor w = at::randn({12, 5});  // 2 KV heads of 6
  BfpKeyProjection p(std::make_unique<model::DenseLinear>(w), 6, kernels::BfpFormat::Bfp12(4));
  at::Tensor x = at::randn({2, 3, 5});
  at::Tensor y = at::matmul(x, w.t());
  at::Tensor want =
      BfpFakeQuantizeLastDim(y.view({2, 3, 2, 6}), kernels::BfpFormat::Bfp12(4)).view({2, 3, 12});
  EXPECT_TRUE(p.Forward(x).equal(want));
  EXPECT_FALSE(p.Forward(x).equal(y));
  EXPECT_TRUE(p.DenseWeight().equal(w));
}

TEST(InstallBfpKeyCache, WrapsKProjAndSetsQueryHook) {
  model::SetComputeThreads(1);
  auto m = LoadModelOrDie(RealModelDir("stories260K"));
  BfpKeyCacheOptions o;
  o.block = 16;  // > head_dim 8
  EXPECT_FALSE(InstallBfpKeyCache(*m, o).ok());
  o.block = 4;
  auto d = InstallBfpKeyCache(*m, o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE(d->find("before RoPE"), std::string::npos) << *d;
  for (int64_t l = 0; l < m->num_blocks(); ++l) {
    EXPECT_NE(
        dynamic_cast<const BfpKeyProjection*>(&m->block(l).weights().linear(model::LinearKind::kK)),
        nullptr);
    ASSERT_NE(m->block(l).hooks().kv_cache, nullptr);
  }
  EXPECT_FALSE(InstallBfpKeyCache(*m, o).ok());  // twice
  // K-sort needs the dense k_proj: refused (FailedPrecondition) after installation.
  auto ks = ApplyKSort(*m);
  ASSERT_FALSE(ks.ok());
  EXPECT_EQ(ks.status().code(), absl::StatusCode::kFailedPrecondition);
}

// --- the permutation -------------------------------------------------------------------------

TEST(KSortPermutation, PairsStayAdjacentInDescendingPairNorm) {
  // 2 KV heads, head_dim 8: row norms chosen so the order is known.
  const double norms[2][8] = {{1, 5, 2, 0.5, 1, 0.1, 2, 9}, {3, 3, 3, 3, 1, 1, 1, 1}};
  at::Tensor w = at::zeros({16, 4});
  for (int g = 0; g < 2; ++g)
    for (int c = 0; c < 8; ++c) w[g * 8 + c][c % 4] = norms[g][c];
  auto p = KSortPermutation(w, 2, 8, KSortOrder::kPairs);
  ASSERT_TRUE(p.ok()) << p.status();
  // Head 0 pair norms: (0,4) √2, (1,5) ~5.001, (2,6) √8, (3,7) ~9.01 → 3, 1, 2, 0.
  const std::vector<int64_t> want0 = {3, 7, 1, 5, 2, 6, 0, 4};
  // Head 1: all pairs equal → stable: 0, 1, 2, 3.
  const std::vector<int64_t> want1 = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ((*p)[0][j].item<int64_t>(), want0[j]) << j;
    EXPECT_EQ((*p)[1][j].item<int64_t>(), want1[j]) << j;
  }
  auto c = KSortPermutation(w, 2, 8, KSortOrder::kChannels);
  ASSERT_TRUE(c.ok());
  const std::vector<int64_t> wantc = {7, 1, 2, 6, 0, 4, 3, 5};  // Algorithm 1: argsort(N), desc
  for (int j = 0; j < 8; ++j) EXPECT_EQ((*c)[0][j].item<int64_t>(), wantc[j]) << j;
  EXPECT_FALSE(KSortPermutation(w, 3, 8, KSortOrder::kPairs).ok());
  EXPECT_FALSE(KSortPermutation(at::zeros({14, 4}), 2, 7, KSortOrder::kPairs).ok());
}

// --- K-sort on the real models: the float function is unchanged -------------------------------

class KSortRealModel : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { model::SetComputeThreads(1); }
};

TEST_P(KSortRealModel, FloatLogitsUnchanged) {
  const std::string dir = RealModelDir(GetParam());
  auto base = LoadModelOrDie(dir);
  ASSERT_NE(base, nullptr);
  const std::vector<int32_t> tokens = testing::StoryTokens(dir, 200);
  const at::Tensor ids = testing::WithBos(tokens, 128);
  const at::Tensor want = base->Forward(ids);
  for (KSortOrder order : {KSortOrder::kPairs, KSortOrder::kChannels}) {
    auto m = LoadModelOrDie(dir);
    auto perms = ApplyKSort(*m, {order, /*sort_values=*/true});
    ASSERT_TRUE(perms.ok()) << perms.status();
    // The test must permute something: some head's order differs from the identity.
    bool moved = false;
    for (const at::Tensor& p : *perms) {
      moved |= !p.equal(at::arange(p.size(1), at::kLong).expand_as(p));
    }
    EXPECT_TRUE(moved);
    const double diff = RelMaxDiff(want, m->Forward(ids));
    std::printf("[ ksort    ] %s order %s: logits max rel diff %.2e\n", GetParam().c_str(),
                order == KSortOrder::kPairs ? "pairs" : "channels", diff);
    EXPECT_LE(diff, 1e-5);
    // Applied again on top (composes through rope_perm): still the same function.
    ASSERT_TRUE(ApplyKSort(*m, {KSortOrder::kChannels, true}).ok());
    EXPECT_LE(RelMaxDiff(want, m->Forward(ids)), 1e-5);
    // Without the RoPE step of Algorithm 1 (frequencies left in place) the model changes:
    // the permutation is not trivially harmless.
    for (int64_t l = 0; l < m->num_blocks(); ++l)
      m->mutable_block(l).mutable_weights().rope_perm = at::Tensor();
    EXPECT_GT(RelMaxDiff(want, m->Forward(ids)), 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, KSortRealModel, ::testing::Values("stories260K", "aidreams260K"));

// --- BFP12 keys with vs without K-sort --------------------------------------------------------
//
// The paper's setting: keys cached before RoPE in BFP12, queries in BFP16, values float, blocks
// of `block` channels; K-sort = Algorithm 1 (argsort of W_k row norms). Damage is measured as
// the mean KL(float ‖ quantized) of the next-token distributions: aidreams260K is far out of
// domain on TinyStories (perplexity 231), where key noise can even lower perplexity, so
// perplexity would not rank the two.

struct BfpKl {
  double without, with;
};

BfpKl MeasureBfpKl(const std::string& dir, int block, const std::vector<int32_t>& tokens,
                   int64_t ctx) {
  auto reference = LoadModelOrDie(dir);
  auto plain = LoadModelOrDie(dir);
  auto sorted = LoadModelOrDie(dir);
  EXPECT_TRUE(ApplyKSort(*sorted).ok());
  BfpKeyCacheOptions o;
  o.block = block;
  EXPECT_TRUE(InstallBfpKeyCache(*plain, o).ok());
  EXPECT_TRUE(InstallBfpKeyCache(*sorted, o).ok());
  eval::PerplexityOptions po;
  po.ctx = ctx;
  po.bos_per_window = true;
  auto a = CompareToReference(*reference, *plain, tokens, po);
  auto b = CompareToReference(*reference, *sorted, tokens, po);
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a.ok() || !b.ok()) return {0, 0};
  EXPECT_GT(a->mean_kl, 0.0);  // BFP12 keys do change the model
  return {a->mean_kl, b->mean_kl};
}

class BfpKeysRealModel : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { model::SetComputeThreads(1); }
};

// The real models have mild key outliers: K-sort must not lose at any block size below
// head_dim, and changes nothing at block = head_dim (the same channels share the exponent).
TEST_P(BfpKeysRealModel, KSortNoWorseBelowHeadDim) {
  const std::string dir = RealModelDir(GetParam());
  auto config = LoadLlamaConfig(dir);
  ASSERT_TRUE(config.ok());
  const int64_t ctx = std::min<int64_t>(256, config->max_position_embeddings);
  const std::vector<int32_t> tokens = testing::StoryTokens(dir, 3000);
  for (int block = 2; block <= config->head_dim; block *= 2) {
    BfpKl r = MeasureBfpKl(dir, block, tokens, ctx);
    std::printf("[ bfp      ] %s block %2d: KL to float, BFP12 keys %.4f, with K-sort %.4f\n",
                GetParam().c_str(), block, r.without, r.with);
    if (block < config->head_dim) {
      EXPECT_LE(r.with, r.without) << "block " << block;
    } else {
      EXPECT_NEAR(r.with, r.without, 1e-3 * r.without);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BfpKeysRealModel,
                         ::testing::Values("stories260K", "aidreams260K"));

// Outlier-planted variants (W_k RoPE pairs ×50, W_q ÷50), the case K-sort is for. With two
// planted pairs per KV head (4 outlier channels) K-sort keeps them in one block and wins by a
// clear margin at every block size below head_dim. With the default single pair (2 channels),
// the sorted outlier block also holds the next-largest — most informative — channels, so the
// win is clear only where the block is as small as the outlier set (block 2).
TEST(BfpKeysPlantedModel, KSortWinsByClearMargin) {
  model::SetComputeThreads(1);
  for (const std::string name : {"stories260K", "aidreams260K"}) {
    for (int64_t pairs : {1, 2}) {
      const std::string dir = testing::MakeTempDir("planted") + "/" + name;
      PlantOutliersOptions o;  // α = β = 50
      o.k_pairs = pairs;
      ASSERT_TRUE(PlantOutliers(RealModelDir(name), dir, o).ok());
      auto config = LoadLlamaConfig(dir);
      ASSERT_TRUE(config.ok());
      const int64_t ctx = std::min<int64_t>(256, config->max_position_embeddings);
      const std::vector<int32_t> tokens = testing::StoryTokens(dir, 2000);
      for (int block = 2; block < config->head_dim; block *= 2) {
        if (pairs == 1 && block > 2) continue;
        BfpKl r = MeasureBfpKl(dir, block, tokens, ctx);
        std::printf(
            "[ bfp      ] %s planted (%lld K pair/head) block %d: KL to float, BFP12 keys "
            "%.4f, with K-sort %.4f\n",
            name.c_str(), (long long)pairs, block, r.without, r.with);
        EXPECT_LT(r.with, 0.7 * r.without) << name << " pairs " << pairs << " block " << block;
      }
    }
  }
}

// --- a synthetic head_dim-128 attention layer ------------------------------------------------

// One decoder block (hidden 256, 2 heads of 128, MLP zero so block(x) - x is the attention
// output) with random weights and 4 planted outlier RoPE pairs per head (W_k ×50, W_q ÷50).
struct SyntheticLayer {
  LlamaConfig config;
  std::unique_ptr<model::DecoderBlock> block;
};

SyntheticLayer MakeSyntheticLayer(uint64_t seed, int64_t k_pairs = 4) {
  SyntheticLayer s;
  LlamaConfig& c = s.config;
  c.hidden_size = 256;
  c.intermediate_size = 8;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 256;
  at::manual_seed(seed);
  const double w_scale = 1.0 / std::sqrt(256.0);
  at::Tensor q = at::randn({256, 256}) * w_scale;
  at::Tensor k = at::randn({256, 256}) * w_scale;
  at::Tensor v = at::randn({256, 256}) * w_scale;
  at::Tensor o = at::randn({256, 256}) * w_scale;
  at::Tensor up = at::zeros({8, 256}), down = at::zeros({256, 8});
  PlantOutliersOptions opt;
  opt.beta = 50;
  opt.k_pairs = k_pairs;
  opt.down_channels = 0;
  opt.v_channels = 0;
  opt.seed = seed;
  auto plan = PlanOutliers(c, opt);
  EXPECT_TRUE(plan.ok());
  EXPECT_TRUE(PlantOutliersInLayer(c, (*plan)[0], opt, q, k, v, o, up, down).ok());
  model::BlockWeights w;
  w.input_norm = at::ones({256});
  w.post_norm = at::ones({256});
  at::Tensor mats[7] = {q, k, v, o, at::zeros({8, 256}), up, down};
  for (int i = 0; i < 7; ++i) w.linears[i] = std::make_unique<model::DenseLinear>(mats[i]);
  s.block = std::make_unique<model::DecoderBlock>(c, std::move(w));
  return s;
}

// Attention-output error of the layer with BFP12 pre-RoPE keys and BFP16 queries, blocks of bs.
double AttentionError(SyntheticLayer& layer, const at::Tensor& x, const model::Rope& rope,
                      const at::Tensor& reference, int bs) {
  model::BlockWeights& w = layer.block->mutable_weights();
  constexpr int kK = static_cast<int>(model::LinearKind::kK);
  w.linears[kK] = std::make_unique<BfpKeyProjection>(std::move(w.linears[kK]), 128,
                                                     kernels::BfpFormat::Bfp12(bs));
  model::BlockHooks h;
  h.kv_cache = std::make_shared<BfpKvQuantizer>(std::nullopt, kernels::BfpFormat::Bfp16(bs));
  layer.block->set_hooks(h);
  at::Tensor out = layer.block->Forward(x, rope) - x;
  layer.block->set_hooks({});
  w.linears[kK] =
      std::make_unique<model::DenseLinear>(w.linear(model::LinearKind::kK).DenseWeight());
  return ((out - reference).norm() / reference.norm()).item<double>();
}

TEST(BfpKeysSynthetic, HeadDim128KSortWinsByClearMarginBelowHeadDim) {
  const uint64_t seed = testing::TestSeed();
  SyntheticLayer s = MakeSyntheticLayer(seed);
  model::Rope rope(128, 10000.0, 256);
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({1, 256, 256});
  const at::Tensor reference = s.block->Forward(x, rope) - x;
  // A K-sorted twin of the same layer (Algorithm 1; the same function).
  SyntheticLayer t = MakeSyntheticLayer(seed);
  auto kp = KSortPermutation(t.block->weights().linear(model::LinearKind::kK).DenseWeight(), 2, 128,
                             KSortOrder::kChannels);
  ASSERT_TRUE(kp.ok());
  ASSERT_TRUE(PermuteBlockHeads(t.config, t.block->mutable_weights(), *kp, at::Tensor()).ok());
  EXPECT_LE(RelMaxDiff(reference, t.block->Forward(x, rope) - x), 1e-5);
  SyntheticLayer clean = MakeSyntheticLayer(seed, /*k_pairs=*/0);  // no outliers: BFP12's floor
  const at::Tensor clean_reference = clean.block->Forward(x, rope) - x;
  for (int bs : {16, 32, 64, 128}) {
    const double floor = AttentionError(clean, x, rope, clean_reference, bs);
    const double without = AttentionError(s, x, rope, reference, bs);
    const double with = AttentionError(t, x, rope, reference, bs);
    std::printf(
        "[ synth128 ] block %3d: attention-output rel error BFP12 keys %.4f, with K-sort "
        "%.4f (%.1fx); no outliers %.4f\n",
        bs, without, with, without / with, floor);
    if (bs < 128) {
      // Over 150 fresh seeds the ratio was min / median / max 1.79 / 2.26 / 2.78 (block 16),
      // 1.28 / 1.72 / 1.91 (32), 1.21 / 1.30 / 1.39 (64): with K-sort the sorted outlier block
      // still crushes its bs - 8 normal channels, so the gain shrinks as the block grows. The
      // bounds sit below each minimum (the former 1.8 / 1.4 failed about one seed in 50).
      const double min_ratio = bs == 16 ? 1.5 : bs == 32 ? 1.15 : 1.1;
      EXPECT_GT(without, min_ratio * with) << "block " << bs;
      EXPECT_GT(with, floor);
    } else {  // one block per head: the same values, only summed in another order
      EXPECT_NEAR(with, without, 1e-3 * without);
    }
  }
}

}  // namespace
}  // namespace qcal::qsim
