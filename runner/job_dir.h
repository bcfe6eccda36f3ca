// The job directory: every path a job keeps beside its checkpoint, named here and nowhere else,
// and the locks and staging area of a job. Torch-free: both drivers (the coordinator, and
// `qcal quantize` in process) and the worker use it; engine/ receives the directories it writes
// into (calib::CalibrationDirs), it never names them.
//
//   JOB/ (default OUT.job: DefaultJobDir, the one place it is derived)
//     journal.jsonl            append-only, fsynced: job_start, block_done, e2e_done, job_done
//                              (runner/journal.h; docs/formats.md)
//     lock                     the driver's lock (JobDirLock): who drives the job
//     inputs.json              content hashes of the inputs (runner/input_fingerprint.h)
//     hessians/, activations/  calibration products (engine/calib/cache.h), keyed by the inputs
//     phases/<phase>.safetensors  a global phase's products (and resumable state)
//     sequential/              the quantized model's block inputs (sequential calibration)
//     spill/                   activations above the memory budget (calibration, fine-tuning,
//                              evaluation), removed with the job directory
//     report.html              the job report (report/report.h), written when the job finishes
//     workers.log, workers.pid the service's launched worker group: its output and process
//   OUT/.staging/<file>.<attempt>  what a task attempt wrote; renamed into OUT by the job's single
//                              writer when it accepts the attempt (CommitFiles), removed by
//                              finalize
// The checkpoint's own files (shards, index, config.json) are common/checkpoint_layout.h's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "proto/job.pb.h"

namespace qcal {

// OUT.job: the job directory of an output directory when none is given.
std::string DefaultJobDir(const std::string& out_dir);
// `job_dir`, or DefaultJobDir(out_dir) when empty.
std::string JobDirFor(const std::string& job_dir, const std::string& out_dir);

// The paths inside one job directory.
struct JobPaths {
  explicit JobPaths(const std::string& job_dir);
  std::string dir;          // JOB
  std::string journal;      // JOB/journal.jsonl
  std::string lock;         // JOB/lock
  std::string inputs;       // JOB/inputs.json
  std::string hessians;     // JOB/hessians
  std::string activations;  // JOB/activations
  std::string phases;       // JOB/phases
  std::string sequential;   // JOB/sequential
  std::string spill;        // JOB/spill
  std::string report;       // JOB/report.html
  std::string workers_log;  // JOB/workers.log
  std::string workers_pid;  // JOB/workers.pid
  // JOB/phases/<phase>.safetensors: a global phase's products.
  std::string PhaseProducts(const std::string& phase) const;
  // JOB/sequential/inputs-<layer>.safetensors: the quantized model's input of block `layer`.
  std::string SequentialInputs(int64_t layer) const;
  // JOB/sequential/float-inputs-<layer>.safetensors: the float model's, where a method needs both.
  std::string SequentialFloatInputs(int64_t layer) const;
};

// A job directory (it holds journal.jsonl) or an output directory whose default job directory
// (DefaultJobDir) holds one: the job directory, and the output directory when `dir` was one
// (else ""). InvalidArgument naming the directory when neither.
struct FoundJob {
  std::string job_dir, out_dir;
};
StatusOr<FoundJob> FindJob(const std::string& dir);

// FailedPrecondition naming `out_dir` when it is the output of a job that has not finished (no
// config.json yet, and a staging area or a default job directory's journal): what to do instead
// of exporting or evaluating it. OK otherwise (a finished checkpoint, or no job's output at all).
Status CheckJobFinished(const std::string& out_dir);

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

// ---- Expert-group part files (a MoE block split over tasks: runner/task_plan.h)
// out_dir/.qcal-part-LLLLL-BBBBB-EEEEE.safetensors: the routed experts [begin, end) of block
// `layer`, quantized by their own task and committed like a shard, until the assembled block's
// shard holds them (then removed; finalize removes any left). Hidden: no checkpoint reader lists
// it.
std::string PartFileName(int64_t layer, int64_t begin, int64_t end);
bool IsPartFileName(const std::string& name);
// Removes every part file in out_dir.
Status RemovePartFiles(const std::string& out_dir);

}  // namespace qcal
