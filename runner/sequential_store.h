// The sequential inputs store of a method that calibrates sequentially (MethodNeeds::sequential):
// block l's task reads its inputs (the quantized model's, and the float model's where the method
// needs both) from JobPaths::SequentialInputs(l) / SequentialFloatInputs(l), saves block l+1's
// and drops block l-1's. Lost inputs are rebuilt: the float ones through the float blocks, the
// quantized ones through the committed shards of the blocks before. Internal to the job steps
// (runner/job_steps.h).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "runner/job_steps.h"

namespace qcal::job {

// The calibration inputs of block `layer` (block 0: the embedded calibration tokens, less the
// positions the method drops, prepared by the method).
StatusOr<at::Tensor> SequentialInputs(JobContext* ctx, int64_t layer);
// The float model's inputs to block `layer` (MethodNeeds::sequential_float).
StatusOr<at::Tensor> SequentialFloatInputs(JobContext* ctx, int64_t layer);
// Saves block layer+1's inputs (`x_float` too when given).
Status SaveSequentialInputs(JobContext* ctx, int64_t layer, const at::Tensor& x,
                            const at::Tensor* x_float);
// Removes block layer-1's inputs (its block is journaled: blocks are handed out in order).
void DropSequentialInputs(JobContext* ctx, int64_t layer);

}  // namespace qcal::job
