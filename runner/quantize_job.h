// A whole quantization job in one process: the job runner of the service with one in-process
// executor. The job directory is opened as the coordinator opens it (runner/workspace.h: locks,
// PlanJob, journal), the same task plan is pulled from the same scheduler (runner/scheduler.h:
// calibrate → quantize each block into its own shard → end-to-end fine-tuning → finalize), each
// task runs through the workers' executor (runner/task_executor.h) in a world of one rank
// (comm::SelfComm), and each result is accepted as the coordinator accepts a worker's
// (runner/task_results.h: staged files checked, committed into the output, then journaled). So a
// service job writes the same bytes. A failed task fails the job (no retries in process); what
// was committed stays for a resume.
//
// Resume: the job directory's journal.jsonl records each finished block (shard name, size,
// checksum, metrics). A rerun with the same recipe skips every block whose shard is intact, and
// calibration reuses cached Hessians with the same key, so an interrupted job loses no finished
// work. A journal written for a different recipe is refused.
//
// Fine-tuning (engine/quant/finetune.h, QuIP# Algorithm 5), when the recipe enables it:
//  * calibration also saves the float model's hidden states at every block boundary on the
//    calibration sequences: job_dir/activations/block_<l>.safetensors holds tensor "hidden"
//    [N, S, hidden] F32 = the float input of block l (l = num_blocks: the last block's output),
//    with the calibration key in the metadata, so a resumed job reuses them;
//  * block l is quantized with fine-tuning (quant::BlockTuner) with inputs block_<l> and targets
//    block_<l+1> (float inputs → float outputs, as QuIP#), else by QuantizeBlock;
//  * after all blocks, end-to-end fine-tuning (if enabled) loads the quantized blocks back from
//    their shards, tunes sign vectors, norms and an untied head against the float model, then
//    atomically rewrites every block shard and the non-block shard (tuned final norm / head) and
//    journals "e2e_done" with the new shard checksums. A resumed job with a valid e2e_done (after
//    the last block_done, every listed shard intact) skips the stage; if a listed shard changed,
//    the blocks and the stage are redone from the cached calibration products.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"
#include "runner/job_steps.h"
#include "engine/quant/block_task.h"

namespace qcal::job {

struct BlockSummary {
  int64_t layer = 0;
  std::vector<quant::LinearMetrics> linears;
  double seconds = 0;
  bool resumed = false;
  // Held-out block output MSE without / with within-block fine-tuning (NaN without it).
  double mse_before_ft = std::numeric_limits<double>::quiet_NaN();
  double mse_after_ft = std::numeric_limits<double>::quiet_NaN();
  // The block task's phases (QuantizeBlockStep: read weights, transform, load calibration,
  // quantize, write); empty for a resumed block.
  std::vector<v1::PhaseTiming> phases;
};

struct QuantizeJobResult {
  std::string out_dir;
  std::vector<BlockSummary> blocks;
  double code_bits = 0;    // per quantized weight, averaged over all linears
  double stored_bits = 0;
  double calib_seconds = 0;
  bool hessians_from_cache = false;
  int64_t calib_tokens = 0;
  int64_t blocks_resumed = 0;
  // End-to-end fine-tuning: held-out KL(float || quantized) in nats per token before and after
  // (NaN when the stage is off); e2e_resumed when a previous run had finished it.
  double e2e_kl_before = std::numeric_limits<double>::quiet_NaN();
  double e2e_kl_after = std::numeric_limits<double>::quiet_NaN();
  bool e2e_resumed = false;
  bool activations_from_cache = false;
  // A mixture-of-experts model: each MoE block's calibration routing (tokens per expert, the
  // experts calibrated on every token); empty for a dense model or a recipe without Hessians.
  std::vector<v1::ExpertLoad> expert_loads;
  double seconds = 0;
  // The job's phases (plan, open, calibrate, quantize, finetune, finalize; those that ran),
  // each with its seconds and the process's peak resident memory (common/phase_trace.h), and
  // the calibration and fine-tuning steps' own phases.
  std::vector<v1::PhaseTiming> phases;
  std::vector<v1::PhaseTiming> calibrate_phases;
  std::vector<v1::PhaseTiming> finetune_phases;
  int64_t peak_host_bytes = -1;  // the largest of the phases' peaks
  int64_t peak_device_bytes = -1;  // the same on the rank's GPU (-1: a CPU rank)
};

// Runs the job `spec` describes (workers 1; resolved here with ResolveJobSpec) in this process.
StatusOr<QuantizeJobResult> RunQuantizeJob(const Recipe& recipe, const v1::JobSpec& spec,
                                           const std::function<void(const JobEvent&)>& on_event =
                                               nullptr);

}  // namespace qcal::job
