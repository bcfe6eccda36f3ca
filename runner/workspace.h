// The job directory side of a job, behind an interface so the coordinator's JobManager is
// testable without real checkpoints (tests/coordinator/fakes.h). The disk implementation is
// runner/job_dir.h, journal.h and job_plan.h: planning, journal, staged files and their commit,
// finalization. Both drivers of a job's task plan use it (runner/quantize_job.h: `qcal quantize`
// in process; the coordinator with remote workers), so both write identical checkpoints.
//
// One workspace per job, never called concurrently: Open before any task runs, Check*/Commit/
// Append as tasks complete (the coordinator serializes them with the job's file mutex, outside
// its global lock), Finalize after the last block task.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/job_dir.h"
#include "runner/job_plan.h"
#include "common/recipe.h"
#include "common/status.h"
#include "proto/qcal.pb.h"
#include "report/report.h"

namespace qcal::job {

class JobWorkspace {
 public:
  virtual ~JobWorkspace() = default;
  // Locks the job directory for the job's life (JobDirLock: a `qcal quantize` or another
  // coordinator's job on it is refused, naming the holder), validates the model and any existing
  // journal against the recipe and fingerprints the inputs (PlanJob), creates the output and job
  // directories, locks the output directory for the job's life (OutputDirLock), opens
  // JOB/journal.jsonl and appends job_start.
  virtual StatusOr<JobPlan> Open(const Recipe& recipe, const v1::JobSpec& spec) = 0;
  // The job reached a final state: releases the output and job directories' locks.
  virtual void Close() {}
  // Whether Open got as far as holding the job directory (a job refused for another holder's
  // lock does not, and must touch nothing).
  virtual bool HoldsJobDir() const { return false; }
  // Checks a worker's block result before it is accepted: the block's shard name, staged files
  // present with the sizes claimed (nothing is read: the checksum was computed as the worker
  // wrote them, and finalize verifies every shard against the journal).
  virtual Status CheckBlock(const v1::BlockResult& result) = 0;
  // Staged files present with the sizes claimed.
  virtual Status CheckFiles(const std::vector<v1::WrittenFile>& files) = 0;
  // Accepts an attempt: renames its staged files into the output directory (before the result
  // is journaled).
  virtual Status Commit(const std::vector<v1::WrittenFile>& files) = 0;
  // Appends one journal entry (block_done / e2e_done from a worker), fsynced.
  virtual Status Append(const nlohmann::json& entry) = 0;
  // Removes committed expert-group part files (job_dir.h PartFileName) that an assembled
  // block's journaled shard now holds; other names are refused. Nothing to do by default.
  virtual Status Discard(const std::vector<std::string>& part_files) { return Status(); }
  // Shard 0 (unless end-to-end fine-tuned), index, config.json, tokenizer; appends job_done.
  // Returns the summary (bits per weight, ...).
  virtual StatusOr<nlohmann::json> Finalize(const Recipe& recipe, const v1::JobSpec& spec) = 0;
};

using WorkspaceFactory = std::function<std::unique_ptr<JobWorkspace>()>;

// The job directory on the local (shared) filesystem. `holder` names the driver in the job
// directory's lock (a second driver's refusal quotes it); empty: "qcal-coordinator, job for OUT".
std::unique_ptr<JobWorkspace> MakeDiskWorkspace(std::string holder = "");

// The job directory a spec resolves to (JobDirFor: job_dir, or DefaultJobDir(out_dir)).
std::string JobDirOf(const v1::JobSpec& spec);

// What the job report reads from a job directory (its journal), for the job whose output is
// `out_dir` ("": the journal's).
report::ReportInputs ReportInputsOf(const std::string& job_dir, const std::string& out_dir);

}  // namespace qcal::job
