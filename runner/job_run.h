// One run of a job, the loop both drivers wrap: the coordinator (coordinator/job_driver.cc and
// worker_requests.cc, tasks handed to MPI workers over gRPC) and `qcal quantize`
// (runner/quantize_job.cc, tasks executed in process). It holds the scheduler over the job's task
// plan and the finished blocks (seeded from the plan's journaled blocks, grown by each accepted
// block) and says what comes next:
//
//   JobRun run(id, world, recipe, plan, evals);     // resumed blocks are finished already
//   loop:  run.finalize_due()  → the driver finalizes (JobWorkspace::Finalize),
//                                run.FinalizeDone()
//          task = run.Next(worker, rank)            // FINETUNE_E2E carries every finished block
//          (the task runs; its files are accepted: runner/task_results.h AcceptResultFiles)
//          run.Record(worker, rank, result)        // counted; a block joins the finished ones
//   until run.done()
//
// The failure policy (requeues, lost ranks and groups, attempts) is the scheduler's
// (runner/scheduler.h), reached through scheduler(). Torch-free; not thread-safe (the coordinator
// calls it under its lock).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"
#include "proto/qcal.pb.h"
#include "runner/job_plan.h"
#include "runner/scheduler.h"
#include "runner/task_plan.h"

namespace qcal::job {

class JobRun {
 public:
  // `evals`: the evaluation tasks after finalize (float then quantized model, per file).
  JobRun(std::string id, int world_size, const Recipe& recipe, const JobPlan& plan,
         const std::vector<v1::EvalParams>& evals = {}, int max_attempts = 3,
         int64_t wait_ms = 200);

  const TaskPlan& tasks() const { return tasks_; }
  JobScheduler& scheduler() { return scheduler_; }
  const JobScheduler& scheduler() const { return scheduler_; }
  // Every finished block's result, by layer: those the plan resumed and those recorded since, as
  // their journal entries read back (runner/journal.h BlockResultFromEntry).
  const std::map<int64_t, v1::BlockResult>& finished() const { return finished_; }

  // The next task for `worker_id` of `rank`, with what it needs (FINETUNE_E2E: every finished
  // block; a split block's assembly: its expert groups' results). WAIT when nothing is ready,
  // SHUTDOWN once the job failed (scheduler().error()).
  v1::Task Next(const std::string& worker_id, int rank);
  // A result whose files were accepted (or that has none): the scheduler counts it (a duplicate
  // is retired, nothing recorded) and a block joins the finished blocks (an expert group its
  // block's finished groups).
  StatusOr<JobScheduler::Completion> Record(const std::string& worker_id, int rank,
                                            const v1::CompleteTaskRequest& result);

  // Every block (and end-to-end fine-tuning) is done: the driver writes the checkpoint now.
  bool finalize_due() const { return scheduler_.awaiting_finalize(); }
  // The checkpoint is written: on to evaluation, or done.
  void FinalizeDone() { scheduler_.FinalizeDone(); }
  bool done() const { return scheduler_.done(); }

 private:
  const TaskPlan tasks_;
  JobScheduler scheduler_;
  std::map<int64_t, v1::BlockResult> finished_;
  std::map<int64_t, std::map<int, v1::BlockResult>> parts_;  // split blocks' finished groups
};

}  // namespace qcal::job
