// Learned rotations (issue 17, methods/spinquant/rotation_training.h): the rotated training forward is
// the float model's function when nothing is quantized. (Training itself, its gradients and the
// fused result: tests/methods/spinquant_test.cc.)
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/hf_config.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/qsim/cayley.h"
#include "engine/qsim/rotate.h"
#include "methods/spinquant/rotation_training.h"

namespace qcal {
namespace {

double FloatLoss(const model::LlamaModel& m, const at::Tensor& tokens) {
  at::NoGradGuard no_grad;
  const int64_t s = tokens.size(1);
  const at::Tensor logits = m.Forward(tokens).narrow(1, 0, s - 1);
  return at::nll_loss(at::log_softmax(logits.reshape({-1, logits.size(-1)}), -1),
                      tokens.narrow(1, 1, s - 1).reshape({-1}))
      .item<double>();
}

TEST(RotationTrainingTest, UnquantizedRotatedForwardIsTheFloatModel) {
  model::SetComputeThreads(1);
  const std::string dir = testing::RealModelDir("stories260K");
  auto m = testing::LoadModelOrDie(dir);
  const LlamaConfig& c = m->config();
  auto plan = qsim::PlanRotations(RotationSpec{}, c);
  ASSERT_TRUE(plan.ok());
  auto dense = qsim::DenseRotations(*plan, c.num_hidden_layers);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_LT(qsim::OrthogonalityError(dense->first), 1e-12);
  const at::Tensor tokens = testing::StoryBatch(dir, 2, 64);
  methods::spinquant::RotationTrainingOptions o;
  o.weight_bits = o.act_bits = o.kv_bits = 16;
  at::NoGradGuard no_grad;
  auto loss = methods::spinquant::RotatedQuantizedLoss(*m, *plan, dense->first, dense->second, tokens, o);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const double want = FloatLoss(*m, tokens);
  std::printf("float loss %.6f, rotated %.6f\n", want, loss->item<double>());
  EXPECT_NEAR(loss->item<double>(), want, 1e-4 * want);
}

}  // namespace
}  // namespace qcal
