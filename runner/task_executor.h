// One task of a job's plan executed on this rank: the work both drivers hand out
// (runner/scheduler.h) and both executors run, the worker process for the coordinator
// (worker/task_loop.cc) and `qcal quantize` in process (runner/quantize_job.cc).
//
//   CALIBRATE       CalibrateStep over `comm` (collective: every rank of the world runs it)
//   QUANTIZE_BLOCK  QuantizeBlockStep: the block's shard as the attempt's staged file
//   FINETUNE_E2E    FinetuneE2EStep on the task's finished blocks (every shard staged again)
//   EVALUATE        EvaluateStep: perplexity of the float or quantized model on one file
//
// The staged files carry the task's attempt token (else its id), so two attempts of one block
// never write the same file; the driver commits one of them (runner/task_results.h).
#pragma once

#include <string>

#include "common/status.h"
#include "engine/comm/comm.h"
#include "proto/qcal.pb.h"
#include "runner/job_steps.h"

namespace qcal::job {

// What the task is, for messages and logs: "calibration", "block 3", "end-to-end fine-tuning",
// "evaluation of the quantized model on wikitext2".
std::string TaskWhat(const v1::Task& task);

// Runs `task` (one of the four kinds above; InvalidArgument for another) and returns its result:
// a CompleteTaskRequest with task_id and the typed result set (the caller adds its worker id).
// Errors are the step's, prefixed with TaskWhat unless the message already names it.
StatusOr<v1::CompleteTaskRequest> ExecuteTask(comm::Comm& comm, JobContext* ctx,
                                              const v1::Task& task,
                                              const JobEventFn& on_event = nullptr);

// A task's error prefixed with the task ("block 3: ..."), unless the message already starts with
// it ("calibration: no files given", "calibration, block 2: ..." are not made "calibration:
// calibration...").
Status AnnotateTaskError(const Status& status, const std::string& what);

// Whether a task failure is worth retrying elsewhere (false for bad input: InvalidArgument,
// FailedPrecondition, NotFound, DataLoss, OutOfRange, PermissionDenied, Unimplemented).
bool IsRetryable(const Status& status);

}  // namespace qcal::job
