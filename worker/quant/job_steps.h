// The steps of a quantization job, shared by the single-process `qcal quantize`
// (quantize_job.cc: SelfComm + these steps + its own journal) and the service worker's task
// loop (worker/runtime/task_loop.cc: MpiComm + these steps; the coordinator journals):
//
//   OpenJob           load the float model and config, set compute threads (every rank)
//   CalibrateStep     collective over a Comm: Hessians and block-boundary activations, cached
//                     in the job directory (calib/calibration.h)
//   QuantizeBlockStep one block: its shard written atomically; returns the journal's block_done
//                     entry (does not append it)
//   FinetuneE2EStep   end-to-end fine-tuning: rewrites every shard; returns the e2e_done entry
//   FinalizeJob       (common/job_layout.h) by whoever owns the journal
//
// Steps only read the job directory's calibration products and write the output shards, so a
// step run on any rank (after CalibrateStep finished on all of them) computes the same bytes.
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
#include "common/safetensors.h"
#include "common/status.h"
#include "worker/calib/hessian.h"
#include "worker/model/llama.h"
#include "worker/quant/quantize_job.h"
#include "worker/quarot/rotate.h"
#include "worker/runtime/comm.h"

namespace qcal::quant {

using JobEventFn = std::function<void(const JobEvent&)>;

// What a job's steps share. Created by OpenJob; not thread-safe (one per rank).
struct JobContext {
  Recipe recipe;
  QuantizeJobOptions options;  // job_dir and data_root resolved
  LlamaConfig config;
  std::unique_ptr<model::LlamaModel> model;  // the float model
  std::unique_ptr<CheckpointReader> float_ckpt;
  std::string calib_key;  // CalibrationKey of the recipe's data
  int64_t seq_len = 0;    // calibration sequence length (capped)
  at::Tensor tokens;      // calibration tokens, once sampled
  // Hessians kept in memory by CalibrateStep (keep_hessians); empty: QuantizeBlockStep loads
  // block l's from job_dir/hessians.
  std::vector<calib::BlockHessians> hessians;
  // method quarot: `model` is rotated in place (quarot::RotateModel) by the first block step.
  bool rotated = false;
  quarot::RotationPlan rotation_plan;  // set with `rotated`
};

// Resolves the options (job_dir default out_dir + ".job", data_root default "../shared"), loads
// the float model and sets the compute threads (options.threads, else AutoComputeThreads).
StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe,
                                              const QuantizeJobOptions& options);

// Samples the calibration tokens into ctx->tokens (once).
Status EnsureCalibrationTokens(JobContext* ctx);

struct CalibrateNeeds {
  bool hessians = true;       // block tasks still need Hessians (recipe.needs_hessians())
  bool activations = false;   // block tasks still need activations (within-block fine-tuning)
  bool keep_hessians = true;  // keep them in ctx->hessians (single process)
};
// What a job still needs from calibration, per the recipe and the plan (all blocks finished:
// nothing; method quarot: nothing, its block tasks calibrate).
CalibrateNeeds NeedsFor(const Recipe& recipe, bool all_blocks_finished);

struct CalibrateStepResult {
  int64_t tokens = 0;
  double seconds = 0;
  bool hessians_from_cache = false;
  bool activations_from_cache = false;
  nlohmann::json ToJson() const;  // CompleteTask's result_json for CALIBRATE
};

// Collective over `comm` (every rank, same arguments; rank 0's `needs` are used). Samples the
// tokens, then calib::Calibrate. Events: "calibrate" (block, blocks) for the walk ("activations"
// when only activations are needed), then "activations" (blocks, blocks) when both were made.
StatusOr<CalibrateStepResult> CalibrateStep(runtime::Comm& comm, JobContext* ctx,
                                            const CalibrateNeeds& needs,
                                            const JobEventFn& on_event = nullptr);

// Quantizes block `layer` (QuantizeBlockWithFinetune with the cached activations when the
// recipe fine-tunes within blocks, else QuantizeBlock) and writes its shard atomically.
// Method quarot: the model is rotated (once per process), block `layer` is quantized by
// quarot::QuantizeRotatedBlock and written with quarot::WriteQuarotBlockShard; block 0 also
// writes the rotated shard 0 (embedding, final norm, untied head; entry key "also_wrote"). When
// the recipe calibrates sequentially (Recipe::sequential_calibration) block l reads its inputs
// from job_dir/quarot/inputs-<l>.safetensors (block 0: the embedded calibration tokens), writes
// block l+1's, and deletes block l-1's; block l-1 must therefore be done first (the scheduler
// hands these blocks out in order). Returns
// the block_done entry: {"event":"block_done","layer","shard","bytes","checksum","seconds",
// "mse_before_ft","mse_after_ft","metrics":[{name, proxy_loss, relative, code_bits,
// stored_bits, seconds}]}. Missing calibration products are FailedPrecondition naming the file.
StatusOr<nlohmann::json> QuantizeBlockStep(JobContext* ctx, int64_t layer);

// job_dir/quarot/inputs-<layer>.safetensors.
std::string QuarotInputsPath(const std::string& job_dir, int64_t layer);

// End-to-end fine-tuning of the quantized model read back from its shards (all block shards
// must be written): writes shard 0 and the index, tunes, atomically rewrites every shard and
// returns the e2e_done entry {"event":"e2e_done","checksums":{shard: fnv1a},"kl_before",
// "kl_after","best_epoch","head_tuned","seconds"}. `block_done`: the finished blocks' entries
// (for quantization_config's bits per weight). Events: "finetune" (0/1, 1/1).
StatusOr<nlohmann::json> FinetuneE2EStep(JobContext* ctx,
                                         const std::map<int64_t, nlohmann::json>& block_done,
                                         const JobEventFn& on_event = nullptr);

// Per-linear metrics <-> the journal's "metrics" array.
nlohmann::json MetricsToJson(const std::vector<LinearMetrics>& linears);
std::vector<LinearMetrics> MetricsFromJson(const nlohmann::json& arr);

}  // namespace qcal::quant
