// Memory budgets of a job's ranks: what a block task holds besides activations, how much
// activation memory a rank may keep before it spills to the job directory, and the ranks' vote
// on sharding the Hessian sums. Internal to the job steps (runner/job_steps.h).
#pragma once

#include <cstdint>

#include "common/hf_config.h"
#include "common/status.h"
#include "engine/comm/comm.h"
#include "runner/job_steps.h"

namespace qcal::job {

// Bytes a block task holds besides activations: the block's fp32 weights twice (loaded and
// transformed or rounded) and the exact Hessian accumulators of its four inputs (16 bytes per
// entry of one triangle, plus the fp32 product and fp64 mean of the largest).
int64_t BlockWorkingBytes(const LlamaConfig& config);

// Whether the ranks shard the Hessian sums (calib::CalibrationOptions::shard_hessians): when a
// rank would hold more than its max_memory calibrating one block with whole accumulators (the
// block's fp32 weights plus the exact sums of its four inputs: 11.6 GB at a 70B shape) and there
// are ranks to share them. A GPU rank sums on its device and never asks. The ranks agree (any
// rank asking makes all shard), since their budgets may differ by node. Collective.
StatusOr<bool> ShardHessians(comm::Comm& comm, const JobContext& ctx);

// The activation budget of a rank: its max_memory less a block's working set.
int64_t ActivationBudget(const JobContext& ctx);

}  // namespace qcal::job
