#include "runner/task_executor.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace qcal::job {

std::string TaskWhat(const v1::Task& task) {
  switch (task.kind()) {
    case v1::TASK_KIND_CALIBRATE:
      return "calibration";
    case v1::TASK_KIND_QUANTIZE_BLOCK:
      return absl::StrCat("block ", task.block());
    case v1::TASK_KIND_FINETUNE_E2E:
      return "end-to-end fine-tuning";
    case v1::TASK_KIND_EVALUATE:
      return absl::StrCat("evaluation of the ", task.eval().model(), " model on ",
                          task.eval().label());
    default:
      return absl::StrCat("task kind ", static_cast<int>(task.kind()));
  }
}

StatusOr<v1::CompleteTaskRequest> ExecuteTask(comm::Comm& comm, JobContext* ctx,
                                              const v1::Task& task, const JobEventFn& on_event) {
  v1::CompleteTaskRequest done;
  done.set_task_id(task.task_id());
  const std::string attempt = task.attempt_token().empty() ? task.task_id() : task.attempt_token();
  Status status;
  switch (task.kind()) {
    case v1::TASK_KIND_CALIBRATE: {
      auto r = CalibrateStep(comm, ctx, task.calibrate(), on_event);
      status = r.status();
      if (r.ok()) *done.mutable_calibrate() = std::move(*r);
      break;
    }
    case v1::TASK_KIND_QUANTIZE_BLOCK: {
      auto r = task.has_part()
                   ? QuantizeBlockPartStep(ctx, task.block(), task.part(),
                                           {task.block_parts().begin(), task.block_parts().end()},
                                           attempt, on_event)
                   : QuantizeBlockStep(ctx, task.block(), attempt, on_event);
      status = r.status();
      if (r.ok()) {
        r->set_rank(comm.rank());
        *done.mutable_block() = std::move(*r);
      }
      break;
    }
    case v1::TASK_KIND_FINETUNE_E2E: {
      const std::vector<v1::BlockResult> blocks(task.finished_blocks().begin(),
                                                task.finished_blocks().end());
      auto r = FinetuneE2EStep(ctx, blocks, attempt, on_event);
      status = r.status();
      if (r.ok()) *done.mutable_finetune() = std::move(*r);
      break;
    }
    case v1::TASK_KIND_EVALUATE: {
      auto r = EvaluateStep(ctx, task.eval(), on_event);
      status = r.status();
      if (r.ok()) *done.mutable_eval() = std::move(*r);
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no executor for task kind ", static_cast<int>(task.kind())));
  }
  if (!status.ok()) return AnnotateTaskError(status, TaskWhat(task));
  return done;
}

Status AnnotateTaskError(const Status& status, const std::string& what) {
  const bool named = absl::StartsWith(status.message(), what + ":") ||
                     absl::StartsWith(status.message(), what + ",");
  return named ? status : Annotate(status, what);
}

bool IsRetryable(const Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented:
      return false;
    default:
      return true;
  }
}

}  // namespace qcal::job
