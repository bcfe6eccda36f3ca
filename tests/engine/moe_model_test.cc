// Mixture-of-experts Llama-family models (issue 53, deliverable 1): Mixtral and Llama 4 text (as
// Llama4ForCausalLM and inside a Llama4ForConditionalGeneration checkpoint) read and run by qcal
// agree with the independent numpy reference tests/reference/moe_reference.py (Hugging Face's
// formulas, float64; itself checked against the dense reference by reference_moe_reference_test).
//
// The models are upcycled by the reference from a random dense Llama with GQA (4 heads, 2 KV
// heads, 4 layers): experts are perturbed copies of each block's MLP (5% relative noise), so the
// routing decides the logits. The Llama 4 models cover every variant at once: MoE on every 2nd
// layer (the dense layers' MLP of intermediate_size_mlp, wider than the experts), NoPE on every
// 2nd layer with attention temperature tuning (floor_scale 4, so positions matter within 24
// tokens), L2 qk-norm, 8-token attention chunks, half the MLP in the shared expert and half routed
// through sigmoid-scaled inputs. Each comparison can fail: qcal's logits are also compared with
// the dense model's, from which they differ by more than 1e-2.
//
// Two cases are stored as Hugging Face stores these models: bfloat16 in three shards with an
// index (the reference reads the same bfloat16 values).
//
// Also: the streamed path (ModelSource: embedding rows, one block at a time, the head) gives the
// whole model's logits bit for bit; a batch of two sequences gives each sequence's logits alone
// (to float rounding, as for dense blocks); tokens per expert
// add up to tokens × top-k. (Quantizing them: runner_moe_quantize_test.) Needs /usr/bin/python3
// with numpy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hf_config.h"
#include "common/safetensors.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "tests/model_fixtures.h"
#include "tools/expert_load.h"
#include "tools/model_dir.h"
#include "tests/engine/moe_fixtures.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

using testing::MakeTempDir;
using testing::RelMaxDiff;

using testing::MoeDenseDir;
using testing::ReferencePython;
using testing::Shell;
using testing::UpcycleMoe;
constexpr int64_t kVocab = testing::kMoeVocab;
constexpr int64_t kSeq = 24;

// The Llama 4 variants of the class comment.
constexpr char kLlama4Args[] =
    " --shared-scale 0.5 --moe-step 2 --mlp-pad 8 --nope-interval 2 --qk-norm"
    " --temperature-tuning --floor-scale 4 --chunk 8";

std::vector<int64_t> Tokens(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(kSeq);
  for (auto& t : ids) t = static_cast<int64_t>(rng() % kVocab);
  return ids;
}

at::Tensor ReferenceLogits(const std::string& dir, const std::string& script) {
  const std::string out = dir + "/reference_logits.f32";
  Shell(absl::StrCat(ReferencePython(), script, " logits --model ", dir, " --tokens ",
                     absl::StrJoin(Tokens(1), ","), " --out ", out));
  std::ifstream in(out, std::ios::binary);
  std::vector<float> v(kSeq * kVocab);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(v.size() * 4)) << out;
  return at::from_blob(v.data(), {kSeq, kVocab}, at::kFloat).clone();
}

at::Tensor Ids(const std::vector<int64_t>& ids) {
  return at::from_blob(const_cast<int64_t*>(ids.data()), {1, static_cast<int64_t>(ids.size())},
                       at::kLong)
      .clone();
}

struct Case {
  std::string name;
  std::string args;
  std::string architecture;
  bool bf16_shards = false;  // stored as Hugging Face does: bfloat16, sharded with an index
};

class MoeModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeModelTest, MatchesTheReference) {
  const Case& c = GetParam();
  std::string dir = UpcycleMoe(c.name, c.args);
  if (c.bf16_shards) {
    const std::string bf16 = MakeTempDir("moe-bf16-" + c.name);
    Shell(absl::StrCat(ReferencePython(), "moe_reference.py bf16-shards --model ", dir,
                       " --out ", bf16, " --shards 3"));
    dir = bf16;
  }
  auto model = model::LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const LlamaConfig& config = (*model)->config();
  EXPECT_EQ(config.architecture, c.architecture);
  EXPECT_TRUE(config.is_moe());

  const at::Tensor logits = (*model)->Forward(Ids(Tokens(1)))[0];
  const double vs_reference = RelMaxDiff(ReferenceLogits(dir, "moe_reference.py"), logits);
  const double vs_dense = RelMaxDiff(ReferenceLogits(MoeDenseDir(), "llama_reference.py"), logits);
  std::printf("%s: qcal vs reference %.3g; vs the dense model %.3g\n", c.name.c_str(), vs_reference,
              vs_dense);
  EXPECT_LT(vs_reference, 1e-4);
  EXPECT_GT(vs_dense, 1e-2);

  // The streamed path: embedding rows, one block at a time, the head.
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  auto h = (*source)->Embed(Ids(Tokens(1)));
  ASSERT_TRUE(h.ok()) << h.status();
  at::Tensor x = *h;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    auto block = (*source)->LoadBlock(l);
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ((*block)->is_moe(), config.IsMoeLayer(l)) << "layer " << l;
    x = (*block)->Forward(x, (*source)->rope());
  }
  auto streamed = (*source)->Logits(x);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_TRUE(at::equal((*streamed)[0], logits)) << "streamed vs whole-model logits";

  // A batch of two sequences: each row's logits are those of its sequence alone (to float
  // rounding: a GEMM's bits depend on its row count on the CPU, for dense blocks too; the
  // routing of one sequence never moves another's tokens to other experts).
  const std::vector<int64_t> a = Tokens(1), b = Tokens(2);
  std::vector<int64_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  const at::Tensor batch = (*model)->Forward(
      at::from_blob(both.data(), {2, kSeq}, at::kLong).clone());
  EXPECT_LT(RelMaxDiff(logits, batch[0]), 1e-5);
  EXPECT_LT(RelMaxDiff((*model)->Forward(Ids(b))[0], batch[1]), 1e-5);

  // Routing: top-k experts per token, each chosen once, weights in (0, 1]; the experts' token
  // counts add up to tokens × k.
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    const model::DecoderBlock& block = (*model)->block(l);
    if (!block.is_moe()) continue;
    const at::Tensor hn = at::randn({kSeq, config.hidden_size});
    const model::Routing r = block.Route(hn);
    ASSERT_EQ(r.experts.sizes().vec(), (std::vector<int64_t>{kSeq, config.experts_per_token}));
    EXPECT_TRUE(r.weights.gt(0).all().item<bool>());
    EXPECT_TRUE(r.weights.le(1).all().item<bool>());
    const at::Tensor counts = at::bincount(r.experts.reshape(-1), {}, config.num_experts);
    EXPECT_EQ(counts.sum().item<int64_t>(), kSeq * config.experts_per_token);
    if (config.experts_per_token > 1) {  // distinct experts per token
      EXPECT_TRUE(r.experts.select(1, 0).ne(r.experts.select(1, 1)).all().item<bool>());
    }
    int64_t seen = 0;
    block.RoutedExperts(hn, r, [&](int64_t e, const at::Tensor& rows, const at::Tensor& in) {
      EXPECT_EQ(rows.size(0), counts[e].item<int64_t>()) << "expert " << e;
      EXPECT_EQ(in.sizes().vec(), (std::vector<int64_t>{rows.size(0), config.hidden_size}));
      seen += rows.size(0);
    });
    EXPECT_EQ(seen, kSeq * config.experts_per_token);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MoeModelTest,
    ::testing::Values(
        Case{"mixtral_top2", "--layout mixtral --top-k 2", "MixtralForCausalLM"},
        Case{"mixtral_top1", "--layout mixtral --top-k 1", "MixtralForCausalLM"},
        Case{"llama4_plain", "--layout llama4 --top-k 1 --shared-scale 0.5", "Llama4ForCausalLM"},
        Case{"llama4_variants", std::string("--layout llama4 --top-k 2") + kLlama4Args,
             "Llama4ForCausalLM"},
        Case{"llama4_multimodal", std::string("--layout llama4-mm --top-k 1") + kLlama4Args,
             "Llama4ForConditionalGeneration"},
        Case{"llama4_multimodal_bf16", std::string("--layout llama4-mm --top-k 2") + kLlama4Args,
             "Llama4ForConditionalGeneration", /*bf16_shards=*/true},
        Case{"mixtral_bf16", "--layout mixtral --top-k 2", "MixtralForCausalLM",
             /*bf16_shards=*/true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// llama3 rope_scaling with equal high and low frequency factors (1.0, 1.0)
// leaves no band to interpolate in: long wavelengths divided by the factor, short ones kept, no
// division by zero.
TEST(MoeModel, Llama3RopeScalingWithEqualFactors) {
  RopeScaling scaling;
  scaling.type = RopeScaling::Type::kLlama3;
  scaling.factor = 16;
  scaling.low_freq_factor = scaling.high_freq_factor = 1;
  scaling.original_max_position_embeddings = 8192;
  const model::Rope scaled(128, 5e5, 64, scaling, /*interleaved=*/true);
  const model::Rope plain(128, 5e5, 64, RopeScaling(), /*interleaved=*/true);
  EXPECT_TRUE(at::isfinite(scaled.cos_table()).all().item<bool>());
  // Position 1's angle is the inverse frequency: channel pair 0 (wavelength 2π) is kept, the
  // last pair (wavelength far above 8192) is divided by 16.
  const at::Tensor a = at::acos(scaled.cos_table()[1]), b = at::acos(plain.cos_table()[1]);
  EXPECT_FLOAT_EQ(a[0].item<float>(), b[0].item<float>());
  EXPECT_NEAR(a[127].item<float>() * 16, b[127].item<float>(), 1e-3 * b[127].item<float>());
  EXPECT_EQ(a[126].item<float>(), a[127].item<float>());  // interleaved: pairs share a frequency
}

// The multimodal layout: the text model's tensors under language_model., the vision tower and
// projector beside them, which the text model never reads.
TEST(MoeModel, MultimodalCheckpointKeepsTheVisionTensorsApart) {
  const std::string dir =
      UpcycleMoe("mm", std::string("--layout llama4-mm --top-k 1") + kLlama4Args);
  auto ckpt = CheckpointReader::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->Has("vision_model.patch_embedding.linear.weight"));
  EXPECT_TRUE((*ckpt)->Has("multi_modal_projector.linear_1.weight"));
  EXPECT_TRUE((*ckpt)->Has("language_model.model.layers.1.feed_forward.experts.gate_up_proj"));
  auto config = LoadLlamaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tensor_prefix, "language_model.");
  EXPECT_EQ(config->family, ModelFamily::kLlama4);
  EXPECT_EQ(config->intermediate_size_mlp, config->intermediate_size + 8);
  EXPECT_EQ(model::LinearTensorName(*config, 0, model::LinearKind::kGate),
            "language_model.model.layers.0.feed_forward.gate_proj");
  EXPECT_EQ(model::LinearTensorName(*config, 1, model::LinearKind::kDown),
            "language_model.model.layers.1.feed_forward.shared_expert.down_proj");
  EXPECT_EQ(model::LinearTensorName(*config, 1, model::LinearKind::kQ),
            "language_model.model.layers.1.self_attn.q_proj");
}

// Tokens per expert under the model's own routing (qcal tool expert-load): every MoE layer
// counted, each token routed top-k times, the counts equal to those of Route on the same
// activations; dense models refused; the model's hooks restored.
TEST(MoeModel, ExpertLoadCountsEveryRoutedToken) {
  const std::string dir =
      UpcycleMoe("load", std::string("--layout llama4 --top-k 2") + kLlama4Args);
  auto model = model::LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<int32_t>> windows;
  for (uint64_t seed : {1, 2, 3}) {
    const std::vector<int64_t> t = Tokens(seed);
    windows.emplace_back(t.begin(), t.end());
  }
  auto load = tools::MeasureExpertLoad(**model, windows);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->tokens, 3 * kSeq);
  ASSERT_EQ(load->layers.size(), 2u);  // MoE on every 2nd layer: 1 and 3
  EXPECT_EQ(load->layers[0].layer, 1);
  EXPECT_EQ(load->layers[1].layer, 3);
  for (const auto& l : load->layers) {
    int64_t sum = 0;
    for (int64_t n : l.counts) sum += n;
    EXPECT_EQ(sum, 3 * kSeq * 2) << "layer " << l.layer;
    const std::vector<int64_t> below = l.BelowRank(load->inputs);
    for (int64_t e = 0; e < static_cast<int64_t>(l.counts.size()); ++e) {
      EXPECT_EQ(std::count(below.begin(), below.end(), e), l.counts[e] < 64 ? 1 : 0);
    }
    EXPECT_EQ(l.min(), *std::min_element(l.counts.begin(), l.counts.end()));
  }
  for (int64_t l = 0; l < (*model)->num_blocks(); ++l) {
    EXPECT_FALSE((*model)->block(l).hooks().on_routing) << "hooks restored, layer " << l;
  }
  auto dense = model::LlamaModel::Load(MoeDenseDir());
  ASSERT_TRUE(dense.ok());
  EXPECT_FALSE(tools::MeasureExpertLoad(**dense, windows).ok());
}

// One expert's slab of a stacked tensor: converted from bf16, the slab asked for; a shape that is
// not the config's names the tensor, its shape and the expected one.
TEST(MoeModel, LoadSlabReadsOneExpert) {
  const std::string dir = MakeTempDir("moe-slab");
  std::vector<uint16_t> bf16(2 * 3 * 4);
  for (size_t i = 0; i < bf16.size(); ++i) {  // bf16 of the float i: its upper 16 bits
    const float f = static_cast<float>(i);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bf16[i] = static_cast<uint16_t>(u >> 16);
  }
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("experts.down_proj", DType::kBF16, {2, 3, 4}, bf16.data(),
                         bf16.size() * 2).ok());
  ASSERT_TRUE(writer.Write(dir + "/model.safetensors").ok());
  auto ckpt = CheckpointReader::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto slab = model::LoadSlabF32(**ckpt, "experts.down_proj", {2, 3, 4}, 1);
  ASSERT_TRUE(slab.ok()) << slab.status();
  EXPECT_TRUE(at::equal(*slab, at::arange(12, 24, at::kFloat).view({3, 4})));
  auto wrong = model::LoadSlabF32(**ckpt, "experts.down_proj", {3, 3, 4}, 0);
  ASSERT_FALSE(wrong.ok());
  for (const char* part : {"model.safetensors", "'experts.down_proj'", "BF16 [2, 3, 4]",
                           "expected a floating [3, 3, 4]"}) {
    EXPECT_NE(wrong.status().message().find(part), std::string::npos) << wrong.status();
  }
}

// The dense-only tools refuse a MoE model by its config, naming the tool and the architecture.
TEST(MoeModel, DenseOnlyToolsRefuseIt) {
  const std::string dir = UpcycleMoe("tools", "--layout mixtral --top-k 2");
  auto config = LoadLlamaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const Status s = tools::CheckDerivedModelDirs("plant-outliers", dir, *config, dir + "-out");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("MixtralForCausalLM is a mixture-of-experts model; plant-outliers "
                             "works on dense Llama models"),
            std::string::npos)
      << s;
  auto dense = LoadLlamaConfig(MoeDenseDir());
  ASSERT_TRUE(dense.ok());
  EXPECT_TRUE(tools::DenseOnly("kv-eval", MoeDenseDir(), *dense).ok());
}

}  // namespace
}  // namespace qcal
