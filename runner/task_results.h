// What both drivers of a job do with a task's result (runner/quantize_job.cc in process,
// coordinator/worker_requests.cc for remote workers): check it against the task it answers, and
// accept its staged files into the output (checked, renamed, journaled). Torch-free.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "proto/qcal.pb.h"
#include "runner/scheduler.h"
#include "runner/workspace.h"

namespace qcal::job {

// The work a task stands for, whatever its attempt: two attempts of one block share it.
std::string WorkKey(const JobScheduler::TaskInfo& info);

// A result checked against its task's kind and index (no I/O): InvalidArgument when it answers
// another task. Returns the staged files it names (none for calibration and evaluation).
StatusOr<std::vector<v1::WrittenFile>> ResultFiles(const v1::CompleteTaskRequest& result,
                                                   const JobScheduler::TaskInfo& info);

// What a result adds to the journal (runner/journal.h): a block's block_done, end-to-end
// fine-tuning's e2e_done, calibration's phase_done per global phase that trained (rank 0's
// result); nothing for evaluation.
std::vector<nlohmann::json> JournalEntries(const v1::CompleteTaskRequest& result);

// Accepting an attempt, in two outcomes: `check` fails when its staged files are not as the
// result claims (a bad attempt: its work may be retried), `commit` when renaming them into the
// output or journaling the result (JournalEntries) failed (the job cannot go on). A driver
// accepts every result with files or journal entries, and records the others at once.
struct Acceptance {
  Status check;
  Status commit;
  bool ok() const { return check.ok() && commit.ok(); }
};
Acceptance AcceptResultFiles(JobWorkspace& workspace, const v1::CompleteTaskRequest& result,
                             const std::vector<v1::WrittenFile>& files);

}  // namespace qcal::job
