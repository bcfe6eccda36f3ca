// SpinQuant's jointly trained smoothing scales (training.smooth; AMD Quark's O = D·R where the
// rotations that follow stay fixed: K's RoPE pairs before R3, the down_proj input before R4):
// the scales keep the float function (in the training forward and fused into the weights), the
// block-streamed gradients of the scales equal one autograd graph, training is bit-identical on
// 1 and 2 ranks and resumes to the same bits, and on a model with a planted K-cache spike the
// trained scales shrink the spiked RoPE pair (what R3, fixed, cannot do) and the quantized loss
// falls.
#include <cstdio>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "methods/spinquant/rotation_phase.h"
#include "tests/methods/spinquant_fixtures.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "engine/qsim/rotate.h"
#include "methods/spinquant/rotation_training.h"
#include "tools/plant_outliers.h"

namespace qcal {
namespace {

namespace sq = methods::spinquant;

// The recipe's W{weight_bits}A4KV4 quantizers, the KL loss and the range gradient (the shipped
// recipes' training), with smoothing scales.
methods::spinquant::RotationTrainingOptions Options(const LlamaConfig& c, int weight_bits) {
  methods::spinquant::RotationTrainingOptions o = testing::SpinquantW4A4KV4(c, weight_bits);
  o.loss = methods::spinquant::RotationTrainingOptions::Loss::kKlToFloat;
  o.range_gradient = true;
  o.smooth = true;
  return o;
}

// Random log-scales, |a| up to about 1.5 (factors 0.2 .. 4.5).
at::Tensor RandomScales(const LlamaConfig& c, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn({c.num_hidden_layers, methods::spinquant::SmoothingSize(c)}, g, at::kDouble) * 0.5;
}

TEST(SpinquantSmoothTest, ScalesKeepTheFloatFunction) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const LlamaConfig& c = m->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  ASSERT_TRUE(plan.ok());
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  ASSERT_TRUE(dense.ok());
  const at::Tensor a = RandomScales(c, 7);
  const at::Tensor tokens = testing::StoryBatch(dir, 2, 64);
  at::NoGradGuard no_grad;
  // The training forward of the float model (nothing quantized): the same loss with and without
  // the scales (cross-entropy: the KL of the float model to itself is 0 either way).
  methods::spinquant::RotationTrainingOptions f;
  f.weight_bits = f.act_bits = f.kv_bits = 16;
  f.smooth = true;
  const double plain =
      methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens, f)->item<double>();
  auto smoothed = methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens, f, a);
  ASSERT_TRUE(smoothed.ok()) << smoothed.status();
  std::printf("float loss: %.7f, with random scales %.7f\n", plain, smoothed->item<double>());
  EXPECT_NEAR(smoothed->item<double>(), plain, 1e-5 * plain);
  // With the A4KV4 quantizers the scales change the loss (they are what training moves).
  const methods::spinquant::RotationTrainingOptions q = Options(c, 16);
  const double q0 =
      methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens, q)->item<double>();
  const double q1 = methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens, q, a)
                        ->item<double>();
  std::printf("W16A4KV4 KL: %.6f, with random scales %.6f\n", q0, q1);
  EXPECT_GT(std::fabs(q1 - q0), 1e-3 * q0);
  // Fused into the weights (what inference runs): the float model's logits.
  auto smooth_model = testing::LoadModelOrDie(dir);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    ASSERT_TRUE(
        methods::spinquant::SmoothBlockWeights(c, a[l], &smooth_model->mutable_block(l).mutable_weights()).ok());
  }
  const at::Tensor ids = testing::StoryBatch(dir, 2, 96);
  const double diff = testing::RelMaxDiff(smooth_model->Forward(ids), m->Forward(ids));
  std::printf("fused scales: logits rel max diff %.2e\n", diff);
  EXPECT_LT(diff, 1e-4);
  // Bad scales are refused with what is wrong.
  model::BlockWeights& w = smooth_model->mutable_block(0).mutable_weights();
  auto wrong = methods::spinquant::SmoothBlockWeights(c, a[0].narrow(0, 0, 5), &w);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  at::Tensor inf = a[0].clone();
  inf[3] = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(absl::IsInvalidArgument(methods::spinquant::SmoothBlockWeights(c, inf, &w)));
}

TEST(SpinquantSmoothTest, StreamedScaleGradientsEqualOneAutogradGraph) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  const LlamaConfig& c = m->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  const at::Tensor r1 = dense->first.t().contiguous();
  const at::Tensor r2 = dense->second.transpose(1, 2).contiguous();
  const at::Tensor a = RandomScales(c, 11);
  const at::Tensor tokens = testing::StoryBatch(dir, 1, 96);
  for (int bits : {16, 4}) {
    const methods::spinquant::RotationTrainingOptions o = Options(c, bits);
    const at::Tensor p1 = r1.clone().requires_grad_(true);
    const at::Tensor p2 = r2.clone().requires_grad_(true);
    const at::Tensor ps = a.clone().requires_grad_(true);
    double want = 0;
    {
      at::AutoGradMode grad(true);
      auto loss = methods::spinquant::RotatedQuantizedLoss(*m, *plan, p1.t(), p2.transpose(1, 2), tokens, o, ps);
      ASSERT_TRUE(loss.ok()) << loss.status();
      loss->backward();
      want = loss->item<double>();
    }
    for (int64_t cache : {int64_t{0}, int64_t{1} << 30}) {
      auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, o, cache);
      ASSERT_TRUE(g.ok()) << g.status();
      auto r = (*g)->Sequence(r1, r2, tokens[0], a);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_TRUE(r->gs.defined());
      std::printf("W%d cache %lld: loss %.6f (autograd %.6f), |gs| %.4g, rel diff gs %.2e g1 %.2e "
                  "g2 %.2e\n", bits, static_cast<long long>(cache), r->loss, want,
                  r->gs.norm().item<double>(), testing::RelMaxDiff(ps.grad(), r->gs),
                  testing::RelMaxDiff(p1.grad(), r->g1), testing::RelMaxDiff(p2.grad(), r->g2));
      EXPECT_NEAR(r->loss, want, 1e-5 * want);
      EXPECT_GT(r->gs.abs().max().item<double>(), 0);
      EXPECT_LT(testing::RelMaxDiff(ps.grad(), r->gs), 1e-3);
      EXPECT_LT(testing::RelMaxDiff(p1.grad(), r->g1), 1e-3);
      EXPECT_LT(testing::RelMaxDiff(p2.grad(), r->g2), 1e-3);
      // The held-out (forward-only) loss with the same scales.
      auto held = (*g)->Losses(r1, r2, tokens.narrow(0, 0, 1), o, a);
      ASSERT_TRUE(held.ok()) << held.status();
      EXPECT_NEAR((*held)[0], want, 1e-5 * want);
    }
    // Without the unfused down_proj (smooth off at creation) the scales cannot be applied.
    methods::spinquant::RotationTrainingOptions off = o;
    off.smooth = false;
    auto g = methods::spinquant::RotationGradients::Create(source->get(), *plan, off, 0);
    ASSERT_TRUE(g.ok());
    EXPECT_FALSE((*g)->Sequence(r1, r2, tokens[0], a).ok());
  }
}

StatusOr<sq::RotationPhaseResult> Train(comm::Comm& comm, const std::string& dir,
                                        const at::Tensor& tokens, const sq::RotationPhaseOptions& o) {
  return testing::TrainRotations(comm, dir, tokens, o);
}

sq::RotationPhaseResult TrainOnRanks(int ranks, const std::string& dir, const at::Tensor& tokens,
                                     const sq::RotationPhaseOptions& o) {
  return testing::TrainRotationsOnRanks(ranks, dir, tokens, o);
}

// stories260K with a K-cache spike only: RoPE pair k of every KV head × 50 (W_q ÷ 50).
TEST(SpinquantSmoothTest, TrainedScalesUndoAPlantedKSpikeOnAnyRankCountAndResume) {
  model::SetComputeThreads(1);
  const std::string plain = testing::RealModelDir("stories260K");
  const std::string tmp = testing::MakeTempDir("spinquant-smooth");
  tools::PlantOutliersOptions plant;
  plant.alpha = 1.0;  // no down_proj / o_proj planting
  plant.beta = 50.0;
  auto planted = tools::PlantOutliers(plain, tmp + "/planted", plant);
  ASSERT_TRUE(planted.ok()) << planted.status();
  const std::string dir = tmp + "/planted";
  const LlamaConfig& c = planted->config;
  const at::Tensor tokens = testing::StoryBatch(plain, 16, 64);
  sq::RotationPhaseOptions o;
  o.training = Options(c, 16);
  o.training.steps = 8;
  o.training.batch = 5;  // uneven slices over 2 ranks
  o.training.lr = 0.01;
  o.training.smooth_lr = 0.3;
  o.cache_bytes = int64_t{1} << 30;
  o.checkpoint_every = 2;
  o.state_key = "calibration A";
  // Learning: the recipes' 100 steps on one rank.
  sq::RotationPhaseOptions learn = o;
  learn.training.steps = 100;
  learn.training.batch = 4;
  learn.training.smooth_lr = 0.1;
  const sq::RotationPhaseResult trained = TrainOnRanks(1, dir, tokens, learn);
  ASSERT_TRUE(trained.smooth.defined());
  ASSERT_EQ(trained.smooth.size(0), c.num_hidden_layers);
  ASSERT_EQ(trained.smooth.size(1), methods::spinquant::SmoothingSize(c));
  // The spiked pair's log-scale grows (K ÷ e^a) beyond its head's other pairs'.
  const int64_t half = c.head_dim / 2;
  double mean_margin = 0, min_margin = 1e9;
  int64_t spiked = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (int64_t p : planted->plan[l].k_pairs) {
      const at::Tensor head = trained.smooth[l].narrow(0, (p / half) * half, half);
      const double a = head[p % half].item<double>();
      const double others = (head.sum().item<double>() - a) / static_cast<double>(half - 1);
      mean_margin += a - others;
      min_margin = std::min(min_margin, a - others);
      ++spiked;
    }
  }
  mean_margin /= static_cast<double>(spiked);
  const size_t n = trained.losses.size();
  double first = 0, last = 0;
  for (size_t i = 0; i < 5; ++i) {
    first += trained.losses[i] / 5;
    last += trained.losses[n - 5 + i] / 5;
  }
  std::printf("a spiked pair's log-scale over its head's other pairs' mean: mean %.3f, smallest "
              "%.3f (ln 50 = 3.91); training loss first / last 5 steps %.4f / %.4f\n",
              mean_margin, min_margin, first, last);
  EXPECT_GT(mean_margin, 2.0);  // measured: 3.03, smallest 1.74, loss 2.60 -> 0.57
  EXPECT_GT(min_margin, 1.0);
  EXPECT_LT(last, 0.5 * first);

  const sq::RotationPhaseResult one = TrainOnRanks(1, dir, tokens, o);
  ASSERT_TRUE(one.smooth.defined());
  // Two ranks: the same bits.
  const sq::RotationPhaseResult two = TrainOnRanks(2, dir, tokens, o);
  ASSERT_TRUE(two.smooth.defined());
  EXPECT_TRUE(at::equal(two.smooth, one.smooth));
  EXPECT_TRUE(at::equal(two.t1, one.t1));
  EXPECT_TRUE(at::equal(two.t2, one.t2));
  EXPECT_EQ(two.losses, one.losses);
  // Interrupted after step 3 (state saved), resumed on two ranks: the same bits (the scales'
  // Adam moments are part of the state).
  sq::RotationPhaseOptions saved = o;
  saved.state_path = tmp + "/rotations.state.safetensors";
  sq::RotationPhaseOptions stop = saved;
  stop.stop_after = 3;
  auto comm = comm::MakeSelfComm();
  auto stopped = Train(*comm, dir, tokens, stop);
  ASSERT_FALSE(stopped.ok());
  EXPECT_TRUE(absl::IsAborted(stopped.status())) << stopped.status();
  const sq::RotationPhaseResult resumed = TrainOnRanks(2, dir, tokens, saved);
  EXPECT_EQ(resumed.resumed_from, 3);
  EXPECT_TRUE(at::equal(resumed.smooth, one.smooth));
  EXPECT_TRUE(at::equal(resumed.t1, one.t1));
  EXPECT_EQ(resumed.losses, one.losses);
  // A state saved without scales (smooth off) is not resumed with them.
  sq::RotationPhaseOptions no_smooth = stop;
  no_smooth.training.smooth = false;
  EXPECT_FALSE(Train(*comm, dir, tokens, no_smooth).ok());  // stops after 3 again, saved
  const sq::RotationPhaseResult fresh = TrainOnRanks(1, dir, tokens, saved);
  EXPECT_EQ(fresh.resumed_from, 0);
  EXPECT_TRUE(at::equal(fresh.smooth, one.smooth));
}

}  // namespace
}  // namespace qcal
