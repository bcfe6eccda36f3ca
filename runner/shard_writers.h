// The shards a job's steps write, each as a task attempt's staged file (runner/job_dir.h
// WriteStagedFile): a block's, and shard 0 when a method transforms the non-block weights or
// end-to-end fine-tuning tuned them. Internal to the job steps (runner/job_steps.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "engine/model/llama.h"
#include "methods/parts.h"
#include "proto/job.pb.h"
#include "runner/job_steps.h"

namespace qcal::job {

// Shard 0 of a method that transforms the non-block weights: the embedding table and the
// (untied) head streamed from the float model in row chunks through the method's row functions,
// stored F32 (transformed values); the prepared final norm, F32.
StatusOr<v1::WrittenFile> WritePreparedNonBlockShardStaged(JobContext* ctx,
                                                           const std::string& attempt);

// Shard 0 after end-to-end fine-tuning: the embedding table as the float model stores it (not
// tuned; streamed), the tuned final norm and, when untied, the tuned head (F32).
StatusOr<v1::WrittenFile> WriteTunedNonBlockShardStaged(JobContext* ctx,
                                                        const at::Tensor& final_norm,
                                                        const at::Tensor& head, bool head_tied,
                                                        const std::string& attempt);

// Block `layer`'s shard in the method's block format.
StatusOr<v1::WrittenFile> WriteBlockShardStaged(JobContext* ctx, int64_t layer,
                                                const model::BlockWeights& weights,
                                                const std::string& attempt);
// The same shard for a MoE block split over tasks: `weights` without its routed experts, theirs
// copied as stored from the groups' part files (BlockFormat::AppendBlockTensorsFromParts).
StatusOr<v1::WrittenFile> WriteAssembledBlockShardStaged(
    JobContext* ctx, int64_t layer, const model::BlockWeights& weights,
    const std::vector<methods::BlockFormat::StoredExperts>& groups, const std::string& attempt);

}  // namespace qcal::job
