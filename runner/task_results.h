// What both drivers of a job do with a task's result (runner/run_job.h in process,
// coordinator/worker_requests.cc for remote workers): check it against the task it answers, and
// accept its staged files into the output (checked, renamed, journaled). Torch-free.
#pragma once

#include <string>
#include <vector>

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

// Accepting an attempt's staged files, in two outcomes: `check` fails when the files are not as
// the result claims (a bad attempt: its work may be retried), `commit` when renaming them into
// the output or journaling them (block_done / e2e_done) failed (the job cannot go on).
struct Acceptance {
  Status check;
  Status commit;
  bool ok() const { return check.ok() && commit.ok(); }
};
Acceptance AcceptResultFiles(JobWorkspace& workspace, const v1::CompleteTaskRequest& result,
                             const std::vector<v1::WrittenFile>& files);

}  // namespace qcal::job
