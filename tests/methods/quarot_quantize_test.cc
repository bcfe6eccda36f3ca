// QuaRot end to end on stories260K, every model quantized by a job (runner/quantize_job.h, the
// runner `qcal quantize` and the service share) with the bundled recipes: the orderings that hold
// on it (rotation helps 4-bit activations a lot on the outlier-planted model and does not hurt
// them on the plain one; GPTQ <= RTN at 4-bit weights), the checkpoint's layout (packed int4
// codes, static ranges, the rotated head) and the block round trip through the method's parts
// (a quantized block written and read back computes bit for bit what the block task computed),
// sequential calibration on the quantized blocks' outputs, resuming a lost shard; the full
// W4A4KV4 rotated vs unrotated on planted aidreams260K.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/job_plan.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "methods/quarot/checkpoint.h"
#include "methods/quarot/quarot_model.h"
#include "methods/quarot/quarot_spec.h"
#include "methods/rotated_block.h"
#include "methods/registry.h"
#include "methods/method_factory.h"
#include "tests/model_fixtures.h"
#include "engine/calib/calibration.h"
#include "engine/calib/hessian.h"
#include "engine/eval/perplexity.h"
#include "runner/job_steps.h"
#include "runner/quantize_job.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/bfp_kv.h"
#include "engine/qsim/ksort.h"
#include "engine/quant/scalar_linear.h"
#include "tools/model_compare.h"
#include "tools/plant_outliers.h"

namespace qcal {
namespace {

namespace quarot = methods::quarot;
using quarot::QuarotConfig;

// The recipe with its QuaRot settings edited by `edit`.
template <typename Fn>
Recipe EditQuarot(Recipe r, Fn edit) {
  auto c = std::make_shared<QuarotConfig>(r.method_config<QuarotConfig>());
  edit(*c);
  r.config = std::move(c);
  return r;
}

bool IsQuarotCheckpoint(const std::string& dir) {
  auto config = LoadLlamaConfig(dir);
  if (!config.ok()) return false;
  auto recipe = methods::CheckpointRecipe(*config, dir);
  return recipe.ok() && recipe->method == "quarot";
}

class QuarotQuantizeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    root_ = new std::string(testing::MakeTempDir("quarot_q"));
    float_dir_ = new std::string(testing::RealModelDir("stories260K"));
    tools::PlantOutliersOptions plant;  // α = β = 50
    auto planted = tools::PlantOutliers(*float_dir_, *root_ + "/planted", plant);
    ASSERT_TRUE(planted.ok()) << planted.status();
    auto tok = LoadTokenizerFromModelDir(*float_dir_);
    ASSERT_TRUE(tok.ok());
    auto text = ReadTextFile(testing::SharedDir() +
                             "/data/tinystories/TinyStories-valid.sample30k.txt");
    ASSERT_TRUE(text.ok());
    eval_tokens_ = new std::vector<int32_t>((*tok)->Encode(*text));
    auto calib = SampleTestCalibration(**tok);
    ASSERT_TRUE(calib.ok()) << calib.status();
    calib_ = new at::Tensor(*calib);
  }
  static void TearDownTestSuite() {
    delete root_;
    delete float_dir_;
    delete eval_tokens_;
    delete calib_;
  }

  static std::string* root_;
  static std::string* float_dir_;
  static std::vector<int32_t>* eval_tokens_;
  static at::Tensor* calib_;

 public:
  // The tests' calibration set: 32 sequences of 128 tokens from the recipes' calibration file.
  static StatusOr<at::Tensor> SampleTestCalibration(const Tokenizer& tok) {
    CalibrationSpec spec;
    spec.files = {"data/wikitext2/wiki.valid.tokens"};
    spec.num_sequences = 32;
    spec.seq_len = 128;
    return calib::SampleCalibrationTokens(tok, spec, testing::SharedDir(), 128, tok.bos_id());
  }

  static Recipe LoadJob(const std::string& name) {
    auto r = LoadRecipe(testing::SourceDir() + "/jobs/" + name + ".yaml");
    EXPECT_TRUE(r.ok()) << r.status();
    Recipe recipe = r.ok() ? *r : Recipe();
    // The test's calibration set (SampleTestCalibration; the recipes use 128 sequences).
    recipe.calibration.num_sequences = 32;
    recipe.calibration.seq_len = 128;
    return recipe;
  }

  static double Perplexity(const model::LlamaModel& m) {
    eval::PerplexityOptions opt;
    opt.ctx = 512;
    opt.bos_per_window = true;
    auto r = eval::EvaluatePerplexity(m, *eval_tokens_, opt);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->perplexity : std::nan("");
  }

  // A job quantizing the checkpoint in `model_dir` with the recipe into a fresh directory (the
  // tests' calibration: 32 sequences of 128 tokens, batches of 8, one thread), and the quantized
  // model read back through its method. *seconds (when given): the job's.
  static StatusOr<std::unique_ptr<model::LlamaModel>> QuantizeWithJob(
      const std::string& model_dir, const Recipe& recipe, std::string* out_dir = nullptr,
      double* seconds = nullptr) {
    v1::JobSpec opt;
    opt.set_model_dir(model_dir);
    opt.set_out_dir(testing::MakeTempDir("quarot_job") + "/out");
    opt.set_data_root(testing::SharedDir());
    opt.set_calib_batch(8);
    opt.set_threads_per_worker(1);
    QCAL_ASSIGN_OR_RETURN(job::QuantizeJobResult result, job::RunQuantizeJob(recipe, opt));
    if (out_dir != nullptr) *out_dir = opt.out_dir();
    if (seconds != nullptr) *seconds = result.seconds;
    return methods::LoadModel(opt.out_dir());
  }

  // Quantizes the model in `which` ("float" or "planted") with the recipe, returns perplexity.
  static double QuantizedPerplexity(const std::string& which, const Recipe& recipe) {
    double seconds = 0;
    auto m = QuantizeWithJob(which == "float" ? *float_dir_ : *root_ + "/" + which, recipe,
                             nullptr, &seconds);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return std::nan("");
    const double ppl = Perplexity(**m);
    std::printf("%-8s %-32s ppl %.3f (%.1f s)\n", which.c_str(), recipe.name.c_str(), ppl,
                seconds);
    return ppl;
  }
};

std::string* QuarotQuantizeTest::root_ = nullptr;
std::string* QuarotQuantizeTest::float_dir_ = nullptr;
std::vector<int32_t>* QuarotQuantizeTest::eval_tokens_ = nullptr;
at::Tensor* QuarotQuantizeTest::calib_ = nullptr;

TEST_F(QuarotQuantizeTest, PlantedOutliersKeepTheFloatFunction) {
  auto plain = model::LlamaModel::Load(*float_dir_);
  auto planted = model::LlamaModel::Load(*root_ + "/planted");
  ASSERT_TRUE(plain.ok() && planted.ok());
  const double a = Perplexity(**plain), b = Perplexity(**planted);
  std::printf("float ppl: plain %.4f, planted %.4f\n", a, b);
  EXPECT_NEAR(a, b, 1e-3 * a);
}

// A4: the activation quantization of quarot-w4a4kv4 / w4a4kv4-norot alone (float weights, float
// KV cache). On these models the rotations help activations only: with 4-bit weights or a 4-bit
// cache the rotated recipes lose (docs/results.md has the decomposition: the weights of
// stories260K quantize better unrotated — QuIP#'s incoherence loses to GPTQ on it too —, and
// head_dim 8 is too small for R3 to flatten a key outlier while the planted K outliers are
// compensated in W_q, so R3 only spreads their rounding error onto channels queries use).
Recipe A4(const std::string& name) {
  Recipe r = EditQuarot(QuarotQuantizeTest::LoadJob(name), [](QuarotConfig& q) {
    q.weights = "none";
    q.bits = 16;
    q.kv_cache.bits = 16;
  });
  r.name += "-a4only";
  return r;
}

TEST_F(QuarotQuantizeTest, RotationRescuesA4OnPlantedOutliers) {
  const double rot = QuantizedPerplexity("planted", A4("quarot-w4a4kv4"));
  const double norot = QuantizedPerplexity("planted", A4("w4a4kv4-norot"));
  EXPECT_LT(2.0 * rot, norot) << "rotated " << rot << " vs unrotated " << norot;
}

// The whole W4A4KV4 recipe on outlier-planted aidreams260K, whose 16-wide heads let R2/R3 flatten
// the planted V/K spikes (on stories260K's 8-wide heads they cannot: docs/results.md).
TEST_F(QuarotQuantizeTest, RotationRescuesW4A4KV4OnPlantedAidreams) {
  const std::string plain = testing::RealModelDir("aidreams260K");
  const std::string planted = *root_ + "/aidreams-planted";
  auto made = tools::PlantOutliers(plain, planted, tools::PlantOutliersOptions{});  // α = β = 50
  ASSERT_TRUE(made.ok()) << made.status();
  auto tok = LoadTokenizerFromModelDir(planted);
  ASSERT_TRUE(tok.ok());
  auto text = ReadTextFile(testing::SharedDir() +
                           "/data/tinystories/TinyStories-valid.sample30k.txt");
  ASSERT_TRUE(text.ok());
  std::vector<int32_t> eval_tokens = (*tok)->Encode(*text);
  eval_tokens.resize(std::min<size_t>(eval_tokens.size(), 8192));
  auto ppl = [&](const std::string& name) {
    auto m = QuantizeWithJob(planted, LoadJob(name));
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return std::nan("");
    eval::PerplexityOptions opt;
    opt.ctx = 128;
    opt.bos_per_window = true;
    auto r = eval::EvaluatePerplexity(**m, eval_tokens, opt);
    EXPECT_TRUE(r.ok()) << r.status();
    std::printf("aidreams260K-planted %-16s ppl %.3f\n", name.c_str(),
                r.ok() ? r->perplexity : std::nan(""));
    return r.ok() ? r->perplexity : std::nan("");
  };
  const double rot = ppl("quarot-w4a4kv4");
  const double norot = ppl("w4a4kv4-norot");
  EXPECT_LT(1.3 * rot, norot) << "rotated " << rot << " vs unrotated " << norot;
}

TEST_F(QuarotQuantizeTest, RotationDoesNotHurtA4OnThePlainModel) {
  const double rot = QuantizedPerplexity("float", A4("quarot-w4a4kv4"));
  const double norot = QuantizedPerplexity("float", A4("w4a4kv4-norot"));
  EXPECT_LE(rot, norot);
}

// The whole W4A4KV4 recipe on the plain model. Perplexity cannot rank rotated against unrotated
// here: stories260K's perplexity drops when its largest keys are clipped (docs/results.md), so
// some quantization noise lowers it (measured 28.99 rotated vs 26.57 unrotated on 8k tokens). The
// mean KL from the float model's next-token distributions measures the damage itself.
TEST_F(QuarotQuantizeTest, RotationDoesNotHurtW4A4KV4OnThePlainModelByKl) {
  auto kl = [](const std::string& name) {
    auto ref = model::LlamaModel::Load(*float_dir_);
    auto m = QuantizeWithJob(*float_dir_, LoadJob(name));
    EXPECT_TRUE(ref.ok()) << ref.status();
    EXPECT_TRUE(m.ok()) << m.status();
    if (!ref.ok() || !m.ok()) return std::nan("");
    eval::PerplexityOptions opt;
    opt.ctx = 512;
    opt.bos_per_window = true;
    auto c = tools::CompareToReference(**ref, **m, *eval_tokens_, opt);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return std::nan("");
    std::printf("plain %-16s ppl %.3f, KL to float %.4f nats/token\n", name.c_str(), c->ppl_model,
                c->mean_kl);
    return c->mean_kl;
  };
  const double rot = kl("quarot-w4a4kv4");
  const double norot = kl("w4a4kv4-norot");
  EXPECT_LE(rot, norot) << "KL rotated " << rot << " vs unrotated " << norot;
}

TEST_F(QuarotQuantizeTest, GptqIsNotWorseThanRtnAtFourBitWeights) {
  Recipe gptq = LoadJob("quarot-w4a16");
  Recipe rtn = EditQuarot(gptq, [](QuarotConfig& q) {
    q.weights = "rtn";
    q.scalar.act_order = false;
  });
  rtn.name = "quarot-w4a16-rtn";
  EXPECT_LE(QuantizedPerplexity("float", gptq), QuantizedPerplexity("float", rtn));
  EXPECT_LE(QuantizedPerplexity("float", LoadJob("quarot-w4a4kv4")),
            QuantizedPerplexity("float", LoadJob("quarot-w4a4kv4-rtn")));
}

TEST_F(QuarotQuantizeTest, JobCheckpointStoresThePackedLayout) {
  for (const char* name : {"quarot-w4a4kv4", "quarot-w8a8-wtensor-atensor-static", "quarot-kv4"}) {
    SCOPED_TRACE(name);
    const Recipe recipe = LoadJob(name);
    std::string out;
    auto loaded = QuantizeWithJob(*float_dir_, recipe, &out);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    // Stored tensors: packed int4 codes and F32 per-channel scales, static ranges.
    auto ckpt = CheckpointReader::Open(out);
    ASSERT_TRUE(ckpt.ok());
    const QuarotConfig& q = recipe.method_config<QuarotConfig>();
    const std::string down = "model.layers.0.mlp.down_proj";
    if (q.bits == 4) {
      auto f = (*ckpt)->Find(down + ".codes_int4");
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(f->second->dtype, DType::kU8);
      EXPECT_EQ(f->second->shape, (std::vector<int64_t>{64, 86}));  // 172 inputs, two per byte
      EXPECT_FALSE((*ckpt)->Has(down + ".codes"));
      EXPECT_FALSE((*ckpt)->Has(down + ".qweight"));
    }
    if (q.bits == 8) {
      auto f = (*ckpt)->Find(down + ".codes");
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(f->second->dtype, DType::kI8);
    }
    EXPECT_EQ((*ckpt)->Has(down + ".weight"), !q.quantizes_weights());
    EXPECT_EQ((*ckpt)->Has(std::string("model.layers.0.") + methods::kActRangesKey),
              q.static_activations());
    EXPECT_TRUE((*ckpt)->Has("lm_head.weight"));
    auto config = LoadLlamaConfig(out);
    ASSERT_TRUE(config.ok());
    EXPECT_TRUE(IsQuarotCheckpoint(out));
    EXPECT_FALSE(config->tie_word_embeddings);
  }
}

// Through the method's parts, as a block task and a reader run them: block 0 prepared and
// quantized (on the embedded calibration tokens), with its inference installed, computes bit for
// bit what the same block written (BlockFormat::AppendBlockTensors) and read back (LoadBlock +
// Inference::Install) computes: packed codes, F32 scales, static ranges, online Hadamards and the
// K-sort permutation survive the shard.
TEST_F(QuarotQuantizeTest, AQuantizedBlockReadBackComputesTheSameBits) {
  for (const char* name : {"quarot-w4a4kv4", "quarot-w8a8-wtensor-atensor-static", "quarot-kv4"}) {
    SCOPED_TRACE(name);
    const Recipe recipe = LoadJob(name);
    auto source = model::OpenFloatCheckpoint(*float_dir_);
    ASSERT_TRUE(source.ok()) << source.status();
    const LlamaConfig& config = (*source)->config();
    auto method = methods::MakeMethod(recipe, config);
    ASSERT_TRUE(method.ok()) << method.status();
    auto weights = (*source)->LoadBlockWeights(0);
    ASSERT_TRUE(weights.ok()) << weights.status();
    ASSERT_TRUE((*method)->transform().PrepareBlock(0, &*weights).ok());
    auto embedded = (*source)->Embed(*calib_);
    ASSERT_TRUE(embedded.ok()) << embedded.status();
    auto x = (*method)->transform().PrepareEmbeddingRows(*embedded);
    ASSERT_TRUE(x.ok()) << x.status();
    const at::Tensor h = x->narrow(0, 0, 2).clone();  // the inputs both blocks are run on
    methods::BlockInputs in;
    in.layer = 0;
    in.rope = &(*source)->rope();
    in.batch = 8;
    if ((*method)->needs().sequential) in.x = &*x;
    auto quantized = (*method)->quantizer().QuantizeBlock(std::move(*weights), in);
    ASSERT_TRUE(quantized.ok()) << quantized.status();

    const std::string dir = testing::MakeTempDir("quarot_block");
    SafetensorsWriter writer;
    ASSERT_TRUE((*method)->block_format().AppendBlockTensors(0, quantized->weights, &writer).ok());
    ASSERT_TRUE(writer.Write(dir + "/model.safetensors").ok());
    model::DecoderBlock computed(config, std::move(quantized->weights));
    ASSERT_TRUE((*method)->inference().Install(&computed, 0).ok());

    auto ckpt = CheckpointReader::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    auto back = (*method)->block_format().LoadBlock(**ckpt, 0);
    ASSERT_TRUE(back.ok()) << back.status();
    model::DecoderBlock read_back(config, std::move(*back));
    ASSERT_TRUE((*method)->inference().Install(&read_back, 0).ok());
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(computed.Forward(h, (*source)->rope()),
                          read_back.Forward(h, (*source)->rope())));
  }
}

// Sequential calibration: block 4's GPTQ Hessians come from the outputs of the quantized blocks
// 0..3, so quantizing it with Hessians of the (rotated) float model's activations instead gives
// other codes.
TEST_F(QuarotQuantizeTest, SequentialCalibrationRunsOnTheQuantizedBlocksOutputs) {
  const Recipe recipe = LoadJob("quarot-w4a4kv4");
  std::string out;
  auto quantized = QuantizeWithJob(*float_dir_, recipe, &out);
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  const auto& seq = dynamic_cast<const quant::ScalarQuantLinear&>(
      (*quantized)->block(4).weights().linear(model::LinearKind::kQ).stored());
  auto ref = model::LlamaModel::Load(*float_dir_);
  ASSERT_TRUE(ref.ok());
  auto plan = qsim::PlanRotations(recipe.method_config<QuarotConfig>().rotation, (*ref)->config());
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(quarot::PrepareModel(**ref, recipe, *plan).ok());
  at::Tensor x = (*ref)->Embed(*calib_);
  for (int64_t l = 0; l < 4; ++l) {
    auto y = calib::ForwardCollectingHessians((*ref)->mutable_block(l), x, (*ref)->rope(), 8,
                                              nullptr);
    ASSERT_TRUE(y.ok());
    x = *y;
  }
  auto float_calibrated = quarot::QuantizeRotatedBlock((*ref)->mutable_block(4), (*ref)->rope(),
                                                       recipe, *plan, 4, &x, 8, false, nullptr);
  ASSERT_TRUE(float_calibrated.ok()) << float_calibrated.status();
  const auto& flt = dynamic_cast<const quant::ScalarQuantLinear&>(
      (*ref)->block(4).weights().linear(model::LinearKind::kQ).stored());
  EXPECT_EQ(seq.data().bits, 4);
  EXPECT_NE(seq.data().codes, flt.data().codes);
}

// The job runs QuaRot block by block (the calibration inputs handed from block to block through
// the job directory, shard 0 rotated, config untied); a lost shard is redone, with the blocks
// after it (sequential calibration), bit for bit.
TEST_F(QuarotQuantizeTest, JobRedoesALostShardAndTheBlocksAfterItBitForBit) {
  Recipe recipe = LoadJob("quarot-w4a4kv4");
  recipe.calibration.num_sequences = 16;
  recipe.calibration.seq_len = 128;
  v1::JobSpec opt;
  opt.set_model_dir(*float_dir_);
  opt.set_out_dir(testing::MakeTempDir("quarot_job") + "/out");
  opt.set_data_root(testing::SharedDir());
  opt.set_calib_batch(8);
  opt.set_threads_per_worker(1);
  // Progress inside each block: the Hessians of the rotated block, the GPTQ rounding, then (when
  // a later block needs the outputs) the propagation, counted 1, 2[, 3].
  std::map<std::string, std::vector<std::string>> steps;  // "block l" -> its steps
  auto first = job::RunQuantizeJob(recipe, opt, [&](const job::JobEvent& e) {
    if (e.phase != "block") return;
    const size_t colon = e.message.find(": ");
    std::vector<std::string>& mine = steps[e.message.substr(0, colon)];
    mine.push_back(e.message.substr(colon + 2));
    EXPECT_EQ(e.done, static_cast<int64_t>(mine.size())) << e.message;
    EXPECT_LE(e.done, e.total) << e.message;
  });
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(steps.size(), first->blocks.size());
  for (const auto& [block, names] : steps) {
    ASSERT_GE(names.size(), 2u) << block;
    EXPECT_EQ(names[0], "Hessians of the rotated block") << block;
    EXPECT_EQ(names[1], "GPTQ rounding") << block;
  }
  EXPECT_EQ(steps["block 0"].size(), 3u);  // propagated to block 1
  EXPECT_EQ(first->blocks_resumed, 0);
  EXPECT_NEAR(first->code_bits, 4.0, 1e-9);

  auto from_job = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(from_job.ok()) << from_job.status();
  auto config = LoadLlamaConfig(opt.out_dir());
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(IsQuarotCheckpoint(opt.out_dir()));
  EXPECT_FALSE(config->tie_word_embeddings);
  at::Tensor ids = at::randint(1, 512, {2, 64}, at::kLong);
  ids.select(1, 0).fill_(1);
  const at::Tensor logits = (*from_job)->Forward(ids);
  // Only the last block's inputs are left in the job directory.
  EXPECT_FALSE(std::ifstream(JobPaths(DefaultJobDir(opt.out_dir())).SequentialInputs(2)).good());
  EXPECT_TRUE(std::ifstream(JobPaths(DefaultJobDir(opt.out_dir())).SequentialInputs(4)).good());

  // Lose block 2's shard: blocks 2..4 are redone (their inputs rebuilt from blocks 0 and 1 read
  // back), 0 and 1 resumed, and the model is the same.
  const std::string shard = opt.out_dir() + "/" + ShardName(3, 5);
  auto before = ReadFile(shard);
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(std::remove(shard.c_str()), 0);
  ASSERT_EQ(std::remove((opt.out_dir() + "/config.json").c_str()), 0);
  auto second = job::RunQuantizeJob(recipe, opt);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->blocks_resumed, 2);
  auto after = ReadFile(shard);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*before, *after);
  auto again = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(at::equal((*again)->Forward(ids), logits));

  // The rotated shard 0 is block 0's (its entry's also_wrote checksum): a damaged shard 0 redoes
  // block 0, hence every block, and comes back identical.
  const std::string shard0 = opt.out_dir() + "/" + ShardName(0, 5);
  auto good0 = ReadFile(shard0);
  ASSERT_TRUE(good0.ok());
  std::string bad0 = *good0;
  bad0.back() ^= 1;
  ASSERT_TRUE(WriteFileAtomic(shard0, bad0).ok());
  auto third = job::RunQuantizeJob(recipe, opt);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->blocks_resumed, 0);
  EXPECT_EQ(*ReadFile(shard0), *good0);
}

// Two worker processes' state (two JobContexts, each rotating its own model) taking the blocks
// in turn, as two ranks do under the coordinator when both ask for work: every block's calibration
// inputs come from the other "process" through job_dir/quarot, and the shards are the single
// process's, byte for byte.
TEST_F(QuarotQuantizeTest, BlocksAlternatingBetweenProcessesMatchOneProcess) {
  Recipe recipe = LoadJob("quarot-w4a4kv4");
  recipe.calibration.num_sequences = 16;
  recipe.calibration.seq_len = 128;
  const std::string dir = testing::MakeTempDir("quarot_handoff");
  v1::JobSpec opt;
  opt.set_model_dir(*float_dir_);
  opt.set_out_dir(dir + "/single");
  opt.set_data_root(testing::SharedDir());
  opt.set_calib_batch(8);
  opt.set_threads_per_worker(1);
  ASSERT_TRUE(job::RunQuantizeJob(recipe, opt).ok());

  v1::JobSpec split = opt;
  split.set_out_dir(dir + "/split");
  ASSERT_TRUE(PlanJob(recipe, split.model_dir(), split.out_dir(), split.out_dir() + ".job", split.data_root()).ok());
  auto a = job::OpenJob(recipe, split);
  auto b = job::OpenJob(recipe, split);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  for (int64_t l = 0; l < 5; ++l) {
    job::JobContext* ctx = (l % 2 == 0 ? *a : *b).get();
    auto result = job::QuantizeBlockStep(ctx, l, "block-" + std::to_string(l));
    ASSERT_TRUE(result.ok()) << "block " << l << ": " << result.status();
    ASSERT_TRUE(CommitFiles(split.out_dir(), FilesOf(*result)).ok());
    // Block l handed block l+1's inputs over and dropped its own predecessor's.
    if (l < 4) {
      EXPECT_TRUE(std::ifstream(JobPaths(DefaultJobDir(split.out_dir())).SequentialInputs(l + 1)).good());
    }
    if (l >= 1) {
      EXPECT_FALSE(std::ifstream(JobPaths(DefaultJobDir(split.out_dir())).SequentialInputs(l - 1)).good());
    }
  }
  for (int i = 0; i <= 5; ++i) {
    auto want = ReadFile(opt.out_dir() + "/" + ShardName(i, 5));
    auto got = ReadFile(split.out_dir() + "/" + ShardName(i, 5));
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*want == *got) << ShardName(i, 5) << " differs";
  }
}

// A recipe's BFP12 K cache with K-sort (kv_cache {format: bfp, group: 4, k_sort: true}; keys
// cached before RoPE by default) is exactly `qcal tool kv-eval`'s setting (ApplyKSort, then
// InstallBfpKeyCache pre-RoPE), the k_sort flag and the key point both change the result, and the
// checkpoint keeps it: the K-sort permutation is stored per block and checked on load.
TEST_F(QuarotQuantizeTest, BfpKSortRecipeMatchesTheToolAndRoundTrips) {
  Recipe r = EditQuarot(LoadJob("quarot-kv4"), [](QuarotConfig& q) {
    q.rotation.enabled = false;
    q.kv_cache = KvCacheSpec();
    q.kv_cache.bits = 4;
    q.kv_cache.format = "bfp";
    q.kv_cache.group = 4;
    q.kv_cache.k_sort = true;
  });
  r.name = "bfp12-ksort-g4";
  const std::string float_dir = *float_dir_;
  at::Tensor ids = at::randint(1, 512, {2, 96}, at::kLong);
  ids.select(1, 0).fill_(1);
  // The logits of the recipe's job output, read back through the method; *out: its directory.
  auto logits_of = [&](const Recipe& recipe, std::string* out) {
    auto m = QuantizeWithJob(float_dir, recipe, out);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? (*m)->Forward(ids) : at::Tensor();
  };
  std::string out;
  const at::Tensor got = logits_of(r, &out);
  ASSERT_TRUE(got.defined());

  auto tool = model::LlamaModel::Load(float_dir);
  ASSERT_TRUE(tool.ok());
  ASSERT_TRUE(qsim::ApplyKSort(**tool).ok());
  qsim::BfpKeyCacheOptions bo;
  bo.key_bits = 4;
  bo.query_bits = 8;
  bo.block = 4;
  bo.point = qsim::KeyQuantPoint::kPreRope;
  ASSERT_TRUE(qsim::InstallBfpKeyCache(**tool, bo).ok());
  EXPECT_TRUE(at::equal(got, (*tool)->Forward(ids)));

  Recipe unsorted = EditQuarot(r, [](QuarotConfig& q) { q.kv_cache.k_sort = false; });
  std::string other;
  EXPECT_FALSE(at::equal(got, logits_of(unsorted, &other))) << "k_sort was ignored";
  Recipe post = EditQuarot(r, [](QuarotConfig& q) { q.kv_cache.key_point = "post_rope"; });
  EXPECT_FALSE(at::equal(got, logits_of(post, &other))) << "key_point was ignored";

  auto loaded = methods::LoadModel(out);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(at::equal((*loaded)->Forward(ids), got));

  // A stored permutation that is not one is refused, naming the file.
  auto ckpt = CheckpointReader::Open(out);
  ASSERT_TRUE(ckpt.ok());
  auto w = quarot::LoadQuarotBlockWeights(**ckpt, (*loaded)->config(), 1);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(w->rope_perm.defined());
  w->rope_perm[0][1] = w->rope_perm[0][0];
  const std::string shard = out + "/" + ShardName(2, 5);
  ASSERT_TRUE(quarot::WriteQuarotBlockShard(shard, (*loaded)->config(), 1, *w).ok());
  // The index's checksum refuses the changed shard first (issue 18) ...
  auto bad = methods::LoadModel(out);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_NE(bad.status().message().find(shard + ": checksum"), std::string::npos)
      << bad.status();
  // ... and behind an index that records no checksums, the content check does.
  ASSERT_TRUE(WriteShardIndex(out, 5).ok());
  bad = methods::LoadModel(out);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("not a permutation"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find(shard), std::string::npos) << bad.status();
  // A shard that lost the permutation is refused too (here the index, which still lists it,
  // catches it first; with a matching index LoadQuarotModel (through the method) checks it against k_sort).
  w->rope_perm = at::Tensor();
  ASSERT_TRUE(quarot::WriteQuarotBlockShard(shard, (*loaded)->config(), 1, *w).ok());
  bad = methods::LoadModel(out);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("model.layers.1.quarot.rope_perm"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace qcal
