// The steps of a quantization job, shared by the single-process `qcal quantize`
// (quantize_job.cc: SelfComm + these steps + its own journal) and the service worker's task
// loop (worker/task_loop.cc: MpiComm + these steps; the coordinator journals):
//
//   OpenJob           the recipe's method, the float model as a streamed source (nothing of the
//                     model is loaded yet), compute threads (every rank)
//   CalibrateStep     collective over a Comm: Hessians and block-boundary activations on the
//                     float model, cached in the job directory (calib/calibration.h), as the
//                     task's CalibrateParams ask
//   QuantizeBlockStep one block: the float block read from the source, prepared and quantized by
//                     the method, its shard written as the attempt's staged file; returns the
//                     BlockResult (the caller commits it and journals it)
//   FinetuneE2EStep   end-to-end fine-tuning: rewrites every shard (staged); FinetuneResult
//   EvaluateStep      perplexity of the float or the quantized model on one text file, one block
//                     in memory at a time
//   FinalizeJob       (runner/job_plan.h) by whoever owns the journal
//
// Each step is its own file (job_steps.cc: OpenJob; calibrate_step.cc, quantize_block_step.cc,
// finetune_step.cc, evaluate_step.cc), and what the steps share lives in small files beside
// them: budgets.h (memory budgets, the sharding vote), shard_writers.h (staged shards),
// sequential_store.h (a sequential method's block inputs), phase_products.h (global phases'
// products and training curves), step_util.h (the clock and progress events).
//
// Steps only read the source model, the job directory's calibration products and the committed
// output, and write staged files, so a step run on any rank (after CalibrateStep finished on all
// of them) computes the same bytes; no step names a method.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "kernels/gpu_backend.h"
#include "methods/method.h"
#include "proto/job.pb.h"
#include "proto/qcal.pb.h"
#include "engine/calib/cache.h"
#include "engine/comm/comm.h"
#include "engine/model/model_source.h"

namespace qcal::job {

// What one rank brings to a job beside its record (v1::JobSpec): the process's settings and
// what the job's driver planned. Not part of the job.
struct RankOptions {
  // The process's compute threads when it was told (the worker's --threads); 0: the spec's
  // threads_per_worker (0 there: model::AutoComputeThreads).
  int threads = 0;
  // GPU ranks: the NCCL all-reduce of device buffers (calib::CalibrationOptions::device_sum);
  // empty on CPU ranks and in single-process jobs.
  kernels::DeviceInt64Sum device_sum;
  // The job's inputs key (runner/input_fingerprint.h), as the job's driver planned it (`qcal
  // quantize`'s plan, or the coordinator's, handed to the workers at registration); empty: OpenJob
  // fingerprints the inputs itself (hashes cached in JOB/inputs.json).
  std::string inputs_key;
};

struct JobEvent {
  std::string phase;  // "calibrate", "activations", "quantize", "block", "finetune", ...
  int64_t done = 0, total = 0;
  std::string message;
};
using JobEventFn = std::function<void(const JobEvent&)>;

// What a job's steps share. Created by OpenJob; not thread-safe (one per rank).
struct JobContext {
  Recipe recipe;
  v1::JobSpec spec;  // the job's record, resolved (ResolveJobSpec)
  RankOptions rank;  // inputs_key filled in
  // Bytes of activations this rank holds in memory (calibration, evaluation, sequential inputs);
  // above it they are spilled to the job directory: the spec's max_memory_bytes, else the node's
  // default (model::DefaultMaxMemory).
  int64_t max_memory = 0;
  LlamaConfig config;
  std::unique_ptr<methods::Method> method;
  // The rank's GPU backend (null: the CPU), as the process's device selection installed it
  // (kernels::ActiveGpuBackend, read here once); passed to every kernel that can use it.
  kernels::GpuBackend* gpu = nullptr;
  // Where the rank's LibTorch work runs (BlockInputs::device): the backend's CUDA device when
  // this build's LibTorch has CUDA, else the CPU.
  at::Device torch_device = at::kCPU;
  std::unique_ptr<model::ModelSource> source;  // the float model, streamed
  std::string calib_key;  // CalibrationKey of the recipe's data
  int64_t seq_len = 0;    // calibration sequence length (capped)
  at::Tensor tokens;      // calibration tokens, once sampled
  int32_t bos_id = 1;     // the tokenizer's BOS (set with the tokens)
  // Whether `method` was made with its global phases' products (methods::MakeMethod; done once,
  // by the first block task that loads them).
  bool method_bound = false;
};

// Resolves the spec (ResolveJobSpec), the rank's memory budget and the inputs key, opens the
// float model as a streamed source, makes the recipe's method and sets the compute threads
// (rank.threads, else the spec's threads_per_worker, else AutoComputeThreads). A calibration
// seq_len above the model's context is capped to it, with a warning (CalibrationSeqLen).
StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe, const v1::JobSpec& spec,
                                              const RankOptions& rank = {});

// The calibration sequence length: the recipe's, capped at the model's context
// (max_position_embeddings). When capped, *note (if given) says so and why.
int64_t CalibrationSeqLen(const Recipe& recipe, const LlamaConfig& config, std::string* note);

// Samples the calibration tokens into ctx->tokens (once).
Status EnsureCalibrationTokens(JobContext* ctx);

// Collective over `comm` (every rank, same arguments; rank 0's `params` are used). Samples the
// tokens, then calib::Calibrate over the streamed float model. Events: "calibrate" (block,
// blocks) for the walk ("activations" when only activations are needed), then "activations"
// (blocks, blocks) when both were made. Then, when params.phases() is set, the method's global
// phases in order (MethodNeeds::global_phases), each reused from JobPaths::PhaseProducts
// when that holds this calibration's products (its checksum verified), else run on every rank
// and saved by rank 0; event "phase" (0/1, 1/1) with the phase's name.
StatusOr<v1::CalibrateResult> CalibrateStep(comm::Comm& comm, JobContext* ctx,
                                            const v1::CalibrateParams& params,
                                            const JobEventFn& on_event = nullptr);

// Quantizes block `layer` and writes its shard as `attempt`'s staged file (job_dir.h). When
// the method needs the float model's Hessians / activations they are read from the job
// directory (FailedPrecondition naming the file when missing). When it calibrates sequentially,
// block l reads its inputs from JobPaths::SequentialInputs(l) (block 0: the embedded
// calibration tokens, prepared by the method), writes block l+1's and deletes block l-1's, so
// block l-1 must be done first (the scheduler hands these blocks out in order); lost inputs are
// rebuilt from the committed shards of the blocks before. A method that transforms the non-block
// weights has block 0 write shard 0 too (BlockResult.also_wrote). Events: "block" (step, steps)
// with "block <l>: <step>" as the method's quantizer finishes each step (a linear, a fine-tuning
// group; methods::BlockInputs::progress).
StatusOr<v1::BlockResult> QuantizeBlockStep(JobContext* ctx, int64_t layer,
                                            const std::string& attempt,
                                            const JobEventFn& on_event = nullptr);

// One part of MoE block `layer` split over tasks (runner/task_plan.h; MethodNeeds::expert_parts).
// An expert group (part.index >= 1) reads only its routed experts from the float model, rounds
// them and writes them as the attempt's staged part file (PartFileName; BlockResult.part set).
// The assembling part 0 reads the block's other weights, quantizes them, reads every expert
// group's committed part file (`groups`: their results, checksums verified) and writes the
// block's shard with the bytes one task would have written; its result's metrics are the whole
// block's, in the one task's order, and it lists the part files it took in (merged_parts).
StatusOr<v1::BlockResult> QuantizeBlockPartStep(JobContext* ctx, int64_t layer,
                                                const v1::BlockPart& part,
                                                const std::vector<v1::BlockResult>& groups,
                                                const std::string& attempt,
                                                const JobEventFn& on_event = nullptr);

// The job directory's calibration directories (runner/job_dir.h), as the engine receives them.
calib::CalibrationDirs CalibrationDirsOf(const std::string& job_dir);


// End-to-end fine-tuning of the quantized model read back from its committed shards (all block
// shards must be there) against the float model (streamed): writes every shard again (staged,
// `attempt`). `blocks`: the finished blocks' results (for quantization_config's bits per weight).
// Events: "finetune" (0/1, 1/1).
StatusOr<v1::FinetuneResult> FinetuneE2EStep(JobContext* ctx,
                                             const std::vector<v1::BlockResult>& blocks,
                                             const std::string& attempt,
                                             const JobEventFn& on_event = nullptr);

// Perplexity of the job's float model (params.model "float") or its finalized output
// ("quantized") on one text file, streamed block by block (eval/perplexity.h). The data path is
// resolved against the data root when relative.
StatusOr<v1::EvalResult> EvaluateStep(JobContext* ctx, const v1::EvalParams& params,
                                      const JobEventFn& on_event = nullptr);

// BlockTaskResult metrics -> proto.
void AddMetrics(const std::vector<quant::LinearMetrics>& linears, v1::BlockResult* out);

}  // namespace qcal::job
