// A job's plan and its end: what is left to do, from the journal and the shards on disk
// (resume), what the job will write, and the finalize that turns finished blocks into a
// checkpoint. Torch-free: both drivers plan and finalize through it (runner/workspace.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "runner/input_fingerprint.h"
#include "runner/journal.h"

namespace qcal {

// What a job writes, roughly (bytes): calibration products into the job directory (exact for
// Hessian files: 16 bytes per entry of an input's n(n+1)/2 triangle, 4 inputs a block (8.2 GB a
// block, 655 GB in all at a Llama-3-70B shape); float activations and
// sequential inputs: 4 bytes per calibration token and feature per boundary kept) and the
// checkpoint into the output directory (codes at the recipe's bits, the float tables as stored).
struct DiskNeed {
  int64_t job_bytes = 0, out_bytes = 0;
  std::string job_detail;  // "Hessians 16.4 GiB a block, activations ..."
};
DiskNeed EstimateDiskNeed(const Recipe& recipe, const LlamaConfig& config);

// What is left to do for a job, from its journal and the shards on disk.
struct JobPlan {
  LlamaConfig config;
  int64_t num_blocks = 0;
  std::string recipe_hash;            // Fnv1aHex(recipe.ToJson().dump())
  // What this run's products are computed from; journal entries of runs with another key (another
  // model, edited weights, other calibration text) are not reused.
  InputsFingerprint inputs;
  int64_t stale_blocks = 0;           // block_done entries of other inputs, ignored
  std::vector<std::string> notes;     // what the plan decided that the user should hear
  DiskNeed disk;                      // what the job will write (a note when it does not fit)
  std::string job_dir;                // resolved (JobDirFor)
  std::vector<bool> block_finished;   // shard present and its checksum matches block_done
  std::map<int64_t, nlohmann::json> block_done;  // layer -> its journal entry (finished ones)
  // Expert groups of unfinished MoE blocks that an earlier run of these inputs finished (a
  // block_part_done whose part file is intact): layer -> entries, the last per expert range.
  std::map<int64_t, std::vector<nlohmann::json>> parts_done;
  // Routed experts per task (JobSpec::experts_per_task), set by the driver from the spec before
  // the task plan is made; PlanJob leaves it 0 (the default).
  int64_t experts_per_task = 0;
  bool e2e_enabled = false;
  bool e2e_finished = false;          // e2e_done valid and every shard it lists intact
  nlohmann::json e2e_done;            // its journal entry when finished
  bool all_blocks_finished() const;
  std::vector<int64_t> pending_blocks() const;
  // Whether the job still has a CALIBRATE task: blocks are pending and the method calibrates
  // the float model before them (MethodNeeds::calibrates_float_model), or end-to-end
  // fine-tuning is not done. (MethodNeeds::reads_calibration_text says whether the recipe reads
  // calibration text at all.)
  bool has_calibrate_task(const Recipe& recipe) const;
};

// Validates inputs (model config readable, output directory not inside the model directory,
// recipe consistent with any existing journal), fingerprints the inputs (FingerprintInputs,
// hashes cached in JOB/inputs.json) and reads the journal: a block_done or e2e_done counts only
// under a job_start with this run's inputs key (else it is named in `notes` and redone). Creates
// out_dir and job_dir. Errors name the file and the problem. Appends nothing. The caller holds
// the job directory's lock (JobDirLock).
StatusOr<JobPlan> PlanJob(const Recipe& recipe, const std::string& model_dir,
                          const std::string& out_dir, const std::string& job_dir,
                          const std::string& data_root);

// The journal's "job_start" entry for this recipe / model / output / inputs (inputs_key and the
// files' hashes). Finished blocks count for a later plan only under a job_start of the same
// inputs and output directory.
nlohmann::json JobStartEntry(const Recipe& recipe, const JobPlan& plan,
                             const std::string& model_dir, const std::string& out_dir);

// Bits per weight over all quantized linears, weighting each block_done entry's per-linear
// code_bits / stored_bits by the linear's size (from config), blocks in layer order.
struct BitsPerWeight {
  double code_bits = 0, stored_bits = 0;
};
BitsPerWeight AggregateBits(const LlamaConfig& config,
                            const std::map<int64_t, nlohmann::json>& block_done);

// Finishes a job whose block shards are all written and journaled (and, with end-to-end
// fine-tuning, e2e_done journaled): shard 0 when not fine-tuned end to end, index, config.json,
// tokenizer files; appends job_done. Returns a summary (bits per weight, blocks).
StatusOr<nlohmann::json> FinalizeJob(const Recipe& recipe, const std::string& model_dir,
                                     const std::string& out_dir, Journal* journal);

}  // namespace qcal
