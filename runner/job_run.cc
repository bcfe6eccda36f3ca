#include "runner/job_run.h"

#include <utility>

#include "runner/journal.h"

namespace qcal::job {

JobRun::JobRun(std::string id, int world_size, const Recipe& recipe, const JobPlan& plan,
               const std::vector<v1::EvalParams>& evals, int max_attempts, int64_t wait_ms)
    : tasks_(MakeTaskPlan(recipe, plan, evals)),
      scheduler_(std::move(id), world_size, tasks_, max_attempts, wait_ms) {
  for (const auto& [layer, entry] : plan.block_done) finished_[layer] = BlockResultFromEntry(entry);
  parts_ = tasks_.parts_done;
}

v1::Task JobRun::Next(const std::string& worker_id, int rank) {
  v1::Task task = scheduler_.Next(worker_id, rank);
  if (task.kind() == v1::TASK_KIND_FINETUNE_E2E) {
    for (const auto& [layer, block] : finished_) *task.add_finished_blocks() = block;
  }
  if (task.kind() == v1::TASK_KIND_QUANTIZE_BLOCK && task.has_part() && task.part().index() == 0) {
    auto it = parts_.find(task.block());
    if (it != parts_.end()) {
      for (const auto& [part, result] : it->second) *task.add_block_parts() = result;
    }
  }
  return task;
}

StatusOr<JobScheduler::Completion> JobRun::Record(const std::string& worker_id, int rank,
                                                  const v1::CompleteTaskRequest& result) {
  QCAL_ASSIGN_OR_RETURN(JobScheduler::Completion c,
                        scheduler_.Complete(worker_id, rank, result.task_id()));
  if (!c.duplicate && c.kind == v1::TASK_KIND_QUANTIZE_BLOCK && c.part > 0) {
    v1::BlockResult part = BlockResultFromEntry(BlockPartDoneEntry(result.block()));
    part.mutable_part()->set_index(c.part);
    parts_[c.block][c.part] = std::move(part);
  } else if (!c.duplicate && c.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    finished_[c.block] = BlockResultFromEntry(BlockDoneEntry(result.block()));
    parts_.erase(c.block);
  }
  return c;
}

}  // namespace qcal::job
