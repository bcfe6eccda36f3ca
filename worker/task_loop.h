// The worker's task loop: one rank of a job's MPI world (or one thread-rank in tests) registers
// with the coordinator, keeps a heartbeat, and executes tasks until told to shut down:
//
//   CALIBRATE, QUANTIZE_BLOCK, FINETUNE_E2E, EVALUATE
//                   runner/task_executor.h ExecuteTask (the executor `qcal quantize` runs in
//                   process too; calibration is collective over `comm`), then CompleteTask with
//                   its result (the coordinator commits and journals the staged files)
//   WAIT            sleep retry_after_ms, ask again
//   SHUTDOWN        return
//
// A task that fails is reported with FailTask (error naming the file / problem; retryable false
// for bad input: InvalidArgument, FailedPrecondition, NotFound, DataLoss, OutOfRange,
// PermissionDenied, Unimplemented). Progress of long steps goes out with ReportProgress.
// Cancellation (a Heartbeat or ReportProgress answering cancelled) calls `on_cancelled`
// immediately from whichever thread saw it (qcal-worker exits there, non-zero); the loop itself
// also stops before its next task with Cancelled.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "kernels/gpu_backend.h"
#include "engine/comm/comm.h"
#include "worker/coordinator_client.h"

namespace qcal::worker {

struct TaskLoopOptions {
  std::string job_id;
  int threads = 0;       // > 0: overrides the job's threads_per_worker
  std::string hostname;  // for RegisterWorker (default: gethostname)
  std::string device = "cpu";
  // GPU ranks: an all-reduce of device buffers over the job's ranks (NCCL), for the Hessian sums
  // (calib::CalibrationOptions::device_sum). Empty: everything goes through `comm`.
  kernels::DeviceInt64Sum device_sum;
  // Heartbeat period when the coordinator gives none (its RegisterWorkerResponse wins).
  int64_t default_heartbeat_ms = 2000;
  // After this many consecutive failed heartbeats the coordinator counts as lost: on_lost.
  int max_missed_heartbeats = 30;
  // NextTask retries on Unavailable / DeadlineExceeded before giving up.
  int next_task_retries = 10;
  std::function<void()> on_cancelled;  // default: nothing (the loop stops before its next task)
  std::function<void()> on_lost;       // default: nothing
};

struct TaskLoopResult {
  std::string worker_id;
  int64_t tasks_completed = 0;
  int64_t tasks_failed = 0;
  int64_t blocks_quantized = 0;
  std::string shutdown_reason;
};

// Runs until SHUTDOWN (OK), cancellation (Cancelled), or an error talking to the coordinator.
// Task failures are reported to the coordinator and do not end the loop.
StatusOr<TaskLoopResult> RunTaskLoop(CoordinatorClient& client, comm::Comm& comm,
                                     const TaskLoopOptions& options);

}  // namespace qcal::worker
