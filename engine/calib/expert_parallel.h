// A mixture-of-experts block's routed experts during calibration: which process runs each
// expert and sums its Hessians.
//
// Expert parallelism. Rank r of a Comm owns the contiguous experts ExpertsOfRank(E, r, size)
// (comm::SliceForRank): it alone loads their float weights and holds their exact Hessian sums.
// Every rank still walks its own canonical chunks through the block's attention and router; in
// each forward call, the rows the router sends expert e go to e's owner (comm::AllToAll), which
// runs the expert on them exactly as DecoderBlock::RoutedExperts would (the same rows in the same
// order, so the same [m, hidden] GEMMs and the same bits), adds each sequence's rows as one
// product to the expert's accumulators, and sends the outputs back; the sender combines them in
// expert order, as the block does. An expert that calibrates on every token (route-all, the
// starved-expert rule) also receives each call's whole normalised hidden state.
//
// So a rank holds 1/ranks of a block's experts and of their sums (at Mixtral-8x7B shape an
// expert is 0.70 GB of fp32 weights and 1.78 GB of exact sums), and the block outputs, the sums
// and the cache file are those of one process, whatever the rank count. What moves per forward
// call is each routed row to its owner and back (2 · k · hidden floats per token), not the sums.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/comm/comm.h"
#include "engine/model/llama.h"

namespace qcal::calib {

// The experts rank `rank` of `size` owns: SliceForRank(experts, rank, size).
comm::Range ExpertsOfRank(int64_t experts, int rank, int size);

// Zeros of each input's shape (undefined where the input is): the outputs of a call whose
// experts did not run (an error, or stand-ins that only count the routing).
std::vector<at::Tensor> ZeroExpertOutputs(const model::ExpertCall& call);

// Sizes h->experts to the block's experts and the accumulators of the owned ones (which the
// block must hold) to their dimensions when empty, and sets their route_all from h->route_all.
// InvalidArgument for sums of other sizes, FailedPrecondition for an owned expert not loaded.
Status SizeExpertHessians(const model::DecoderBlock& block, comm::Range owned, BlockHessians* h);

// Runs the experts [owned.begin, owned.end) of a forward call of MoE block `block` (whose
// weights must hold them) and sums their Hessians into h->experts[e] (sized to the block's
// experts, each owned one's accumulators to its dimensions, when empty):
//  * real routing: the call's rows for e, each sequence's rows (seq_len tokens per sequence of
//    call.h's flattened rows) one product, as any rank split gives them;
//  * h->route_all[e] (when set): every token of call.h (Llama 4: scaled by the sigmoid of e's
//    own logit), while the output still comes from the routed rows alone.
// routed_tokens of each owned expert grows by its rows. Returns outputs[e] = down(silu(gate(x)) ·
// up(x)) [m_e, hidden] for each owned expert the call gives rows, undefined otherwise.
// OutOfRange on a Hessian overflow, naming the expert and input.
StatusOr<std::vector<at::Tensor>> RunOwnedExperts(const model::DecoderBlock& block,
                                                  const model::ExpertCall& call, int64_t seq_len,
                                                  comm::Range owned, BlockHessians* h);

// The exchange of one MoE block's expert rows between the ranks of `comm` (see the top). Every
// rank makes one for the block, with the block loaded with (at least) its own experts, and
// installs Run as the block's BlockHooks::run_experts. Per step of the block's lockstep walk,
// every rank takes part in exactly one exchange: through Run (its forward call of the step) or
// through FinishStep (no call this step: it only runs its experts for the others). Not
// thread-safe; h must outlive it.
class ExpertExchange {
 public:
  ExpertExchange(comm::Comm& comm, const model::DecoderBlock& block, BlockHessians* h);

  // This rank's forward call: its rows go to their owners, this rank runs its own experts on
  // every rank's rows, and the outputs come back (the block's run_experts contract). seq_len:
  // tokens per sequence of call.h. Collective. Errors stick (status()); the outputs are then
  // zeros of the right shapes, so the forward finishes and the step ends in step with the others.
  std::vector<at::Tensor> Run(const model::ExpertCall& call, int64_t seq_len);

  // Ends a step: takes part in the step's exchange with nothing of its own if Run was not called
  // in it. Returns the first error of the step (its own or a collective's) and clears it.
  // Collective.
  Status FinishStep();

  comm::Range owned() const { return owned_; }

 private:
  // One exchange: `call` null for a rank without a forward call this step.
  std::vector<at::Tensor> Exchange(const model::ExpertCall* call, int64_t seq_len);

  comm::Comm& comm_;
  const model::DecoderBlock& block_;
  BlockHessians* h_;
  int64_t experts_, hidden_;
  comm::Range owned_;
  std::vector<comm::Range> ranges_;   // every rank's experts
  std::vector<bool> wants_h_;         // whether rank r owns an expert that calibrates on every token
  bool exchanged_ = false;            // this step
  Status status_;
};

}  // namespace qcal::calib
