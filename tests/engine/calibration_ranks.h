// Calibration on thread-ranks, for the tests of rank invariance (engine_calibration_test,
// engine_moe_calibration_test, engine_gpu_rank_invariance_test).
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/calib/calibration.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "runner/job_steps.h"

namespace qcal::testing {

// calib::Calibrate on `ranks` thread-ranks into `job_dir`'s calibration directories, with key
// "key": each rank opens `model_dir` as its own float source and takes the options `options`
// sets (defaults otherwise). A rank that fails drops its comm, so the others abort instead of
// waiting. Every rank's result, in rank order.
inline std::vector<StatusOr<calib::CalibrationResult>> CalibrateOnThreadRanks(
    int ranks, const std::string& model_dir, const at::Tensor& tokens, const std::string& job_dir,
    const std::function<void(calib::CalibrationOptions&, comm::Comm&)>& options) {
  auto comms = comm::MakeThreadComms(ranks);
  std::vector<StatusOr<calib::CalibrationResult>> results(ranks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto source = model::OpenFloatCheckpoint(model_dir);
      if (!source.ok()) {
        results[r] = source.status();
        comms[r].reset();
        return;
      }
      calib::CalibrationOptions opt;
      if (options) options(opt, *comms[r]);
      results[r] = calib::Calibrate(*comms[r], **source, tokens, job::CalibrationDirsOf(job_dir),
                                    "key", opt);
      if (!results[r].ok()) comms[r].reset();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Empty when every successful rank holds rank 0's reduced Hessians (the dense inputs' sums and,
// in MoE blocks, every expert's sums, routed tokens and route-all flag); otherwise the first
// difference ("rank 2 block 1 expert 3 down").
inline std::string FirstRankDifference(
    const std::vector<StatusOr<calib::CalibrationResult>>& results) {
  if (results.empty() || !results[0].ok()) return "";
  const std::vector<calib::BlockHessians>& want = results[0]->hessians;
  for (size_t r = 1; r < results.size(); ++r) {
    if (!results[r].ok()) continue;
    const std::vector<calib::BlockHessians>& got = results[r]->hessians;
    if (got.size() != want.size()) return absl::StrCat("rank ", r, ": ", got.size(), " blocks");
    for (size_t l = 0; l < want.size(); ++l) {
      const std::string where = absl::StrCat("rank ", r, " block ", l);
      for (calib::HessianKind k : calib::kAllHessianKinds) {
        if (!(got[l].at(k).packed() == want[l].at(k).packed())) {
          return absl::StrCat(where, " ", calib::HessianKindName(k));
        }
      }
      if (got[l].experts.size() != want[l].experts.size()) return where + ": experts";
      for (size_t e = 0; e < want[l].experts.size(); ++e) {
        const calib::ExpertHessians& a = got[l].experts[e];
        const calib::ExpertHessians& b = want[l].experts[e];
        if (a.routed_tokens != b.routed_tokens || a.route_all != b.route_all) {
          return absl::StrCat(where, " expert ", e, " routing");
        }
        for (calib::ExpertInput i : calib::kExpertInputs) {
          if (!(a.at(i).packed() == b.at(i).packed()) || a.at(i).count() != b.at(i).count()) {
            return absl::StrCat(where, " expert ", e, " ", calib::ExpertInputName(i));
          }
        }
      }
    }
  }
  return "";
}

}  // namespace qcal::testing
