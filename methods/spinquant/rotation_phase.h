// The rotations phase of method spinquant: Cayley SGD on R1 and the per-block R2
// (qsim/rotation_training.h), data-parallel over the ranks of a Comm and resumable.
//
//   * Step t takes the `batch` calibration sequences (t·batch + i) mod N, i < batch; rank r of
//     size P takes the contiguous slice runtime::SliceForRank(batch, r, P) of them.
//   * Each sequence's loss and gradients (block-streamed, qsim::RotationGradients) are rounded
//     once to fixed point (2^-52) and summed as 128-bit integers, on the rank and then across
//     ranks (Comm::AllReduceSum on 32-bit digit limbs): the step's gradient is exact and
//     independent of the rank count and of how the batch is split, so 1, 2 or 3 ranks train the
//     same rotations bit for bit (given the same per-sequence gradients: the same inputs and
//     kernels). Every rank then takes the same Cayley step, so all end with identical
//     rotations.
//   * Resumable: rank 0 saves the state (R1, R2, the step, the losses so far) every
//     checkpoint_every steps to state_path (atomic, with a checksum), keyed by state_key and the
//     training settings; a rerun loads it, broadcasts it, and continues from that step. The
//     Cayley steps are stateless (momentum 0, QR steps from a hash of the step), so a resumed
//     run equals an uninterrupted one bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "worker/comm/comm.h"
#include "worker/model/model_source.h"
#include "worker/qsim/rotate.h"
#include "worker/qsim/rotation_training.h"

namespace qcal::methods::spinquant {

struct RotationPhaseOptions {
  qsim::RotationTrainingOptions training;
  int64_t checkpoint_every = 10;
  std::string state_path;  // empty: no saved state
  std::string state_key;   // what the state must have been made for (the calibration key)
  int64_t cache_bytes = 0; // fused blocks and head kept in memory (RotationGradients)
  // Start from whichever of the plan's Hadamards and the identity (training.identity_init is
  // then ignored) has the lower mean loss on the first min(N, 4·batch) calibration sequences,
  // measured over the ranks like a step's loss (exact sums, the same choice on every rank).
  bool choose_init = false;
  // Tests of resumption: stop with Aborted once this run has taken this many steps (its state
  // saved). < 0: run to the end.
  int64_t stop_after = -1;
};

struct RotationPhaseResult {
  at::Tensor t1;               // [hidden, hidden] float64, T1 (the plan's convention)
  at::Tensor t2;               // [layers, head_dim, head_dim] float64
  std::vector<double> losses;  // the loss of every step (mean over its batch)
  int64_t resumed_from = 0;    // the step a saved state let this run start at
  std::string init;            // hadamard | identity (the start this run took; "" if resumed)
};

// Collective over `comm`: every rank passes the same tokens [N, S] and options.
StatusOr<RotationPhaseResult> TrainRotationsDataParallel(runtime::Comm& comm,
                                                        model::ModelSource* source,
                                                        const qsim::RotationPlan& plan,
                                                        const at::Tensor& tokens,
                                                        const RotationPhaseOptions& options);

}  // namespace qcal::methods::spinquant
