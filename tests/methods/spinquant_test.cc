// SpinQuant (method spinquant, issue 17): the block-streamed rotation gradients equal one autograd
// graph of the whole model; a float model's loss does not depend on the rotations (its Riemannian
// gradient vanishes); the data-parallel training lowers the fake-quantized loss, keeps the
// rotations orthogonal, gives the same rotations on 1, 2 and 3 ranks bit for bit, and resumes
// from its saved state to the same bits; the trained rotations fused keep the float function.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/quant_specs.h"
#include "common/recipe.h"
#include "methods/quarot/quarot_model.h"
#include "methods/registry.h"
#include "methods/spinquant/rotation_phase.h"
#include "methods/spinquant/spinquant_spec.h"
#include "methods/method_factory.h"
#include "tests/methods/spinquant_fixtures.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/cayley.h"
#include "engine/qsim/kv_quantizer.h"
#include "engine/qsim/rotate.h"
#include "methods/spinquant/rotation_training.h"
#include "engine/quant/scalar_quantize.h"
#include "tools/plant_outliers.h"

namespace qcal {
namespace {

namespace sq = methods::spinquant;

methods::spinquant::RotationTrainingOptions W4A4KV4(const LlamaConfig& c, int weight_bits) {
  return testing::SpinquantW4A4KV4(c, weight_bits);
}

// The tangent (Riemannian) part of a gradient G at orthogonal R: skew(RᵀG) = ½(RᵀG − GᵀR).
at::Tensor Skew(const at::Tensor& r, const at::Tensor& g) {
  const at::Tensor a = at::matmul(r.t(), g);
  return 0.5 * (a - a.t());
}

TEST(SpinquantTest, StreamedGradientsEqualOneAutogradGraph) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  const LlamaConfig& c = m->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  ASSERT_TRUE(plan.ok());
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  ASSERT_TRUE(dense.ok());
  const at::Tensor r1 = dense->first.t().contiguous();
  const at::Tensor r2 = dense->second.transpose(1, 2).contiguous();
  const at::Tensor tokens = testing::StoryBatch(dir, 1, 96);
  using Loss = methods::spinquant::RotationTrainingOptions::Loss;
  struct Case {
    int bits;
    Loss loss;
    bool range;
  };
  for (const Case& k : {Case{16, Loss::kCrossEntropy, false}, Case{4, Loss::kCrossEntropy, false},
                        Case{16, Loss::kKlToFloat, true}, Case{4, Loss::kKlToFloat, true},
                        Case{4, Loss::kCrossEntropy, true}}) {
    methods::spinquant::RotationTrainingOptions o = W4A4KV4(c, k.bits);
    o.loss = k.loss;
    o.range_gradient = k.range;
    const int bits = k.bits;
    const char* what = k.loss == Loss::kKlToFloat ? "KL" : "CE";
    // Autograd through the whole model at once.
    const at::Tensor p1 = r1.clone().requires_grad_(true);
    const at::Tensor p2 = r2.clone().requires_grad_(true);
    double want_loss = 0;
    {
      at::AutoGradMode grad(true);
      auto loss = methods::spinquant::RotatedQuantizedLoss(*m, *plan, p1.t(), p2.transpose(1, 2), tokens, o);
      ASSERT_TRUE(loss.ok()) << loss.status();
      loss->backward();
      want_loss = loss->item<double>();
    }
    // Streamed, with a zero-byte cache (every block and head chunk reloaded) and a full one.
    for (int64_t cache : {int64_t{0}, int64_t{1} << 30}) {
      auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, o, cache);
      ASSERT_TRUE(g.ok()) << g.status();
      auto r = (*g)->Sequence(r1, r2, tokens[0]);
      ASSERT_TRUE(r.ok()) << r.status();
      std::printf("W%d %s range %d cache %lld: loss %.6f (autograd %.6f), |g1| %.4g, rel diff g1 "
                  "%.2e g2 %.2e\n",
                  bits, what, k.range ? 1 : 0, static_cast<long long>(cache), r->loss, want_loss,
                  r->g1.norm().item<double>(), testing::RelMaxDiff(p1.grad(), r->g1),
                  testing::RelMaxDiff(p2.grad(), r->g2));
      EXPECT_GT(r->loss, 0);
      EXPECT_NEAR(r->loss, want_loss, 1e-5 * want_loss);
      EXPECT_GT(r->g1.abs().max().item<double>(), 0);
      EXPECT_LT(testing::RelMaxDiff(p1.grad(), r->g1), 1e-3);
      EXPECT_LT(testing::RelMaxDiff(p2.grad(), r->g2), 1e-3);
    }
  }
}

// The range gradient changes the gradient, never the loss (the forward's values are the same);
// the KL of the float model to itself is zero, with no gradient, whatever the rotations (the
// streamed KL against one autograd graph: StreamedGradientsEqualOneAutogradGraph).
TEST(SpinquantTest, KlLossAndRangeGradient) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  const LlamaConfig& c = (*source)->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  const at::Tensor r1 = dense->first.t().contiguous();
  const at::Tensor r2 = dense->second.transpose(1, 2).contiguous();
  const at::Tensor tokens = testing::StoryBatch(dir, 1, 96);
  using Loss = methods::spinquant::RotationTrainingOptions::Loss;
  auto run = [&](methods::spinquant::RotationTrainingOptions o) {
    auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, o, 1 << 30);
    EXPECT_TRUE(g.ok()) << g.status();
    auto r = (*g)->Sequence(r1, r2, tokens[0]);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  };
  methods::spinquant::RotationTrainingOptions flt;
  flt.weight_bits = flt.act_bits = flt.kv_bits = 16;
  flt.loss = Loss::kKlToFloat;
  const auto rf = run(flt);
  std::printf("float KL %.3e, |g1| %.3e\n", rf.loss, rf.g1.norm().item<double>());
  EXPECT_LT(std::fabs(rf.loss), 1e-6);
  EXPECT_LT(rf.g1.norm().item<double>(), 1e-4);
  for (int bits : {16, 4}) {
    methods::spinquant::RotationTrainingOptions o = W4A4KV4(c, bits);
    o.loss = Loss::kKlToFloat;
    const auto plain = run(o);
    o.range_gradient = true;
    const auto range = run(o);
    std::printf("W%d: KL %.6f / %.6f; |g1| identity STE %.4g, with ranges %.4g, rel diff %.3f\n",
                bits, plain.loss, range.loss, plain.g1.norm().item<double>(),
                range.g1.norm().item<double>(), testing::RelMaxDiff(range.g1, plain.g1));
    EXPECT_EQ(plain.loss, range.loss);
    EXPECT_GT(testing::RelMaxDiff(range.g1, plain.g1), 1e-2);
    EXPECT_GT(testing::RelMaxDiff(range.g2, plain.g2), 1e-2);
    EXPECT_GT(plain.loss, 1e-3);  // KL >= 0, and quantization changes the distribution
  }
}

// Nothing quantized: every rotation gives the float model's loss, so the gradient has no
// tangent component (the Cayley step is zero); quantized, it has.
TEST(SpinquantTest, FloatLossDoesNotDependOnTheRotations) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok());
  const LlamaConfig& c = (*source)->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  const at::Tensor r1 = dense->first.t().contiguous();
  const at::Tensor r2 = dense->second.transpose(1, 2).contiguous();
  const at::Tensor tokens = testing::StoryBatch(dir, 1, 96)[0];
  methods::spinquant::RotationTrainingOptions flt;
  flt.weight_bits = flt.act_bits = flt.kv_bits = 16;
  auto gf = methods::spinquant::RotationGradients::Create(source->get(), *plan, flt, 1 << 30);
  auto rf = (*gf)->Sequence(r1, r2, tokens);
  ASSERT_TRUE(rf.ok()) << rf.status();
  auto gq = methods::spinquant::RotationGradients::Create(source->get(), *plan, W4A4KV4(c, 4), 1 << 30);
  auto rq = (*gq)->Sequence(r1, r2, tokens);
  ASSERT_TRUE(rq.ok()) << rq.status();
  const double tf = Skew(r1, rf->g1).norm().item<double>();
  const double tq = Skew(r1, rq->g1).norm().item<double>();
  std::printf("tangent |skew(R1ᵀG1)|: float %.3e, W4A4KV4 %.3e (|G1| float %.3e)\n", tf, tq,
              rf->g1.norm().item<double>());
  EXPECT_LT(tf, 1e-4 * tq);
}


StatusOr<sq::RotationPhaseResult> Train(comm::Comm& comm, const std::string& dir,
                                        const at::Tensor& tokens, const sq::RotationPhaseOptions& o) {
  return testing::TrainRotations(comm, dir, tokens, o);
}

sq::RotationPhaseResult TrainOnRanks(int ranks, const std::string& dir, const at::Tensor& tokens,
                                     const sq::RotationPhaseOptions& o) {
  return testing::TrainRotationsOnRanks(ranks, dir, tokens, o);
}

sq::RotationPhaseOptions SmallRun(const LlamaConfig& c) {
  sq::RotationPhaseOptions o;
  o.training = W4A4KV4(c, 4);
  o.training.steps = 6;
  o.training.batch = 5;  // 5 sequences over 2 or 3 ranks: uneven slices
  o.cache_bytes = int64_t{1} << 30;
  return o;
}

TEST(SpinquantTest, OneTwoAndThreeRanksTrainTheSameRotationsBitForBit) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const at::Tensor tokens = testing::StoryBatch(dir, 12, 64);
  const sq::RotationPhaseOptions o = SmallRun(m->config());
  const sq::RotationPhaseResult one = TrainOnRanks(1, dir, tokens, o);
  ASSERT_TRUE(one.t1.defined());
  auto dense = qsim::DenseRotations(*qsim::PlanRotations(RotationSpec{}, m->config()),
                                    m->config().num_hidden_layers);
  EXPECT_GT((one.t1 - dense->first).abs().max().item<double>(), 1e-4);  // it moved
  for (int ranks : {2, 3}) {
    const sq::RotationPhaseResult many = TrainOnRanks(ranks, dir, tokens, o);
    ASSERT_TRUE(many.t1.defined());
    EXPECT_TRUE(at::equal(many.t1, one.t1)) << ranks << " ranks";
    EXPECT_TRUE(at::equal(many.t2, one.t2)) << ranks << " ranks";
    EXPECT_EQ(many.losses, one.losses) << ranks << " ranks";
  }
}

TEST(SpinquantTest, InterruptedTrainingResumesFromItsSavedStateToTheSameBits) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const at::Tensor tokens = testing::StoryBatch(dir, 12, 64);
  const std::string tmp = testing::MakeTempDir("spinquant-resume");
  sq::RotationPhaseOptions o = SmallRun(m->config());
  o.checkpoint_every = 2;
  o.state_key = "calibration A";
  const sq::RotationPhaseResult whole = TrainOnRanks(1, dir, tokens, o);
  ASSERT_TRUE(whole.t1.defined());
  EXPECT_EQ(whole.resumed_from, 0);

  o.state_path = tmp + "/rotations.state.safetensors";
  sq::RotationPhaseOptions stop = o;
  stop.stop_after = 3;  // the "crash": after step 3 (its state saved)
  auto comm = comm::MakeSelfComm();
  auto stopped = Train(*comm, dir, tokens, stop);
  ASSERT_FALSE(stopped.ok());
  EXPECT_TRUE(absl::IsAborted(stopped.status())) << stopped.status();
  // Resumed on two ranks: from step 3, to the uninterrupted run's bits.
  const sq::RotationPhaseResult resumed = TrainOnRanks(2, dir, tokens, o);
  EXPECT_EQ(resumed.resumed_from, 3);
  EXPECT_TRUE(at::equal(resumed.t1, whole.t1));
  EXPECT_TRUE(at::equal(resumed.t2, whole.t2));
  EXPECT_EQ(resumed.losses, whole.losses);
  // A state saved for other calibration data is not used.
  stopped = Train(*comm, dir, tokens, stop);
  sq::RotationPhaseOptions other = o;
  other.state_key = "calibration B";
  const sq::RotationPhaseResult fresh = TrainOnRanks(1, dir, tokens, other);
  EXPECT_EQ(fresh.resumed_from, 0);
  EXPECT_TRUE(at::equal(fresh.t1, whole.t1));
  // The two state files: a run stopped after step 3 saved step 2 to one and step 3 to the other.
  const std::string slot_a = o.state_path;
  const std::string slot_b = tmp + "/rotations.state.b.safetensors";
  for (const std::string& p : {slot_a, slot_b}) {
    std::filesystem::remove(p);
    std::filesystem::remove(p + ".fnv1a64");
  }
  stopped = Train(*comm, dir, tokens, stop);
  ASSERT_TRUE(absl::IsAborted(stopped.status())) << stopped.status();
  ASSERT_TRUE(std::filesystem::exists(slot_a + ".fnv1a64"));
  ASSERT_TRUE(std::filesystem::exists(slot_b + ".fnv1a64"));
  // A kill between a save's rename and its checksum leaves the newer file with the older
  // checksum: that file is refused and the run resumes from the other, one checkpoint older.
  auto read = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::string newer = slot_b, older = slot_a;  // step 3 went to the second file
  {
    std::ofstream(newer + ".fnv1a64", std::ios::binary) << read(older + ".fnv1a64");
  }
  const sq::RotationPhaseResult fallback = TrainOnRanks(1, dir, tokens, o);
  EXPECT_EQ(fallback.resumed_from, 2);
  EXPECT_TRUE(at::equal(fallback.t1, whole.t1));
  EXPECT_TRUE(at::equal(fallback.t2, whole.t2));
  EXPECT_EQ(fallback.losses, whole.losses);
  // Both damaged: training starts over (and still ends at the same bits).
  for (const std::string& p : {slot_a, slot_b}) {
    std::FILE* f = std::fopen(p.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, -8, SEEK_END);
    std::fputc('X', f);
    std::fclose(f);
  }
  const sq::RotationPhaseResult again = TrainOnRanks(1, dir, tokens, o);
  EXPECT_EQ(again.resumed_from, 0);
  EXPECT_TRUE(at::equal(again.t1, whole.t1));
}

// The forward-only held-out losses (RotationGradients::Losses, block-major) are the losses the
// training path computes (Sequence) and the one-graph reference's, for both losses and with the
// weights fake-quantized; a sequence's loss has the same bits alone or among others.
TEST(SpinquantTest, HeldOutLossesEqualTheTrainingLosses) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  const LlamaConfig& c = m->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  at::manual_seed(11);
  const at::Tensor t1 =
      std::get<0>(at::linalg_qr(at::randn({c.hidden_size, c.hidden_size}, at::kDouble)));
  const at::Tensor t2 = std::get<0>(at::linalg_qr(
      at::randn({c.num_hidden_layers, c.head_dim, c.head_dim}, at::kDouble)));
  const at::Tensor r1 = t1.t().contiguous(), r2 = t2.transpose(1, 2).contiguous();
  const at::Tensor tokens = testing::StoryBatch(dir, 3, 64);
  using Loss = methods::spinquant::RotationTrainingOptions::Loss;
  for (Loss loss : {Loss::kCrossEntropy, Loss::kKlToFloat}) {
    methods::spinquant::RotationTrainingOptions o = W4A4KV4(c, 4);
    o.loss = loss;
    auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, o, 1 << 30);
    ASSERT_TRUE(g.ok()) << g.status();
    auto all = (*g)->Losses(r1, r2, tokens, o);
    ASSERT_TRUE(all.ok()) << all.status();
    ASSERT_EQ(all->size(), 3u);
    for (int64_t i = 0; i < 3; ++i) {
      auto seq = (*g)->Sequence(r1, r2, tokens[i]);
      ASSERT_TRUE(seq.ok()) << seq.status();
      auto one = (*g)->Losses(r1, r2, tokens.narrow(0, i, 1), o);
      ASSERT_TRUE(one.ok()) << one.status();
      double graph = 0;
      {
        at::NoGradGuard no_grad;
        graph = methods::spinquant::RotatedQuantizedLoss(*m, *plan, t1, t2, tokens.narrow(0, i, 1), o)
                    ->item<double>();
      }
      std::printf("%s, sequence %ld: held-out %.8f, training %.8f, one graph %.8f\n",
                  loss == Loss::kKlToFloat ? "KL" : "CE", static_cast<long>(i), (*all)[i],
                  seq->loss, graph);
      EXPECT_EQ((*one)[0], (*all)[i]);
      EXPECT_NEAR((*all)[i], seq->loss, 1e-5 * seq->loss);
      EXPECT_NEAR((*all)[i], graph, 1e-4 * graph);
    }
  }
  // Other options than the instance's (the weights at 4 bits where training keeps them float):
  // the loss of those quantizers, not of training's.
  methods::spinquant::RotationTrainingOptions w16 = W4A4KV4(c, 16), w4 = W4A4KV4(c, 4);
  w16.loss = w4.loss = Loss::kKlToFloat;
  auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, w16, 1 << 30);
  ASSERT_TRUE(g.ok()) << g.status();
  auto float_weights = (*g)->Losses(r1, r2, tokens, w16);
  auto rounded = (*g)->Losses(r1, r2, tokens, w4);
  ASSERT_TRUE(float_weights.ok() && rounded.ok());
  at::NoGradGuard no_grad;
  const double graph =
      methods::spinquant::RotatedQuantizedLoss(*m, *plan, t1, t2, tokens.narrow(0, 0, 1), w4)->item<double>();
  EXPECT_NEAR((*rounded)[0], graph, 1e-4 * graph);
  EXPECT_GT((*rounded)[0], (*float_weights)[0]);
}

// init: best starts from whichever of the Hadamards and the identity has the lower loss (each
// measured here through the one-graph reference): the Hadamards on stories260K, the identity on
// its outlier-planted variant (where R1 spreads a planted ×50 channel over every channel).
TEST(SpinquantTest, BestInitStartsFromTheLowerLossStart) {
  model::SetComputeThreads(1);
  const std::string plain = testing::RealModelDir("stories260K");
  const std::string planted = testing::MakeTempDir("spinquant-init") + "/planted";
  auto p = tools::PlantOutliers(plain, planted, tools::PlantOutliersOptions{});
  ASSERT_TRUE(p.ok()) << p.status();
  const at::Tensor tokens = testing::StoryBatch(plain, 12, 64);
  for (const std::string& dir : {plain, planted}) {
    auto m = testing::LoadModelOrDie(dir);
    const LlamaConfig& c = m->config();
    sq::RotationPhaseOptions o;
    o.training = W4A4KV4(c, 16);
    o.training.loss = methods::spinquant::RotationTrainingOptions::Loss::kKlToFloat;
    o.training.steps = 1;
    o.training.batch = 2;  // the start is chosen on the first 4·2 = 8 sequences
    o.choose_init = true;
    o.cache_bytes = int64_t{1} << 30;
    auto plan = qsim::PlanRotations(RotationSpec{}, c);
    auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
    const int64_t d = c.head_dim, layers = c.num_hidden_layers;
    double lh = 0, li = 0;
    {
      at::NoGradGuard no_grad;
      const at::Tensor first = tokens.narrow(0, 0, 8);
      lh = methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, first, o.training)
               ->item<double>();
      li = methods::spinquant::RotatedQuantizedLoss(
               *m, *plan, at::eye(c.hidden_size, at::kDouble),
               at::eye(d, at::kDouble).expand({layers, d, d}).contiguous(), first, o.training)
               ->item<double>();
    }
    auto comm = comm::MakeSelfComm();
    auto r = Train(*comm, dir, tokens, o);
    ASSERT_TRUE(r.ok()) << r.status();
    std::printf("%s: start loss Hadamard %.6f, identity %.6f; the run started from the %s\n",
                dir == plain ? "stories260K" : "planted", lh, li, r->init.c_str());
    ASSERT_GT(std::fabs(lh - li), 1e-3 * lh);  // a clear choice
    EXPECT_EQ(r->init, li < lh ? "identity" : "hadamard");
    EXPECT_EQ(r->init, dir == plain ? "hadamard" : "identity");
  }
}

// Held-out selection: the last `validation` sequences are scored at the start, every
// checkpoint_every steps and at the end; the result is the earliest best-scoring rotations (their
// score recomputed here is the recorded one), the same on 1 and 3 ranks bit for bit, and an
// interrupted run resumes (best rotations and scores included) to the uninterrupted run's bits.
TEST(SpinquantTest, HeldOutSelectionKeepsTheBestScoredRotations) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const LlamaConfig& c = m->config();
  const at::Tensor tokens = testing::StoryBatch(dir, 12, 64);
  sq::RotationPhaseOptions o = SmallRun(c);
  o.training = W4A4KV4(c, 16);
  o.training.lr = 0.2;
  o.training.steps = 7;
  o.training.batch = 5;
  o.checkpoint_every = 2;
  o.validation = 4;  // train on 8, score on 4
  o.validation_options = W4A4KV4(c, 4);
  const sq::RotationPhaseResult one = TrainOnRanks(1, dir, tokens, o);
  ASSERT_TRUE(one.t1.defined());
  std::vector<int64_t> steps;
  for (const auto& [step, score] : one.validation) {
    steps.push_back(step);
    std::printf("held-out loss after %ld steps: %.6f\n", static_cast<long>(step), score);
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 4, 6, 7}));
  double best = one.validation[0].second;
  int64_t best_step = 0;
  for (const auto& [step, score] : one.validation) {
    if (score < best) best = score, best_step = step;
  }
  EXPECT_EQ(one.selected_step, best_step);
  EXPECT_EQ(one.losses.size(), 7u);  // every step trained; the result is the best scored
  auto source = model::OpenFloatCheckpoint(dir);
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, o.training, 1 << 30);
  auto rescored = (*g)->Losses(one.t1.t().contiguous(), one.t2.transpose(1, 2).contiguous(),
                               tokens.narrow(0, 8, 4), o.validation_options);
  ASSERT_TRUE(rescored.ok()) << rescored.status();
  double mean = 0;
  for (double v : *rescored) mean += v / 4;
  EXPECT_NEAR(mean, best, 1e-12);
  EXPECT_GT(best_step, 0);  // here training helped (the other case: below)
  // The selection with other scores: distance from the start (the start is best and returned
  // exactly), its negative (the farthest checkpoint), a constant (the earliest, the start).
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  const at::Tensor start1 = dense->first.t().contiguous();
  std::map<int64_t, double> distance;  // distance of the rotations scored, by call
  auto by = [&](double sign) {
    return [&, sign](const at::Tensor& r1, const at::Tensor&, const at::Tensor&,
                     const at::Tensor& held) -> StatusOr<double> {
      EXPECT_EQ(held.size(0), 4);
      const double dist = (r1 - start1).norm().item<double>();
      distance[static_cast<int64_t>(distance.size())] = dist;
      return sign * dist;
    };
  };
  sq::RotationPhaseOptions near = o;
  near.held_out_score = by(1.0);
  const sq::RotationPhaseResult kept = TrainOnRanks(1, dir, tokens, near);
  EXPECT_EQ(kept.selected_step, 0);
  EXPECT_TRUE(at::equal(kept.t1, dense->first));
  EXPECT_TRUE(at::equal(kept.t2, dense->second));
  EXPECT_EQ(kept.losses, one.losses);  // the same training, another choice
  distance.clear();
  sq::RotationPhaseOptions far = o;
  far.held_out_score = by(-1.0);
  const sq::RotationPhaseResult farthest = TrainOnRanks(1, dir, tokens, far);
  ASSERT_EQ(distance.size(), 5u);
  int64_t arg = 0;
  for (const auto& [i, dist] : distance) {
    if (dist > distance[arg]) arg = i;
  }
  EXPECT_EQ(farthest.selected_step, farthest.validation[arg].first);
  EXPECT_NEAR((farthest.t1.t() - start1).norm().item<double>(), distance[arg], 1e-12);
  sq::RotationPhaseOptions flat = o;
  flat.held_out_score = [](const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&) -> StatusOr<double> { return 1.0; };
  EXPECT_EQ(TrainOnRanks(1, dir, tokens, flat).selected_step, 0);

  const sq::RotationPhaseResult three = TrainOnRanks(3, dir, tokens, o);
  EXPECT_TRUE(at::equal(three.t1, one.t1));
  EXPECT_TRUE(at::equal(three.t2, one.t2));
  EXPECT_EQ(three.validation, one.validation);
  EXPECT_EQ(three.selected_step, one.selected_step);

  // Interrupted after step 3 (between checkpoints), resumed on two ranks.
  const std::string tmp = testing::MakeTempDir("spinquant-heldout");
  o.state_path = tmp + "/rotations.state.safetensors";
  o.state_key = "calibration A";
  sq::RotationPhaseOptions stop = o;
  stop.stop_after = 3;
  auto comm = comm::MakeSelfComm();
  auto stopped = Train(*comm, dir, tokens, stop);
  ASSERT_TRUE(absl::IsAborted(stopped.status())) << stopped.status();
  const sq::RotationPhaseResult resumed = TrainOnRanks(2, dir, tokens, o);
  EXPECT_EQ(resumed.resumed_from, 3);
  EXPECT_TRUE(at::equal(resumed.t1, one.t1));
  EXPECT_TRUE(at::equal(resumed.t2, one.t2));
  EXPECT_EQ(resumed.validation, one.validation);
  EXPECT_EQ(resumed.selected_step, one.selected_step);
  EXPECT_EQ(resumed.init, one.init);
  EXPECT_EQ(resumed.losses, one.losses);
  // All sequences held out leaves nothing to train on.
  sq::RotationPhaseOptions none = o;
  none.state_path.clear();
  none.validation = 12;
  auto refused = Train(*comm, dir, tokens, none);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
}

// W4A4KV4 training (RTN weights in the forward) lowers the loss on its data, keeps R1/R2
// orthogonal to 1e-6, and fused into the float model the trained rotations keep its logits.
TEST(SpinquantTest, TrainingLowersTheQuantizedLossAndTheFusedRotationsKeepTheFunction) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const LlamaConfig& c = m->config();
  const at::Tensor tokens = testing::StoryBatch(dir, 32, 64);
  sq::RotationPhaseOptions o;
  o.training = W4A4KV4(c, 4);
  o.training.steps = 60;
  o.training.batch = 8;
  o.cache_bytes = int64_t{1} << 30;
  auto comm = comm::MakeSelfComm();
  auto r = Train(*comm, dir, tokens, o);
  ASSERT_TRUE(r.ok()) << r.status();
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += r->losses[i] / 10;
    last += r->losses[r->losses.size() - 10 + i] / 10;
  }
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  double before = 0, after = 0;
  {
    at::NoGradGuard no_grad;
    before = methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens,
                                        o.training)->item<double>();
    after = methods::spinquant::RotatedQuantizedLoss(*m, *plan, r->t1, r->t2, tokens, o.training)
                ->item<double>();
  }
  std::printf("training loss, mean of the first / last 10 steps: %.4f / %.4f; on all 32 "
              "sequences: Hadamard %.4f, trained %.4f\n", first, last, before, after);
  EXPECT_LT(after, before);
  EXPECT_LT(qsim::OrthogonalityError(r->t1), 1e-6);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    EXPECT_LT(qsim::OrthogonalityError(r->t2[l]), 1e-6) << l;
  }
  ASSERT_TRUE(qsim::SetLearnedRotations(&*plan, r->t1, r->t2, c.num_hidden_layers).ok());
  auto rotated = testing::LoadModelOrDie(dir);
  ASSERT_TRUE(qsim::RotateModel(*rotated, *plan).ok());
  const at::Tensor ids = testing::StoryBatch(dir, 2, 96);
  at::NoGradGuard no_grad;
  EXPECT_LT(testing::RelMaxDiff(rotated->Forward(ids), m->Forward(ids)), 1e-4);
}


// The training forward is the simulated inference the checkpoint will run: for learned (here
// random orthogonal, non-symmetric) T1/T2, RotatedQuantizedLoss with the recipe's quantizers and
// float weights equals the loss of QuaRot's prepared model (rotations fused, R3/R4 and the A4KV4
// quantizers installed) on the same tokens.
TEST(SpinquantTest, TrainingForwardIsTheInferenceItOptimisesFor) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const LlamaConfig& c = m->config();
  auto recipe = ParseRecipe(
      "method: quarot\nweights: none\nactivations: {bits: 4, clip: 0.9}\n"
      "kv_cache: {bits: 4, clip: 0.95}\n", "test");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  at::manual_seed(3);
  const at::Tensor t1 = std::get<0>(at::linalg_qr(at::randn({c.hidden_size, c.hidden_size}, at::kDouble)));
  std::vector<at::Tensor> t2s;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    t2s.push_back(std::get<0>(at::linalg_qr(at::randn({c.head_dim, c.head_dim}, at::kDouble))));
  }
  const at::Tensor t2 = at::stack(t2s);
  ASSERT_TRUE(qsim::SetLearnedRotations(&*plan, t1, t2, c.num_hidden_layers).ok());
  const at::Tensor tokens = testing::StoryBatch(dir, 4, 96);
  methods::spinquant::RotationTrainingOptions o = W4A4KV4(c, 16);
  double train = 0;
  {
    at::NoGradGuard no_grad;
    train = methods::spinquant::RotatedQuantizedLoss(*m, *plan, t1, t2, tokens, o)->item<double>();
  }
  auto inference = testing::LoadModelOrDie(dir);
  ASSERT_TRUE(methods::quarot::PrepareModel(*inference, *recipe, *plan).ok());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    ASSERT_TRUE(methods::quarot::InstallQuantizedInference(inference->mutable_block(l), c, l,
                                                           *recipe, *plan).ok());
  }
  at::NoGradGuard no_grad;
  const int64_t s = tokens.size(1);
  const at::Tensor logits = inference->Forward(tokens).narrow(1, 0, s - 1);
  const double infer = at::nll_loss(at::log_softmax(logits.reshape({-1, logits.size(-1)}), -1),
                                    tokens.narrow(1, 1, s - 1).reshape({-1})).item<double>();
  std::printf("A4KV4, random orthogonal T1/T2: training forward %.6f, inference %.6f\n", train,
              infer);
  EXPECT_NEAR(train, infer, 2e-3 * infer);
}


// The method refuses to prepare blocks or non-block rows until it is bound to the rotations
// phase's products (so a job can never fall back to the Hadamards silently); binding refuses
// missing or non-orthogonal products; the bound method fuses the learned matrices.
TEST(SpinquantTest, UnboundMethodRefusesToPrepareAndBindingChecksTheProducts) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok());
  const LlamaConfig& c = (*source)->config();
  auto recipe = LoadRecipe(testing::SourceDir() + "/jobs/spinquant-w4a4kv4.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  auto method = methods::MakeMethod(*recipe, c);
  ASSERT_TRUE(method.ok()) << method.status();
  auto block = (*source)->LoadBlockWeights(0);
  ASSERT_TRUE(block.ok());
  Status s = (*method)->transform().PrepareBlock(0, &*block);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("not bound"), std::string::npos) << s;
  auto rows = (*method)->transform().PrepareEmbeddingRows(at::zeros({2, c.hidden_size}));
  EXPECT_TRUE(absl::IsFailedPrecondition(rows.status())) << rows.status();

  // Made with the products (as a job makes it once the phase has run).
  auto bind = [&](const Recipe& r, const methods::PhaseProductsByName& p) {
    return methods::MakeMethod(r, c, p);
  };
  methods::PhaseProductsByName phases;
  phases[sq::kRotationsPhase] = {};
  auto none = bind(*recipe, phases);
  EXPECT_TRUE(absl::IsFailedPrecondition(none.status())) << none.status();
  EXPECT_NE(std::string(none.status().message()).find("(r1, r2) are missing"), std::string::npos);
  at::manual_seed(5);
  const at::Tensor t1 =
      std::get<0>(at::linalg_qr(at::randn({c.hidden_size, c.hidden_size}, at::kDouble)));
  const at::Tensor t2 =
      at::eye(c.head_dim, at::kDouble).expand({c.num_hidden_layers, c.head_dim, c.head_dim})
          .contiguous();
  phases[sq::kRotationsPhase] = {{"r1", t1 * 1.01}, {"r2", t2}};  // not orthogonal
  auto skewed = bind(*recipe, phases);
  EXPECT_FALSE(skewed.ok());
  EXPECT_NE(std::string(skewed.status().message()).find("trained rotations"), std::string::npos)
      << skewed.status();
  // The shipped recipe trains smoothing scales: binding needs them, of the right shape.
  phases[sq::kRotationsPhase] = {{"r1", t1}, {"r2", t2}};
  auto unsmoothed = bind(*recipe, phases);
  EXPECT_TRUE(absl::IsFailedPrecondition(unsmoothed.status())) << unsmoothed.status();
  EXPECT_NE(std::string(unsmoothed.status().message()).find("smoothing scales"),
            std::string::npos) << unsmoothed.status();
  const int64_t ns = methods::spinquant::SmoothingSize(c);
  phases[sq::kRotationsPhase]["smooth"] = at::zeros({c.num_hidden_layers, ns + 1}, at::kDouble);
  EXPECT_FALSE(bind(*recipe, phases).ok());
  const at::Tensor a = at::randn({c.num_hidden_layers, ns}, at::kDouble) * 0.5;
  phases[sq::kRotationsPhase]["smooth"] = a;
  auto bound = bind(*recipe, phases);
  ASSERT_TRUE(bound.ok()) << bound.status();
  ASSERT_NE(bound->get(), nullptr);
  // Block 1 prepared with the scales = its weights with block 1's scales fused, prepared with
  // none (zeros).
  phases[sq::kRotationsPhase]["smooth"] = at::zeros({c.num_hidden_layers, ns}, at::kDouble);
  auto plain = bind(*recipe, phases);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto b1 = (*source)->LoadBlockWeights(1);
  auto b1_smoothed = (*source)->LoadBlockWeights(1);
  ASSERT_TRUE(b1.ok() && b1_smoothed.ok());
  ASSERT_TRUE((*bound)->transform().PrepareBlock(1, &*b1).ok());
  ASSERT_TRUE(methods::spinquant::SmoothBlockWeights(c, a[1], &*b1_smoothed).ok());
  ASSERT_TRUE((*plain)->transform().PrepareBlock(1, &*b1_smoothed).ok());
  for (model::LinearKind k : model::kAllLinears) {
    EXPECT_TRUE(at::equal(b1->linear(k).DenseWeight(), b1_smoothed->linear(k).DenseWeight()))
        << static_cast<int>(k);
  }
  ASSERT_TRUE((*bound)->transform().PrepareBlock(0, &*block).ok());
  // A recipe that trains no scales refuses a phase that brings some (other training settings).
  auto plain_recipe = ParseRecipe(
      "method: spinquant\nweights: gptq\nbits: 4\nactivations: {bits: 4}\nkv_cache: {bits: 4}\n",
      "no-smoothing");
  ASSERT_TRUE(plain_recipe.ok()) << plain_recipe.status();
  auto plain_method = methods::MakeMethod(*plain_recipe, c);
  ASSERT_TRUE(plain_method.ok()) << plain_method.status();
  auto stray = bind(*plain_recipe, phases);
  EXPECT_TRUE(absl::IsFailedPrecondition(stray.status())) << stray.status();
  EXPECT_NE(std::string(stray.status().message()).find("the recipe trains none"),
            std::string::npos) << stray.status();
  phases[sq::kRotationsPhase].erase("smooth");
  EXPECT_TRUE(bind(*plain_recipe, phases).ok());
  // The bound embedding rows are E·T1ᵀ.
  const at::Tensor ids = at::arange(0, 4, at::kLong);
  auto e = (*source)->Embed(ids);
  auto rotated = (*bound)->transform().PrepareEmbeddingRows(*e);
  ASSERT_TRUE(rotated.ok()) << rotated.status();
  EXPECT_LT(testing::RelMaxDiff(at::matmul(e->to(at::kDouble), t1.t()), rotated->to(at::kDouble)),
            1e-6);
}

}  // namespace
}  // namespace qcal
