// The job directory and the quantized checkpoint layout, free of LibTorch so that both the
// single-process `qcal quantize` (engine/quant/quantize_job) and the coordinator (which plans,
// journals and finalizes service jobs) share one implementation — the service writes exactly
// the files the single-process path writes.
//
//   OUT/config.json                      model config + "quantization_config" (written last)
//   OUT/model.safetensors.index.json     weight_map over the shards
//   OUT/model-00000-of-0000N.safetensors embeddings, final norm, head
//   OUT/model-0000l-of-0000N.safetensors block l-1
//   OUT/.staging/<file>.<attempt>        what a task attempt wrote; renamed into OUT by the job's
//                                        single writer when it accepts the attempt (CommitFiles),
//                                        removed by finalize
//   JOB/journal.jsonl                    append-only, fsynced: job_start, block_done, e2e_done,
//                                        job_done (docs/formats.md)
//   JOB/hessians/, JOB/activations/      calibration products (worker side), keyed by the inputs
//   JOB/lock                             the driver's lock (JobDirLock): who drives the job
//   JOB/inputs.json                      content hashes of the inputs (common/input_fingerprint.h)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/input_fingerprint.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "proto/job.pb.h"

namespace qcal {

// "model-00003-of-00006.safetensors": shard 0 holds the non-block tensors, shard l+1 block l.
std::string ShardName(int64_t shard, int64_t num_blocks);

// ---- One job per output directory

// An exclusive advisory lock (flock) on the output directory itself, held for the life of a
// job by the process that writes it (`qcal quantize`, or the coordinator for a service job), so
// two jobs can never interleave their shards in one directory. Leaves no file behind. Move-only;
// released by the destructor.
class OutputDirLock {
 public:
  // FailedPrecondition naming the directory when another process holds it.
  static StatusOr<OutputDirLock> Acquire(const std::string& out_dir);
  OutputDirLock() = default;
  OutputDirLock(OutputDirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  OutputDirLock& operator=(OutputDirLock&& other) noexcept;
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;
  ~OutputDirLock();

 private:
  explicit OutputDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// One driver per job directory: an exclusive advisory lock (flock) on JOB/lock, held for the
// life of a job by the process that drives it (`qcal quantize`, or the coordinator for a service
// job), so two runs never interleave their journals and caches in one job directory. The file
// names the holder (what, pid, host, since when); a second driver is refused naming it. The
// workers of a service job write calibration products there without the lock: their driver holds
// it. Move-only; released by the destructor (and by the holder's death).
class JobDirLock {
 public:
  // Creates job_dir if missing. FailedPrecondition naming the directory and the holder when
  // another process holds it. `holder`: what this process is ("qcal quantize --out /x").
  static StatusOr<JobDirLock> Acquire(const std::string& job_dir, const std::string& holder);
  JobDirLock() = default;
  JobDirLock(JobDirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  JobDirLock& operator=(JobDirLock&& other) noexcept;
  JobDirLock(const JobDirLock&) = delete;
  JobDirLock& operator=(const JobDirLock&) = delete;
  ~JobDirLock();

 private:
  explicit JobDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// JOB/lock.
std::string JobDirLockPath(const std::string& job_dir);

// Whether a failed job left anything worth keeping for a resume: a calibration product or
// other file in job_dir besides its journal, lock and input hashes, or any file in out_dir
// outside .staging. A run that fails before it produced anything removes the directories it
// created; one that produced something (a finished Hessian, a shard) keeps them whatever failed.
bool HoldsFinishedWork(const std::string& job_dir, const std::string& out_dir);

// ---- Staged output files (fencing: only an accepted attempt changes the output directory)

// out_dir/.staging. Created by PlanJob; a worker never creates it, so nothing is written there
// once finalize removed it.
std::string StagingDir(const std::string& out_dir);
// A task attempt's token for its staged file names ("block-3.a2"): letters, digits, '-', '.'.
std::string AttemptToken(const std::string& task_id);
// Writes `writer`'s safetensors file as the attempt's staged copy of out_dir/<name>:
// out_dir/.staging/<name>.<attempt> (atomic), checksummed as it is written. FailedPrecondition
// when the staging directory is gone (the job ended).
StatusOr<v1::WrittenFile> WriteStagedFile(const std::string& out_dir, const std::string& name,
                                          const std::string& attempt,
                                          const SafetensorsWriter& writer);
// Checks that each staged file exists with the size the result claims (no read) and names a
// plain file. DataLoss / InvalidArgument naming the file.
Status CheckStagedFiles(const std::string& out_dir, const std::vector<v1::WrittenFile>& files);
// The job's single writer accepts an attempt: renames every staged file over out_dir/<name> and
// makes the renames durable. Called before the result is journaled.
Status CommitFiles(const std::string& out_dir, const std::vector<v1::WrittenFile>& files);
// Removes out_dir/.staging and whatever stale attempts left in it.
Status RemoveStaging(const std::string& out_dir);

// ---- Results <-> journal entries

// {"event":"block_done","layer","shard","bytes","checksum","seconds","mse_before_ft",
//  "mse_after_ft","rank","ft_curves":[{"heldout":[...],"train":[...]}] (with fine-tuning),
//  "metrics":[...],"also_wrote":{name: checksum},"phases":[...]} (non-finite numbers as null).
nlohmann::json BlockDoneEntry(const v1::BlockResult& result);
v1::BlockResult BlockResultFromEntry(const nlohmann::json& entry);
// {"event":"e2e_done","checksums":{shard: checksum},"kl_before","kl_after","best_epoch",
//  "head_tuned","seconds"}
nlohmann::json E2eDoneEntry(const v1::FinetuneResult& result);
// Every output file a result wrote.
std::vector<v1::WrittenFile> FilesOf(const v1::BlockResult& result);

// Append-only journal of finished work; each Append is one JSON line, written and fsynced before
// it returns. A torn last line (crash mid-append) is ignored on Open; other garbage is DataLoss.
// Not thread-safe: one writer per job (the single process, or the coordinator).
class Journal {
 public:
  static StatusOr<Journal> Open(const std::string& path);
  const std::vector<nlohmann::json>& entries() const { return entries_; }
  Status Append(const nlohmann::json& entry);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<nlohmann::json> entries_;
};

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
  std::string job_dir;                // resolved (default out_dir + ".job")
  std::vector<bool> block_finished;   // shard present and its checksum matches block_done
  std::map<int64_t, nlohmann::json> block_done;  // layer -> its journal entry (finished ones)
  bool e2e_enabled = false;
  bool e2e_finished = false;          // e2e_done valid and every shard it lists intact
  nlohmann::json e2e_done;            // its journal entry when finished
  bool all_blocks_finished() const;
  std::vector<int64_t> pending_blocks() const;
  // Hessians, activations or the method's global phases still needed.
  bool needs_calibration(const Recipe& recipe) const;
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

// Copies the embeddings, final norm and (untied) head from the float checkpoint as stored (their
// dtype and bytes), streamed: no table is held in memory.
StatusOr<std::vector<std::string>> WriteNonBlockShard(const std::string& path,
                                                      CheckpointReader& float_ckpt,
                                                      const LlamaConfig& config);

// The "quantization_config" object written into config.json.
nlohmann::json MakeQuantizationConfig(const Recipe& recipe, double code_bits, double stored_bits);

// Bits per weight over all quantized linears, weighting each block_done entry's per-linear
// code_bits / stored_bits by the linear's size (from config), blocks in layer order.
struct BitsPerWeight {
  double code_bits = 0, stored_bits = 0;
};
BitsPerWeight AggregateBits(const LlamaConfig& config,
                            const std::map<int64_t, nlohmann::json>& block_done);

// Copies the tokenizer files a model directory has (tokenizer.model, tokenizer.json,
// tokenizer_config.json, special_tokens_map.json, generation_config.json) into out_dir.
Status CopyTokenizerFiles(const std::string& model_dir, const std::string& out_dir);
// Where a file copied out of `model_dir` may lie once links are resolved: the model directory
// (canonical) and, for a Hugging Face cache snapshot (REPO/snapshots/REV), REPO (its blobs/).
std::vector<std::string> CopyableRoots(const std::string& model_dir);
// InvalidArgument naming the file when a tokenizer file of `model_dir` could not be copied
// (a link out of the model directory, not a regular file, unreadable): checked before a job runs.
Status CheckTokenizerFilesCopyable(const std::string& model_dir);

// Writes the index (from the shards' headers), config.json (last: its presence marks a complete
// checkpoint) and copies the tokenizer files from `model_dir`.
// The index records every shard's checksum (metadata.qcal_fnv1a64, which readers verify):
// those in `checksums` (a job's journaled ones, for the shards accepted attempts wrote), the
// others computed from the files.
Status FinalizeCheckpoint(const std::string& out_dir, const std::string& model_dir,
                          const LlamaConfig& config, const nlohmann::json& quantization_config,
                          std::map<std::string, std::string> checksums = {});

// Writes model.safetensors.index.json over shards 0..num_blocks already in out_dir (from their
// headers). Used before end-to-end fine-tuning (so out_dir reads as a checkpoint) and by
// FinalizeCheckpoint.
// With `checksums`, they are recorded in the index (FinalizeCheckpoint).
Status WriteShardIndex(const std::string& out_dir, int64_t num_blocks,
                       const std::map<std::string, std::string>& checksums = {});

// Fnv1aHex of the file's bytes (the checksum journaled for shards); the read error otherwise.
StatusOr<std::string> FileChecksum(const std::string& path);

// Checks a block_done entry read from the journal: an object with event "block_done", layer in
// [0, num_blocks), shard == ShardName(layer + 1, num_blocks), and the shard (and any also_wrote
// file) in out_dir present with the entry's checksum. InvalidArgument / DataLoss naming the file.
Status CheckBlockDoneEntry(const nlohmann::json& entry, const std::string& out_dir,
                           int64_t num_blocks);
// Checks a worker's block result before it is accepted: layer in range, the block's shard name,
// plain file names, and staged files present with the sizes claimed (CheckStagedFiles).
Status CheckBlockResult(const v1::BlockResult& result, const std::string& out_dir,
                        int64_t num_blocks);

// Finishes a job whose block shards are all written and journaled (and, with end-to-end
// fine-tuning, e2e_done journaled): shard 0 when not fine-tuned end to end, index, config.json,
// tokenizer files; appends job_done. Returns a summary (bits per weight, blocks).
StatusOr<nlohmann::json> FinalizeJob(const Recipe& recipe, const std::string& model_dir,
                                     const std::string& out_dir, Journal* journal);

}  // namespace qcal
