// The single-process quantization pipeline on stories260K: checkpoint round trip, resume without
// losing finished blocks, Hessian reuse, and the perplexity orderings QuIP# reports.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/eval/perplexity.h"
#include "methods/quip/quip_linear.h"
#include "methods/quip/quip_method.h"
#include "methods/registry.h"
#include "methods/method_factory.h"
#include "runner/quantize_job.h"
#include "engine/quant/block_task.h"

namespace qcal {
namespace {

// A recipe of these tests: `method` at `bits` (QuIP#: with `codebook`; rtn/gptq: with clip
// search), 48 WikiText-2 sequences of 128 tokens unless `extra` (more YAML lines) says otherwise.
Recipe MakeRecipe(const std::string& name, const std::string& method, int bits,
                  const std::string& codebook, const std::string& extra = "") {
  std::string yaml = absl::StrCat("name: ", name, "\nmethod: ", method, "\nbits: ", bits, "\n");
  if (!codebook.empty()) absl::StrAppend(&yaml, "codebook: ", codebook, "\n");
  if (method != "quip") absl::StrAppend(&yaml, "scalar: {clip_search: true}\n");
  if (extra.find("calibration:") == std::string::npos) {
    absl::StrAppend(&yaml, "calibration: {files: [data/wikitext2/wiki.valid.tokens], "
                           "num_sequences: 48, seq_len: 128}\n");
  }
  yaml += extra;
  StatusOr<Recipe> r = ParseRecipe(yaml, name + ".yaml");
  EXPECT_TRUE(r.ok()) << r.status() << "\n" << yaml;
  return r.ok() ? *r : Recipe();
}

constexpr char kCalib128[] =
    "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 128, seq_len: 128}\n";

class QuantizeJobTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    // Canonical, as the job makes the paths it writes under (common/safe_fs.h) and names them.
    root_ = new std::string(std::filesystem::canonical(testing::MakeTempDir("qjob")).string());
    auto tok = LoadTokenizerFromModelDir(testing::RealModelDir("stories260K"));
    ASSERT_TRUE(tok.ok());
    auto text = ReadTextFile(testing::SharedDir() +
                             "/data/tinystories/TinyStories-valid.sample30k.txt");
    ASSERT_TRUE(text.ok());
    eval_tokens_ = new std::vector<int32_t>((*tok)->Encode(*text));
  }
  static void TearDownTestSuite() {
    delete root_;
    delete eval_tokens_;
  }

  v1::JobSpec Options(const std::string& out) {
    v1::JobSpec o;
    o.set_model_dir(testing::RealModelDir("stories260K"));
    o.set_out_dir(*root_ + "/" + out);
    o.set_job_dir(*root_ + "/" + out + ".job");
    o.set_data_root(testing::SharedDir());
    o.set_threads_per_worker(1);
    return o;
  }

  // Perplexity on the TinyStories sample (--bos-per-window, ctx 512).
  double Perplexity(const std::string& dir) {
    auto m = methods::LoadModel(dir);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return 0;
    eval::PerplexityOptions opt;
    opt.ctx = 512;
    opt.bos_per_window = true;
    auto r = eval::EvaluatePerplexity(**m, *eval_tokens_, opt);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->perplexity : 0;
  }

  double QuantizeAndEval(const Recipe& recipe) {
    auto result = job::RunQuantizeJob(recipe, Options(recipe.name));
    EXPECT_TRUE(result.ok()) << recipe.name << ": " << result.status();
    if (!result.ok()) return 0;
    const double ppl = Perplexity(result->out_dir);
    std::printf("%-16s ppl %8.3f  bits %.3f codes / %.3f stored  (%.1f s)\n", recipe.name.c_str(),
                ppl, result->code_bits, result->stored_bits, result->seconds);
    return ppl;
  }

  static std::string* root_;
  static std::vector<int32_t>* eval_tokens_;
};

std::string* QuantizeJobTest::root_ = nullptr;
std::vector<int32_t>* QuantizeJobTest::eval_tokens_ = nullptr;

TEST_F(QuantizeJobTest, PerplexityOrderingsHold) {
  const double fp = Perplexity(testing::RealModelDir("stories260K"));
  std::printf("float            ppl %8.3f\n", fp);
  // The recipe default, one scale per row of the rotated weights, with the bundled recipes' 128
  // calibration sequences: E8P < half-integer grid < RTN (measured 58.3 < 77.5 < 144).
  Recipe e8p_row = MakeRecipe("quip-e8p-2bit", "quip", 2, "e8p", kCalib128);
  Recipe half_row = MakeRecipe("quip-halfint-2bit", "quip", 2, "halfint2", kCalib128);
  // QuIP#'s one scale per matrix (the paper's setting) keeps the same codebook order.
  Recipe e8p_matrix = MakeRecipe("quip-e8p-2bit-matrix", "quip", 2, "e8p",
                                 std::string("scale: matrix\n") + kCalib128);
  Recipe half_matrix = MakeRecipe("quip-halfint-2bit-matrix", "quip", 2, "halfint2",
                                  std::string("scale: matrix\n") + kCalib128);
  const double quip2 = QuantizeAndEval(e8p_row);
  const double half2 = QuantizeAndEval(half_row);
  const double quip2_matrix = QuantizeAndEval(e8p_matrix);
  const double half2_matrix = QuantizeAndEval(half_matrix);
  const double rtn2 = QuantizeAndEval(MakeRecipe("rtn-2bit", "rtn", 2, ""));
  EXPECT_GT(quip2, fp);
  EXPECT_LT(quip2, half2) << "QuIP# E8P 2-bit should beat the half-integer grid";
  EXPECT_LT(half2, rtn2) << "the half-integer grid (with IP + BlockLDLQ) should beat RTN 2-bit";
  EXPECT_LT(quip2_matrix, half2_matrix) << "E8P beats the half-integer grid with one scale too";
  EXPECT_LT(quip2, quip2_matrix) << "one scale per row should beat one per matrix on this model";
  // Not asserted yet: QuIP# 4-bit within 5% of float. Measured 17.5 vs 14.8 with row scales
  // (25.9 with one scale per matrix; GPTQ 4-bit: 15.3); see docs/results.md.
}

// QTIP (issue 41): a 2-bit trellis job on stories260K writes exactly 2 code bits per weight (the
// same padding as E8P: down_proj's inputs only; no row padding, the last tile of a 172-row matrix
// is short), reads back to the same model, beats E8P's perplexity with the same calibration, and a
// block redone after a simulated crash is bit-identical.
TEST_F(QuantizeJobTest, TrellisJobRoundTripsResumesAndBeatsE8p) {
  Recipe recipe = MakeRecipe("qtip2", "quip", 2, "qtip_1mad", "trellis_l: 16\n");
  auto opt = Options("qtip2");
  auto first = job::RunQuantizeJob(recipe, opt);
  ASSERT_TRUE(first.ok()) << first.status();
  const double weights = 5 * 45312.0, down = 5 * 11008.0;
  EXPECT_NEAR(first->code_bits, 2.0 * (weights - down + down * 176.0 / 172.0) / weights, 1e-9);
  auto config = LoadLlamaConfig(opt.out_dir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->raw["quantization_config"]["codebook"], "qtip_1mad_l16_k2");
  const double ppl = Perplexity(opt.out_dir());
  const double e8p = QuantizeAndEval(MakeRecipe("e8p2-48", "quip", 2, "e8p"));
  std::printf("qtip2            ppl %8.3f  (E8P, same calibration: %.3f)\n", ppl, e8p);
  EXPECT_LT(ppl, e8p);

  auto model_a = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(model_a.ok()) << model_a.status();
  at::Tensor ids = at::arange(1, 60, at::kLong).unsqueeze(0);
  const int64_t blocks = config->num_hidden_layers;
  const std::string shard2 = opt.out_dir() + "/" + ShardName(3, blocks);
  auto before = ReadFile(shard2);
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(std::remove(shard2.c_str()), 0);
  ASSERT_EQ(std::remove((opt.out_dir() + "/config.json").c_str()), 0);
  auto second = job::RunQuantizeJob(recipe, opt);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->blocks_resumed, blocks - 1);
  auto after = ReadFile(shard2);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*before, *after) << "the redone block must be bit-identical";
  auto model_b = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(model_b.ok()) << model_b.status();
  EXPECT_TRUE(at::equal((*model_a)->Forward(ids), (*model_b)->Forward(ids)));
}

TEST_F(QuantizeJobTest, CheckpointRoundTripsAndJobResumes) {
  Recipe recipe = MakeRecipe("roundtrip", "quip", 2, "e8p");
  auto opt = Options("roundtrip");
  std::vector<job::JobEvent> events;
  auto record = [&events](const job::JobEvent& e) { events.push_back(e); };
  auto first = job::RunQuantizeJob(recipe, opt, record);
  ASSERT_TRUE(first.ok()) << first.status();
  // Progress: the quantize phase counts blocks from 0, and inside each block every linear is a
  // step ("block l: <linear>" l/7), so a long block is not silent.
  std::vector<int64_t> quantize_done;
  std::map<int64_t, std::vector<std::string>> steps;  // block -> its steps, in order
  for (const job::JobEvent& e : events) {
    if (e.phase == "quantize") quantize_done.push_back(e.done);
    if (e.phase != "block") continue;
    int layer = -1;
    ASSERT_EQ(std::sscanf(e.message.c_str(), "block %d:", &layer), 1) << e.message;
    EXPECT_EQ(e.total, 7) << e.message;
    steps[layer].push_back(e.message.substr(e.message.find(": ") + 2));
    EXPECT_EQ(e.done, static_cast<int64_t>(steps[layer].size())) << e.message;
  }
  EXPECT_EQ(quantize_done, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  ASSERT_EQ(steps.size(), 5u);
  for (const auto& [layer, names] : steps) {
    EXPECT_EQ(names, (std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj",
                                               "self_attn.v_proj", "self_attn.o_proj",
                                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}))
        << "block " << layer;
  }
  EXPECT_FALSE(first->hessians_from_cache);
  EXPECT_EQ(first->blocks_resumed, 0);
  // Every linear is exactly 2 bits except down_proj, whose 172 inputs are padded to 176.
  const double weights = 5 * 45312.0, down = 5 * 11008.0;
  EXPECT_NEAR(first->code_bits, 2.0 * (weights - down + down * 176.0 / 172.0) / weights, 1e-9);

  // Write / load / same outputs: the block quantized in memory equals the block read back.
  auto config = LoadLlamaConfig(opt.out_dir());
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->raw.contains("quantization_config"));
  auto ckpt = CheckpointReader::Open(opt.out_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto float_model = model::LlamaModel::Load(opt.model_dir());
  ASSERT_TRUE(float_model.ok());
  // Recompute block 1 exactly as the job did (same recipe, seed, Hessians from the cache).
  auto tok = LoadTokenizerFromModelDir(opt.model_dir());
  ASSERT_TRUE(tok.ok());
  auto method = methods::CheckpointMethod(*config, opt.out_dir());
  ASSERT_TRUE(method.ok()) << method.status();
  auto loaded = (*method)->block_format().LoadBlock(**ckpt, 1);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  model::DecoderBlock from_disk(*config, std::move(*loaded));
  at::manual_seed(7);
  at::Tensor x = at::randn({2, 16, config->hidden_size});
  at::Tensor y_disk = from_disk.Forward(x, (*float_model)->rope());
  at::Tensor y_float = (*float_model)->block(1).Forward(x, (*float_model)->rope());
  EXPECT_FALSE(at::allclose(y_disk, y_float));  // it is quantized...
  EXPECT_LT((y_disk - y_float).pow(2).mean().item<double>(),
            0.1 * y_float.pow(2).mean().item<double>());  // ...and close
  // Loading twice gives identical results (deterministic decode).
  auto model_a = methods::LoadModel(opt.out_dir());
  auto model_b = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(model_a.ok() && model_b.ok());
  at::Tensor ids = at::arange(1, 60, at::kLong).unsqueeze(0);
  EXPECT_TRUE(at::equal((*model_a)->Forward(ids), (*model_b)->Forward(ids)));

  // Simulate a crash after block 2: its shard and the final config are lost.
  const int64_t blocks = config->num_hidden_layers;
  const std::string shard2 = opt.out_dir() + "/" + ShardName(3, blocks);
  auto before = ReadFile(shard2);
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(std::remove(shard2.c_str()), 0);
  ASSERT_EQ(std::remove((opt.out_dir() + "/config.json").c_str()), 0);
  events.clear();
  auto second = job::RunQuantizeJob(recipe, opt, record);
  ASSERT_TRUE(second.ok()) << second.status();
  quantize_done.clear();
  for (const job::JobEvent& e : events) {
    if (e.phase == "quantize") quantize_done.push_back(e.done);
  }
  EXPECT_EQ(quantize_done, (std::vector<int64_t>{4, 5}));  // the 4 resumed blocks, then block 2
  EXPECT_TRUE(second->hessians_from_cache);
  EXPECT_EQ(second->blocks_resumed, blocks - 1);
  auto after = ReadFile(shard2);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*before, *after) << "the redone block must be bit-identical";
  auto model_c = methods::LoadModel(opt.out_dir());
  ASSERT_TRUE(model_c.ok()) << model_c.status();
  EXPECT_TRUE(at::equal((*model_a)->Forward(ids), (*model_c)->Forward(ids)));

  // A journal from another recipe is refused, with the job dir named.
  Recipe other = MakeRecipe("other", "quip", 2, "halfint2");
  auto refused = job::RunQuantizeJob(other, opt);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("journal.jsonl"), std::string::npos)
      << refused.status();
}

// Every refusal names the path and the problem and leaves no directory behind; the checks are
// the coordinator's (runner/job_inputs.h), so `qcal quantize` and `qcal submit` agree.
TEST_F(QuantizeJobTest, BadInputIsAClearErrorAndLeavesNothingBehind) {
  namespace fs = std::filesystem;
  auto expect_refused = [](const StatusOr<job::QuantizeJobResult>& r,
                           const v1::JobSpec& opt, const std::string& piece) {
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(piece), std::string::npos) << r.status();
    EXPECT_FALSE(fs::exists(opt.out_dir())) << opt.out_dir() << " left behind after: " << r.status();
    EXPECT_FALSE(fs::exists(opt.job_dir())) << opt.job_dir() << " left behind after: " << r.status();
  };
  Recipe recipe = MakeRecipe("bad", "quip", 2, "e8p");
  auto opt = Options("bad");
  opt.set_out_dir(opt.model_dir() + "/inside");
  opt.set_job_dir(*root_ + "/bad.job");
  // Named as resolved (the model's directory may be spelt "/tmp//..." by the fixture).
  auto resolved = [](const std::string& p) { return fs::weakly_canonical(p).string(); };
  expect_refused(job::RunQuantizeJob(recipe, opt), opt,
                 "out_dir '" + resolved(opt.out_dir()) + "' is inside");

  // The job directory inside the model directory, as the service refuses it.
  opt = Options("bad-job-dir");
  opt.set_job_dir(opt.model_dir() + "/jobdir");
  expect_refused(job::RunQuantizeJob(recipe, opt), opt,
                 "job_dir '" + resolved(opt.job_dir()) + "' is inside");

  opt = Options("bad2");
  recipe = MakeRecipe("bad", "quip", 2, "e8p", "calibration: {files: [data/does-not-exist.txt]}\n");
  expect_refused(job::RunQuantizeJob(recipe, opt), opt, "does-not-exist.txt");

  // The record asks for more than the one process `qcal quantize` runs.
  opt = Options("bad-workers");
  opt.set_workers(2);
  expect_refused(job::RunQuantizeJob(MakeRecipe("bad", "quip", 2, "e8p"), opt), opt,
                 "runs a job in one process; the spec asks for 2 workers");

  // Found only while calibrating (too little text for one sequence): the directories the job
  // created are removed, since nothing in them is worth keeping.
  const std::string tiny = *root_ + "/tiny.txt";
  ASSERT_TRUE(WriteFileAtomic(tiny, "Once upon a time.\n").ok());
  opt = Options("bad3");
  recipe = MakeRecipe("bad", "quip", 2, "e8p", "calibration: {files: [" + tiny + "]}\n");
  expect_refused(job::RunQuantizeJob(recipe, opt), opt, "fewer than one sequence");
}

// One output directory, one job: a second job on a directory another process is writing is
// refused at once, naming the directory, and removes nothing of the first job's.
TEST_F(QuantizeJobTest, AnOutputDirectoryInUseIsRefused) {
  Recipe recipe = MakeRecipe("locked", "rtn", 4, "", "calibration: {num_sequences: 4}\n");
  auto opt = Options("locked");
  ASSERT_TRUE(MakeDirs(opt.out_dir()).ok());
  auto held = OutputDirLock::Acquire(opt.out_dir());  // another job's lock (flock is per open file)
  ASSERT_TRUE(held.ok()) << held.status();
  auto r = job::RunQuantizeJob(recipe, opt);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find(opt.out_dir() + ": another qcal job is writing"),
            std::string::npos) << r.status();
  EXPECT_TRUE(std::filesystem::exists(opt.out_dir()));
  *held = OutputDirLock();  // released: the job runs
  auto ok = job::RunQuantizeJob(recipe, opt);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

}  // namespace
}  // namespace qcal

namespace qcal {
namespace {

// The quantized layer computes exactly the weights whose proxy loss the block task reports, for
// every codebook and with or without incoherence processing.
TEST(QuantizeLinearTest, LayerWeightsMatchReportedProxyLoss) {
  model::SetComputeThreads(1);
  at::manual_seed(3);
  for (const char* codebook : {"e8p", "rvq4_e8p_e8p", "halfint2"}) {
    for (bool incoherence : {true, false}) {
      for (const char* scale_mode : {"row", "matrix"}) {
        for (auto [out, in] :
             {std::pair<int64_t, int64_t>{64, 64}, {32, 64}, {172, 64}, {64, 172}}) {
          const int bits = std::string(codebook) == "rvq4_e8p_e8p" ? 4 : 2;
          Recipe r = MakeRecipe("x", "quip", bits, codebook,
                                absl::StrCat("incoherence: ", incoherence ? "true" : "false",
                                             "\nscale: ", scale_mode, "\n"));
          auto rounding = methods::quip::Rounding(r);
          ASSERT_TRUE(rounding.ok()) << rounding.status();
          at::Tensor w = at::randn({out, in});
          if (std::string(scale_mode) == "row") {
            w = w * at::linspace(0.1, 3.0, out).unsqueeze(1);  // rows of different norms
          }
          at::Tensor a = at::randn({in, 4 * in}, at::kDouble);
          at::Tensor h = at::matmul(a, a.t()) / (4.0 * in);
          auto q = (*rounding)->Round(0, model::LinearKind::kQ, /*expert=*/-1, w, h,
                                      /*gpu=*/nullptr, /*progress=*/nullptr);
          ASSERT_TRUE(q.ok()) << q.status();
          auto* quip = dynamic_cast<methods::quip::QuipLinear*>(q->layer.get());
          ASSERT_NE(quip, nullptr);
          EXPECT_EQ(quip->data().row_scales.size(),
                    std::string(scale_mode) == "row" ? static_cast<size_t>(quip->data().out_pad)
                                                     : 0u);
          at::Tensor dense = q->layer->DenseWeight().to(at::kDouble);
          at::Tensor e = dense - w.to(at::kDouble);
          const double proxy = at::trace(at::matmul(at::matmul(e, h), e.t())).item<double>();
          EXPECT_NEAR(proxy / q->metrics.proxy_loss, 1.0, 1e-4)
              << codebook << " incoherence " << incoherence << " scale " << scale_mode << " "
              << out << "x" << in;
        }
      }
    }
  }
}

}  // namespace
}  // namespace qcal
