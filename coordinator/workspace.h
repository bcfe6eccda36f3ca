// The job directory side of a service job, behind an interface so the JobManager is testable
// without real checkpoints (tests/coordinator/fakes.h). The disk implementation is
// common/job_layout: the same planning, journal and finalization as the single-process
// `qcal quantize`, so both write identical checkpoints.
//
// One workspace per job. The JobManager never calls it concurrently: Open before any worker
// exists, Check*/Commit/Append while tasks complete (under the manager's lock), Finalize after
// the last block task.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/job_layout.h"
#include "common/recipe.h"
#include "common/status.h"
#include "proto/qcal.pb.h"

namespace qcal::coordinator {

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
  // Shard 0 (unless end-to-end fine-tuned), index, config.json, tokenizer; appends job_done.
  // Returns the summary (bits per weight, ...).
  virtual StatusOr<nlohmann::json> Finalize(const Recipe& recipe, const v1::JobSpec& spec) = 0;
};

using WorkspaceFactory = std::function<std::unique_ptr<JobWorkspace>()>;

// common/job_layout on the local (shared) filesystem.
std::unique_ptr<JobWorkspace> MakeDiskWorkspace();

// The job directory a spec resolves to (job_dir, or out_dir + ".job").
std::string JobDirOf(const v1::JobSpec& spec);

}  // namespace qcal::coordinator
