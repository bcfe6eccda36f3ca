// The rotations phase of method spinquant: Cayley SGD on R1 and the per-block R2
// (methods/spinquant/rotation_training.h), data-parallel over the ranks of a Comm and resumable.
//
//   * Step t takes the `batch` calibration sequences (t·batch + i) mod N, i < batch; rank r of
//     size P takes the contiguous slice comm::SliceForRank(batch, r, P) of them.
//   * Each sequence's loss and gradients (block-streamed, RotationGradients) are rounded
//     once to fixed point (2^-52) and summed as 128-bit integers, on the rank and then across
//     ranks (Comm::AllReduceSum on 32-bit digit limbs): the step's gradient is exact and
//     independent of the rank count and of how the batch is split, so 1, 2 or 3 ranks train the
//     same rotations bit for bit (given the same per-sequence gradients: the same inputs and
//     kernels). Every rank then takes the same Cayley step, so all end with identical
//     rotations.
//   * Held-out selection (validation > 0): the last `validation` sequences are not trained on.
//     The rotations are scored on them -- the mean loss under validation_options, the model as
//     it will be deployed (the weights at their bits where training keeps them float) -- at the
//     start, every checkpoint_every steps and after the last step, and the best-scoring ones
//     (the earliest of equal scores) are the result: training that does not help on held-out
//     text returns its start. The scores are summed exactly over the ranks like a step's loss.
//   * Smoothing scales (training.smooth): the blocks' log-scales (SmoothingSize) are
//     trained beside the rotations, their gradients summed exactly with the rotations', with Adam
//     (AMD Quark's jointly trained SmoothQuant scales); they start at 0 (no scaling), are part
//     of the state and of the held-out selection, and come back with the rotations.
//   * Resumable: rank 0 saves the state (R1, R2, the scales and their Adam moments, the step,
//     the losses so far, the held-out scores and the best rotations) every checkpoint_every
//     steps, keyed by state_key and the training settings, alternately to state_path and its
//     ".b" twin (each atomic, with a checksum): a kill during a save leaves the previous state
//     intact. A rerun loads the usable one with more steps, broadcasts it, and continues from
//     that step. The Cayley steps
//     are stateless (momentum 0, QR steps from a hash of the step) and the Adam moments are
//     saved, so a resumed run equals an uninterrupted one bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"
#include "engine/qsim/rotate.h"
#include "methods/spinquant/rotation_training.h"

namespace qcal::methods::spinquant {

struct RotationPhaseOptions {
  RotationTrainingOptions training;
  int64_t checkpoint_every = 10;
  std::string state_path;  // empty: no saved state
  std::string state_key;   // what the state must have been made for (the calibration key)
  int64_t cache_bytes = 0; // fused blocks and head kept in memory (RotationGradients)
  // Start from whichever of the plan's Hadamards and the identity (training.identity_init is
  // then ignored) has the lower mean loss -- on the held-out sequences under validation_options
  // when validation > 0, else on the first min(N, 4·batch) training sequences under the
  // training options -- measured over the ranks like a step's loss (exact sums, the same choice
  // on every rank).
  bool choose_init = false;
  // Held-out sequences (the last `validation` of the tokens; at least one must be left to train
  // on) and the quantizers they are scored with. 0: no selection, the last step's rotations.
  int64_t validation = 0;
  RotationTrainingOptions validation_options;
  // How a held-out score is computed from (R1, R2 per layer) and the held-out tokens [V, S];
  // unset: the mean loss under validation_options (RotationGradients::Losses), summed exactly over
  // the ranks. A replacement must give every rank the same value (collective: all ranks call it);
  // it is not part of the saved state's key.
  // smooth: the smoothing log-scales [layers, SmoothingSize] (undefined without training.smooth).
  std::function<StatusOr<double>(const at::Tensor& r1, const at::Tensor& r2,
                                 const at::Tensor& smooth, const at::Tensor& held_out)>
      held_out_score;
  // Tests of resumption: stop with Aborted once this run has taken this many steps (its state
  // saved). < 0: run to the end.
  int64_t stop_after = -1;
};

struct RotationPhaseResult {
  at::Tensor t1;               // [hidden, hidden] float64, T1 (the plan's convention)
  at::Tensor t2;               // [layers, head_dim, head_dim] float64
  // With training.smooth: the blocks' smoothing log-scales [layers, SmoothingSize] float64
  // (SmoothBlockWeights fuses one block's); undefined without.
  at::Tensor smooth;
  std::vector<double> losses;  // the loss of every step (mean over its batch)
  int64_t resumed_from = 0;    // the step a saved state let this run start at
  std::string init;            // hadamard | identity (the start; a resumed run reads it back)
  // The held-out scores: (steps taken, mean loss) at the start, every checkpoint_every steps
  // and at the end (empty without validation), and the step whose rotations are the result.
  std::vector<std::pair<int64_t, double>> validation;
  int64_t selected_step = 0;
};

// The (steps, score) pairs of RotationPhaseResult::validation as a [k, 2] float64 tensor.
at::Tensor ScoresTensor(const std::vector<std::pair<int64_t, double>>& scores);

// Collective over `comm`: every rank passes the same tokens [N, S] and options.
StatusOr<RotationPhaseResult> TrainRotationsDataParallel(comm::Comm& comm,
                                                        model::ModelSource* source,
                                                        const qsim::RotationPlan& plan,
                                                        const at::Tensor& tokens,
                                                        const RotationPhaseOptions& options);

}  // namespace qcal::methods::spinquant
