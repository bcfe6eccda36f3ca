// Shared by the SpinQuant tests (spinquant_test.cc, spinquant_smooth_test.cc): the recipe's
// training quantizers and the rotations phase run on threads as ranks.
#pragma once

#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/quant_specs.h"
#include "methods/spinquant/rotation_phase.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/kv_quantizer.h"
#include "engine/qsim/rotate.h"
#include "methods/spinquant/rotation_training.h"
#include "engine/quant/scalar_quantize.h"

namespace qcal::testing {

// The recipe's quantizers (QuaRot W4A4KV4: symmetric per-token activations with clip 0.9, int4
// asymmetric K/V per head with clip 0.95, weights RTN per channel with clip search), as the
// spinquant method hands them to training.
inline methods::spinquant::RotationTrainingOptions SpinquantW4A4KV4(const LlamaConfig& c, int weight_bits) {
  methods::spinquant::RotationTrainingOptions o;
  o.weight_bits = weight_bits;
  ActivationQuantSpec a;
  a.bits = 4;
  a.clip = 0.9;
  o.act_quantizer = *qsim::ActivationQuantizer::Create(a);
  KvCacheSpec k;
  k.bits = 4;
  o.kv_quantizer = *qsim::MakeKvQuantizer(k, c, 0, nullptr);
  o.kv_grid = qsim::FakeQuantGrid{k.bits, k.symmetric, k.clip};
  o.kv_group = k.group;
  if (weight_bits < 16) {  // the recipe's grid: per channel, symmetric, clip search
    quant::ScalarQuantizeOptions w;
    w.bits = weight_bits;
    w.grid.clip_search = true;
    o.weight_quantizer = [w](const at::Tensor& weight) -> StatusOr<at::Tensor> {
      at::Tensor d = weight.to(at::kDouble).contiguous().clone();
      QCAL_RETURN_IF_ERROR(
          quant::RoundToNearestInPlace(w, d.data_ptr<double>(), d.size(0), d.size(1)));
      return d.to(at::kFloat);
    };
  }
  return o;
}

// The rotations phase on the float checkpoint `dir` with QuaRot's default plan.
inline StatusOr<methods::spinquant::RotationPhaseResult> TrainRotations(
    comm::Comm& comm, const std::string& dir, const at::Tensor& tokens,
    const methods::spinquant::RotationPhaseOptions& o) {
  QCAL_ASSIGN_OR_RETURN(auto source, model::OpenFloatCheckpoint(dir));
  const LlamaConfig& c = source->config();
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(RotationSpec{}, c));
  return methods::spinquant::TrainRotationsDataParallel(comm, source.get(), plan, tokens, o);
}

// Each of `ranks` threads trains with its own source; rank 0's result. Every rank must end with
// identical rotations (and smoothing scales, when trained).
inline methods::spinquant::RotationPhaseResult TrainRotationsOnRanks(
    int ranks, const std::string& dir, const at::Tensor& tokens,
    const methods::spinquant::RotationPhaseOptions& o) {
  using Result = methods::spinquant::RotationPhaseResult;
  auto comms = comm::MakeThreadComms(ranks);
  std::vector<StatusOr<Result>> results(ranks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { results[r] = TrainRotations(*comms[r], dir, tokens, o); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    if (!results[r].ok()) return {};
  }
  for (int r = 1; r < ranks; ++r) {
    EXPECT_TRUE(at::equal(results[r]->t1, results[0]->t1)) << r;
    EXPECT_TRUE(at::equal(results[r]->t2, results[0]->t2)) << r;
    EXPECT_EQ(results[r]->smooth.defined(), results[0]->smooth.defined()) << r;
    if (results[0]->smooth.defined() && results[r]->smooth.defined()) {
      EXPECT_TRUE(at::equal(results[r]->smooth, results[0]->smooth)) << r;
    }
  }
  return *results[0];
}

}  // namespace qcal::testing
