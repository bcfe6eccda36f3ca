// Calibration that covers every routed expert (issue 53, deliverable 2), on Mixtral and Llama 4
// models upcycled by the independent reference tests/reference/moe_reference.py from a random
// dense Llama (as engine_moe_model_test; the Llama 4 model has dense and MoE, NoPE and RoPE
// layers, qk-norm, chunks, a shared expert and sigmoid-scaled expert inputs):
//  * each routed expert's gate/up and down_proj Hessians, and the tokens the router sends it,
//    agree with the reference's (float64, its own forward) under the real routing and with
//    every expert calibrated on every token (route-all);
//  * route-all leaves every block's outputs (the activation files) byte-identical: the output
//    keeps the real routing;
//  * the starved-expert rule: experts below the minimum (one that no token reaches among them)
//    calibrate on every token, get the route-all reference's Hessians, and are reported; the
//    others keep the real routing's;
//  * 1, 2 and 3 thread-ranks write byte-identical Hessian files; a file reads back (whole and
//    mapped) to the same means and counts;
//  * expert parallelism (engine/calib/expert_parallel.h): a rank loads and sums only its own
//    experts; the exchange gives each rank the block outputs and each owner the sums one process
//    computes, also with a rank that has no chunk and with one whose forward fails (no hang).
// Needs /usr/bin/python3 with numpy.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hf_config.h"
#include "common/atomic_file.h"
#include "common/safetensors.h"
#include "engine/calib/cache.h"
#include "engine/calib/calibration.h"
#include "engine/calib/expert_parallel.h"
#include "engine/comm/comm.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "runner/job_steps.h"
#include "tests/engine/calibration_ranks.h"
#include "tests/engine/moe_fixtures.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

using testing::MakeTempDir;

using testing::MoeDenseDir;
using testing::ReferencePython;
using testing::Shell;
using testing::UpcycleMoe;
constexpr int64_t kVocab = testing::kMoeVocab;
constexpr int64_t kSeqs = 5, kSeqLen = 16, kBatch = 2;  // 3 chunks, the last one short

struct Case {
  std::string name;
  std::string args;
};

const Case kCases[] = {
    {"mixtral", "--layout mixtral"},
    {"llama4",
     "--layout llama4 --shared-scale 0.5 --moe-step 2 --mlp-pad 8 --nope-interval 2 --qk-norm"
     " --temperature-tuning --floor-scale 4 --chunk 8"},
};

at::Tensor Tokens(int64_t seqs = kSeqs, int64_t len = kSeqLen, uint64_t seed = 11) {
  std::mt19937_64 rng(seed);
  at::Tensor t = at::empty({seqs, len}, at::kLong);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<int64_t>()[i] = rng() % kVocab;
  return t;
}

std::string TokensArg(const at::Tensor& tokens) {
  std::vector<std::string> seqs;
  for (int64_t s = 0; s < tokens.size(0); ++s) {
    std::vector<int64_t> ids(tokens[s].data_ptr<int64_t>(),
                             tokens[s].data_ptr<int64_t>() + tokens.size(1));
    seqs.push_back(absl::StrJoin(ids, ","));
  }
  return absl::StrJoin(seqs, "/");
}

// The reference's per-expert means and counts (moe_reference.py expert-hessians).
struct Reference {
  std::string dir;
  nlohmann::json counts;  // {"l": {"e": [routed, rows]}}
  at::Tensor Mean(int64_t l, int64_t e, calib::ExpertInput i, int64_t n) const {
    const std::string path =
        absl::StrCat(dir, "/l", l, ".e", e, ".", calib::ExpertInputName(i), ".f64");
    std::ifstream in(path, std::ios::binary);
    std::vector<double> v(n * n);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 8));
    EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(v.size() * 8)) << path;
    return at::from_blob(v.data(), {n, n}, at::kDouble).clone();
  }
};

Reference RunReference(const std::string& model, bool route_all,
                       const at::Tensor& tokens = Tokens()) {
  Reference r;
  r.dir = MakeTempDir("moe-calib-ref");
  Shell(absl::StrCat(ReferencePython(), "moe_reference.py expert-hessians --model ", model,
                     " --tokens ", TokensArg(tokens), " --out ", r.dir,
                     route_all ? " --route-all" : ""));
  std::ifstream in(r.dir + "/counts.json");
  r.counts = nlohmann::json::parse(in);
  return r;
}

double RelDiff(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a - b).abs().max().item<double>() / scale;
}

// Calibrate on `ranks` thread-ranks; rank 0's result (every rank must succeed and hold rank 0's
// reduced sums, experts included).
calib::CalibrationResult RunRanks(const std::string& model, int ranks, const std::string& job_dir,
                                  bool route_all, int64_t min_tokens,
                                  const at::Tensor& tokens = Tokens()) {
  auto results = testing::CalibrateOnThreadRanks(
      ranks, model, tokens, job_dir, [&](calib::CalibrationOptions& o, comm::Comm&) {
        o.batch = kBatch;
        o.activations = true;
        o.moe_route_all = route_all;
        o.moe_min_tokens = min_tokens;
      });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
  }
  EXPECT_EQ(testing::FirstRankDifference(results), "");
  return results[0].ok() ? std::move(*results[0]) : calib::CalibrationResult{};
}

class MoeCalibrationTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    model::SetComputeThreads(1);
    model_ = UpcycleMoe("calib-" + GetParam().name, GetParam().args);
    auto config = LoadLlamaConfig(model_ + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
  }

  // Every MoE block's experts against the reference: counts exactly, means to fp32 rounding.
  // route_all_of(l, e): whether expert e of block l was calibrated on every token.
  void ExpectMatches(const calib::CalibrationResult& got, const Reference& real,
                     const Reference& all,
                     const std::function<bool(int64_t, int64_t)>& route_all_of,
                     int64_t tokens = kSeqs * kSeqLen) {
    int64_t moe_blocks = 0;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      const calib::BlockHessians& h = got.hessians[l];
      if (!config_.IsMoeLayer(l)) {
        EXPECT_TRUE(h.experts.empty()) << "block " << l;
        continue;
      }
      ++moe_blocks;
      ASSERT_EQ(static_cast<int64_t>(h.experts.size()), config_.num_experts) << "block " << l;
      int64_t routed_sum = 0;
      for (int64_t e = 0; e < config_.num_experts; ++e) {
        const std::string where = absl::StrCat("block ", l, " expert ", e);
        const calib::ExpertHessians& eh = h.experts[e];
        const bool every = route_all_of(l, e);
        EXPECT_EQ(eh.route_all, every) << where;
        const Reference& ref = every ? all : real;
        const auto counts = ref.counts[std::to_string(l)][std::to_string(e)];
        EXPECT_EQ(eh.routed_tokens, counts[0].get<int64_t>()) << where;
        EXPECT_EQ(got.expert_tokens.at(l)[e], eh.routed_tokens) << where;
        routed_sum += eh.routed_tokens;
        for (calib::ExpertInput i : calib::kExpertInputs) {
          EXPECT_EQ(eh.at(i).count(), counts[1].get<int64_t>()) << where;
          const int64_t n = eh.at(i).dim();
          if (counts[1].get<int64_t>() == 0) {
            EXPECT_EQ(h.ExpertMean(e, i).abs().max().item<double>(), 0.0) << where;
            continue;
          }
          const double d = RelDiff(h.ExpertMean(e, i), ref.Mean(l, e, i, n));
          EXPECT_LT(d, 1e-5) << where << " " << calib::ExpertInputName(i);
        }
      }
      EXPECT_EQ(routed_sum, tokens * config_.experts_per_token) << "block " << l;
    }
    EXPECT_GT(moe_blocks, 0);
  }

  std::string model_;
  LlamaConfig config_;
};

TEST_P(MoeCalibrationTest, RealRoutingAndRouteAllMatchTheReference) {
  const Reference real = RunReference(model_, false);
  const Reference all = RunReference(model_, true);
  const std::string dir_real = MakeTempDir("moe-calib-job"), dir_all = MakeTempDir("moe-calib-job");
  const calib::CalibrationResult r = RunRanks(model_, 1, dir_real, false, /*min_tokens=*/0);
  ASSERT_EQ(static_cast<int64_t>(r.hessians.size()), config_.num_hidden_layers);
  ExpectMatches(r, real, all, [](int64_t, int64_t) { return false; });
  EXPECT_TRUE(r.starved_experts.empty());
  const calib::CalibrationResult a = RunRanks(model_, 1, dir_all, true, 0);
  ASSERT_EQ(static_cast<int64_t>(a.hessians.size()), config_.num_hidden_layers);
  ExpectMatches(a, real, all, [](int64_t, int64_t) { return true; });
  // Route-all changes the experts' statistics only: every block's outputs and the dense inputs'
  // sums are those of the real routing.
  for (int64_t b = 0; b <= config_.num_hidden_layers; ++b) {
    auto x = ReadFile(calib::ActivationPath(job::CalibrationDirsOf(dir_real).activations, b));
    auto y = ReadFile(calib::ActivationPath(job::CalibrationDirsOf(dir_all).activations, b));
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_TRUE(*x == *y) << "boundary " << b;
  }
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (int k = 0; k < 4; ++k) {
      EXPECT_TRUE(r.hessians[l].h[k].packed() == a.hessians[l].h[k].packed())
          << "block " << l << " kind " << k;
    }
  }
}

// The starved-expert rule on 1, 2 and 3 ranks: with 80 tokens and top-2 routing over 4 experts
// (40 rows per expert on average), a minimum of 40 moves some experts to every token and leaves
// others on their real routing; every rank count writes the same bytes.
TEST_P(MoeCalibrationTest, StarvedExpertsCalibrateOnEveryTokenAndRanksAgree) {
  const Reference real = RunReference(model_, false);
  const Reference all = RunReference(model_, true);
  const int64_t min_tokens = 40;
  auto starved_of = [&](int64_t l, int64_t e) {
    return real.counts[std::to_string(l)][std::to_string(e)][0].get<int64_t>() < min_tokens;
  };
  std::vector<std::string> files;
  for (int ranks : {1, 2, 3}) {
    const std::string dir = MakeTempDir("moe-calib-ranks");
    const calib::CalibrationResult r = RunRanks(model_, ranks, dir, false, min_tokens);
    ASSERT_EQ(static_cast<int64_t>(r.hessians.size()), config_.num_hidden_layers);
    ExpectMatches(r, real, all, starved_of);
    int64_t starved = 0, fed = 0;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      if (!config_.IsMoeLayer(l)) continue;
      std::vector<int64_t> want;
      for (int64_t e = 0; e < config_.num_experts; ++e) {
        if (starved_of(l, e)) want.push_back(e);
        (starved_of(l, e) ? starved : fed) += 1;
      }
      if (want.empty()) {
        EXPECT_EQ(r.starved_experts.count(l), 0u) << "block " << l;
      } else {
        EXPECT_EQ(r.starved_experts.at(l), want) << "block " << l;
      }
    }
    // Both kinds occur, so the test can fail either way.
    EXPECT_GT(starved, 0);
    EXPECT_GT(fed, 0);
    std::string bytes;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      auto f = ReadFile(calib::HessianPath(job::CalibrationDirsOf(dir).hessians, l));
      ASSERT_TRUE(f.ok()) << f.status();
      bytes += *f;
    }
    files.push_back(bytes);
    if (ranks == 1) {
      // The files read back to the same sums, whole and mapped.
      for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
        if (!config_.IsMoeLayer(l)) continue;
        const std::string path = calib::HessianPath(job::CalibrationDirsOf(dir).hessians, l);
        auto whole = calib::LoadBlockHessians(path, "key");
        auto mapped = calib::LoadBlockHessians(path, "key", /*mapped=*/true);
        ASSERT_TRUE(whole.ok()) << whole.status();
        ASSERT_TRUE(mapped.ok()) << mapped.status();
        for (int64_t e = 0; e < config_.num_experts; ++e) {
          const calib::ExpertHessians& want = r.hessians[l].experts[e];
          EXPECT_EQ(whole->experts[e].routed_tokens, want.routed_tokens);
          EXPECT_EQ(mapped->experts[e].route_all, want.route_all);
          for (calib::ExpertInput i : calib::kExpertInputs) {
            EXPECT_TRUE(whole->experts[e].at(i).packed() == want.at(i).packed());
            EXPECT_TRUE(at::equal(mapped->ExpertMean(e, i), r.hessians[l].ExpertMean(e, i)))
                << "block " << l << " expert " << e;
          }
        }
      }
    }
  }
  EXPECT_TRUE(files[1] == files[0]) << "2 ranks";
  EXPECT_TRUE(files[2] == files[0]) << "3 ranks";
}

// An expert no calibration token reaches (llm-compressor #1864, GPTQModel #1376): on 6 tokens
// some expert of some MoE block receives none. With the default minimum (the hidden size, 64,
// above every expert's count here) every expert calibrates on every token: the starved one gets
// all 6 tokens' Hessians (the route-all reference's), and its routed count stays 0.
TEST_P(MoeCalibrationTest, AnExpertNoTokenReachesGetsEveryTokensHessian) {
  const at::Tensor tokens = Tokens(1, 6, 5);
  const Reference real = RunReference(model_, false, tokens);
  const Reference all = RunReference(model_, true, tokens);
  int64_t unreached = 0;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    if (!config_.IsMoeLayer(l)) continue;
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      unreached += real.counts[std::to_string(l)][std::to_string(e)][0].get<int64_t>() == 0;
    }
  }
  ASSERT_GT(unreached, 0) << "the tokens reach every expert: the test would not test";
  const calib::CalibrationResult r =
      RunRanks(model_, 1, MakeTempDir("moe-calib-unreached"), false, /*min_tokens=*/-1, tokens);
  ASSERT_EQ(static_cast<int64_t>(r.hessians.size()), config_.num_hidden_layers);
  ExpectMatches(r, real, all, [](int64_t, int64_t) { return true; }, 6);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    if (!config_.IsMoeLayer(l)) continue;
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      const at::Tensor h = r.hessians[l].ExpertMean(e, calib::ExpertInput::kGateUp);
      EXPECT_GT(h.diagonal().min().item<double>(), 0) << "block " << l << " expert " << e;
    }
  }
}

// A float source that records which blocks it was asked for, whole or in part.
class RecordingSource final : public model::ModelSource {
 public:
  explicit RecordingSource(std::unique_ptr<model::ModelSource> inner) : inner_(std::move(inner)) {}
  struct Load {
    int64_t layer;
    bool whole;
    int64_t begin, end;  // the experts of a part
  };
  std::vector<Load> loads;

  const LlamaConfig& config() const override { return inner_->config(); }
  const model::Rope& rope() const override { return inner_->rope(); }
  StatusOr<at::Tensor> Embed(const at::Tensor& ids) override { return inner_->Embed(ids); }
  StatusOr<model::BlockWeights> LoadBlockWeights(int64_t layer) override {
    return inner_->LoadBlockWeights(layer);
  }
  StatusOr<std::unique_ptr<model::DecoderBlock>> LoadBlock(int64_t layer) override {
    loads.push_back({layer, true, 0, -1});
    return inner_->LoadBlock(layer);
  }
  StatusOr<std::unique_ptr<model::DecoderBlock>> LoadBlockPart(
      int64_t layer, const model::BlockSelection& select) override {
    loads.push_back({layer, false, select.expert_begin, select.expert_end});
    return inner_->LoadBlockPart(layer, select);
  }
  StatusOr<at::Tensor> Logits(const at::Tensor& hidden) override { return inner_->Logits(hidden); }
  StatusOr<LoadedHead> Head() override { return inner_->Head(); }
  StatusOr<model::NonBlockWeights> LoadNonBlock() override { return inner_->LoadNonBlock(); }
  void ReleaseHead() override { inner_->ReleaseHead(); }
  StatusOr<at::Tensor> HeadRows(int64_t begin, int64_t count) override {
    return inner_->HeadRows(begin, count);
  }
  StatusOr<at::Tensor> FinalNorm() override { return inner_->FinalNorm(); }
  bool HeadTied() const override { return inner_->HeadTied(); }
  Status AddStoredTensor(SafetensorsWriter* writer, const std::string& name) override {
    return inner_->AddStoredTensor(writer, name);
  }

 private:
  std::unique_ptr<model::ModelSource> inner_;
};

// On 3 thread-ranks a MoE block is read in parts, each rank only its own experts (never the
// whole block), and the Hessian files are one process's bytes.
TEST_P(MoeCalibrationTest, EachRankLoadsAndSumsOnlyItsOwnExperts) {
  const at::Tensor tokens = Tokens();
  auto run = [&](int ranks, const std::string& dir,
                 std::vector<std::vector<RecordingSource::Load>>* loads) {
    auto comms = comm::MakeThreadComms(ranks);
    std::vector<Status> status(ranks);
    loads->assign(ranks, {});
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto opened = model::OpenFloatCheckpoint(model_);
        if (!opened.ok()) {
          status[r] = opened.status();
          comms[r].reset();
          return;
        }
        RecordingSource source(*std::move(opened));
        calib::CalibrationOptions o;
        o.batch = kBatch;
        o.keep_hessians = false;
        o.moe_min_tokens = 40;  // some experts on every token (the h goes to their owners)
        status[r] = calib::Calibrate(*comms[r], source, tokens, job::CalibrationDirsOf(dir),
                                     "key", o).status();
        (*loads)[r] = source.loads;
        if (!status[r].ok()) comms[r].reset();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    }
  };
  const std::string one = MakeTempDir("moe-ep-1"), three = MakeTempDir("moe-ep-3");
  std::vector<std::vector<RecordingSource::Load>> loads1, loads3;
  run(1, one, &loads1);
  run(3, three, &loads3);
  for (int r = 0; r < 3; ++r) {
    const comm::Range mine = calib::ExpertsOfRank(config_.num_experts, r, 3);
    int64_t parts = 0;
    for (const RecordingSource::Load& load : loads3[r]) {
      const std::string where = absl::StrCat("rank ", r, " block ", load.layer);
      if (config_.IsMoeLayer(load.layer)) {
        EXPECT_FALSE(load.whole) << where << " was loaded whole";
        EXPECT_EQ(load.begin, mine.begin) << where;
        EXPECT_EQ(load.end, mine.end) << where;
        ++parts;
      } else {
        EXPECT_TRUE(load.whole) << where;
      }
    }
    EXPECT_GT(parts, 0) << "rank " << r;
  }
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    auto a = ReadFile(calib::HessianPath(job::CalibrationDirsOf(one).hessians, l));
    auto b = ReadFile(calib::HessianPath(job::CalibrationDirsOf(three).hessians, l));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(*a == *b) << "block " << l;
  }
}

// A copy of `dir` (config.json and model.safetensors) with every F32 tensor stored as BF16.
std::string Bf16Copy(const std::string& dir) {
  const std::string out = MakeTempDir("moe-bf16");
  auto config = ReadFile(dir + "/config.json");
  EXPECT_TRUE(config.ok());
  EXPECT_TRUE(WriteFileAtomic(out + "/config.json", *config).ok());
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  SafetensorsWriter writer;
  std::vector<at::Tensor> keep;
  for (const TensorInfo& t : (*file)->tensors()) {
    EXPECT_EQ(t.dtype, DType::kF32) << t.name;
    keep.push_back(at::from_blob(const_cast<uint8_t*>((*file)->Data(t)), t.shape, at::kFloat)
                       .to(at::kBFloat16)
                       .contiguous());
    EXPECT_TRUE(writer.Add(t.name, DType::kBF16, t.shape, keep.back().data_ptr(),
                           keep.back().numel() * 2).ok());
  }
  EXPECT_TRUE(writer.Write(out + "/model.safetensors").ok());
  return out;
}

// A bf16 checkpoint: expert-parallel ranks hold their experts as stored (WidenedLinear, half the
// memory) and still sum what one process with float32 experts sums, bit for bit.
TEST_P(MoeCalibrationTest, ExpertsHeldInBf16GiveTheFloat32Sums) {
  const std::string bf16 = Bf16Copy(model_);
  int64_t layer = 0;
  while (!config_.IsMoeLayer(layer)) ++layer;
  auto source = model::OpenFloatCheckpoint(bf16);
  ASSERT_TRUE(source.ok()) << source.status();
  model::BlockSelection select;
  select.expert_begin = 1;
  select.expert_end = 3;
  select.experts_as_stored = true;
  auto part = (*source)->LoadBlockPart(layer, select);
  ASSERT_TRUE(part.ok()) << part.status();
  auto whole = (*source)->LoadBlock(layer);
  ASSERT_TRUE(whole.ok());
  for (int64_t e = 0; e < config_.num_experts; ++e) {
    for (model::ExpertLinear k : model::kExpertLinears) {
      const auto& slot = (*part)->weights().moe->experts[e].linears[static_cast<int>(k)];
      if (e < 1 || e >= 3) {
        EXPECT_EQ(slot, nullptr) << "expert " << e;
        continue;
      }
      const auto* widened = dynamic_cast<const model::WidenedLinear*>(slot.get());
      ASSERT_NE(widened, nullptr) << "expert " << e << " is not held as stored";
      EXPECT_EQ(widened->stored_weight().scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(widened->DenseWeight(),
                            (*whole)->weights().moe->experts[e].linear(k).DenseWeight()));
    }
  }
  // 2 ranks, each holding its experts in bf16; then each MoE block once more on one process with
  // float32 experts, on the same inputs (the activation file) and route-all flags.
  const std::string dir = MakeTempDir("moe-bf16-job");
  const calib::CalibrationResult r = RunRanks(bf16, 2, dir, false, /*min_tokens=*/40);
  ASSERT_EQ(static_cast<int64_t>(r.hessians.size()), config_.num_hidden_layers);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    if (!config_.IsMoeLayer(l)) continue;
    auto x = calib::LoadActivation(calib::ActivationPath(job::CalibrationDirsOf(dir).activations, l),
                                   "key", {kSeqs, kSeqLen, config_.hidden_size});
    ASSERT_TRUE(x.ok()) << x.status();
    auto block = (*source)->LoadBlock(l);
    ASSERT_TRUE(block.ok());
    calib::BlockHessians one;
    for (const calib::ExpertHessians& e : r.hessians[l].experts) one.route_all.push_back(e.route_all);
    ASSERT_TRUE(calib::ForwardCollectingHessians(**block, *x, (*source)->rope(), kBatch, &one).ok());
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      for (calib::ExpertInput i : calib::kExpertInputs) {
        EXPECT_TRUE(one.experts[e].at(i).packed() == r.hessians[l].experts[e].at(i).packed())
            << "block " << l << " expert " << e << " " << calib::ExpertInputName(i);
      }
    }
    for (calib::HessianKind k : calib::kAllHessianKinds) {
      EXPECT_TRUE(one.at(k).packed() == r.hessians[l].at(k).packed()) << "block " << l;
    }
  }
}

// The exchange itself, on 2 and 3 thread-ranks over one MoE block: each rank forwards its own
// chunk (different tokens per rank) with only its experts loaded, some experts calibrating on
// every token. Each rank's block outputs must equal the whole block's on one process, bit for
// bit, and each owner's sums the integer sum of every rank's sums computed on one process. In a
// second step the last rank has no chunk; in a third its forward fails before the exchange: the
// others finish and it gets its own error.
TEST_P(MoeCalibrationTest, TheExchangeGivesOneProcesssOutputsAndSums) {
  int64_t layer = 0;
  while (!config_.IsMoeLayer(layer)) ++layer;
  const int64_t experts = config_.num_experts;
  const std::vector<bool> route_all = {true, false, false, true};
  ASSERT_EQ(experts, 4);
  for (int ranks : {2, 3}) {
    std::vector<at::Tensor> x(ranks);
    for (int r = 0; r < ranks; ++r) {
      at::manual_seed(100 + r);
      x[r] = at::randn({kBatch, kSeqLen, config_.hidden_size});
    }
    // One process: every rank's chunk through the whole block.
    auto opened = model::OpenFloatCheckpoint(model_);
    ASSERT_TRUE(opened.ok());
    auto whole = (*opened)->LoadBlock(layer);
    ASSERT_TRUE(whole.ok());
    std::vector<at::Tensor> want(ranks);
    calib::BlockHessians total;
    total.route_all = route_all;
    for (int step = 0; step < 2; ++step) {
      for (int r = 0; r < ranks; ++r) {
        if (step == 1 && r == ranks - 1) continue;
        calib::BlockHessians one;
        one.route_all = route_all;
        auto y = calib::ForwardCollectingHessians(**whole, x[r], (*opened)->rope(), kBatch, &one);
        ASSERT_TRUE(y.ok()) << y.status();
        if (step == 0) want[r] = *y;
        if (total.experts.empty()) total.experts.resize(experts);
        for (int64_t e = 0; e < experts; ++e) {
          for (calib::ExpertInput i : calib::kExpertInputs) {
            calib::HessianAccumulator& acc = total.experts[e].at(i);
            if (acc.dim() == 0) acc = calib::HessianAccumulator(one.experts[e].at(i).dim());
            ASSERT_TRUE(acc.Merge(one.experts[e].at(i)).ok());
          }
          total.experts[e].routed_tokens += one.experts[e].routed_tokens;
        }
      }
    }
    // Expert-parallel.
    auto comms = comm::MakeThreadComms(ranks);
    std::vector<at::Tensor> got(ranks);
    std::vector<calib::BlockHessians> sums(ranks);
    std::vector<Status> failed(ranks);
    std::vector<std::string> errors(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto source = model::OpenFloatCheckpoint(model_);
        if (!source.ok()) return;
        const comm::Range mine = calib::ExpertsOfRank(experts, r, ranks);
        model::BlockSelection select;
        select.expert_begin = mine.begin;
        select.expert_end = mine.end;
        auto block = (*source)->LoadBlockPart(layer, select);
        if (!block.ok()) return;
        calib::BlockHessians& h = sums[r];
        h.route_all = route_all;
        calib::ExpertExchange exchange(*comms[r], **block, &h);
        for (int step = 0; step < 3; ++step) {
          Status local;
          if (step == 0) {
            auto y = calib::ForwardCollectingMoeHessians(**block, x[r], (*source)->rope(), kBatch,
                                                         &h, &exchange);
            local = y.status();
            if (y.ok()) got[r] = *y;
          } else if (step == 1 && r != ranks - 1) {
            local = calib::ForwardCollectingMoeHessians(**block, x[r], (*source)->rope(), kBatch,
                                                        &h, &exchange).status();
          } else if (step == 2) {
            // The last rank's input has the wrong width: its forward fails before the exchange.
            const at::Tensor bad = r == ranks - 1
                                       ? at::randn({kBatch, kSeqLen, config_.hidden_size + 1})
                                       : x[r];
            calib::BlockHessians scratch;
            scratch.route_all = route_all;
            calib::ExpertExchange other(*comms[r], **block, &scratch);
            local = calib::ForwardCollectingMoeHessians(**block, bad, (*source)->rope(), kBatch,
                                                        &scratch, &other).status();
            const Status finished = other.FinishStep();
            if (local.ok()) local = finished;
            failed[r] = local;
            break;
          }
          const Status finished = exchange.FinishStep();
          if (!local.ok() || !finished.ok()) {
            errors[r] = absl::StrCat("step ", step, ": ", local.ok() ? finished.ToString()
                                                                    : local.ToString());
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      const std::string where = absl::StrCat(ranks, " ranks, rank ", r);
      EXPECT_EQ(errors[r], "") << where;
      ASSERT_TRUE(got[r].defined()) << where;
      EXPECT_TRUE(at::equal(got[r], want[r])) << where << ": the block outputs differ";
      const comm::Range mine = calib::ExpertsOfRank(experts, r, ranks);
      ASSERT_EQ(static_cast<int64_t>(sums[r].experts.size()), experts) << where;
      for (int64_t e = 0; e < experts; ++e) {
        const calib::ExpertHessians& eh = sums[r].experts[e];
        if (e < mine.begin || e >= mine.end) {
          EXPECT_EQ(eh.at(calib::ExpertInput::kDown).dim(), 0) << where << ": holds expert " << e;
          continue;
        }
        EXPECT_EQ(eh.route_all, route_all[e]) << where;
        EXPECT_EQ(eh.routed_tokens, total.experts[e].routed_tokens) << where << " expert " << e;
        for (calib::ExpertInput i : calib::kExpertInputs) {
          EXPECT_EQ(eh.at(i).count(), total.experts[e].at(i).count()) << where << " expert " << e;
          EXPECT_TRUE(eh.at(i).packed() == total.experts[e].at(i).packed())
              << where << " expert " << e << " " << calib::ExpertInputName(i);
        }
      }
      // The failed step: the last rank has its own error, the others completed their forward.
      if (r == ranks - 1) {
        EXPECT_EQ(failed[r].code(), absl::StatusCode::kInternal) << where << ": " << failed[r];
      } else {
        EXPECT_TRUE(failed[r].ok()) << where << ": " << failed[r];
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeCalibrationTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return info.param.name; });

// A cache file whose expert tables disagree is refused as damaged, naming the file.
TEST(MoeCalibrationCache, MalformedExpertTablesAreDataLoss) {
  calib::BlockHessians h;
  for (calib::HessianKind k : calib::kAllHessianKinds) h.at(k) = calib::HessianAccumulator(3);
  h.experts.resize(2);
  for (auto& e : h.experts) {
    e.at(calib::ExpertInput::kGateUp) = calib::HessianAccumulator(3);
    e.at(calib::ExpertInput::kDown) = calib::HessianAccumulator(5);
  }
  h.experts[1].routed_tokens = -4;  // impossible
  const std::string path = MakeTempDir("moe-cache") + "/block_0.safetensors";
  ASSERT_TRUE(calib::SaveBlockHessians(path, h, "key").ok());
  auto loaded = calib::LoadBlockHessians(path, "key");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(std::string(loaded.status().message()).find(path), std::string::npos);
  EXPECT_NE(std::string(loaded.status().message()).find("expert 1"), std::string::npos);
}

}  // namespace
}  // namespace qcal
