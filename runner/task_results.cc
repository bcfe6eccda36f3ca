#include "runner/task_results.h"

#include "absl/strings/str_cat.h"
#include "runner/journal.h"

namespace qcal::job {

std::string WorkKey(const JobScheduler::TaskInfo& info) {
  return absl::StrCat(static_cast<int>(info.kind), ":", info.index);
}

StatusOr<std::vector<v1::WrittenFile>> ResultFiles(const v1::CompleteTaskRequest& result,
                                                   const JobScheduler::TaskInfo& info) {
  switch (info.kind) {
    case v1::TASK_KIND_CALIBRATE:
      if (!result.has_calibrate()) return absl::InvalidArgumentError("no calibration result");
      return std::vector<v1::WrittenFile>{};
    case v1::TASK_KIND_QUANTIZE_BLOCK:
      if (!result.has_block()) return absl::InvalidArgumentError("no block result");
      if (result.block().layer() != info.index) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the result is for block ", result.block().layer(), ", not ", info.index));
      }
      return FilesOf(result.block());
    case v1::TASK_KIND_FINETUNE_E2E:
      if (!result.has_finetune()) return absl::InvalidArgumentError("no fine-tuning result");
      return std::vector<v1::WrittenFile>(result.finetune().shards().begin(),
                                          result.finetune().shards().end());
    case v1::TASK_KIND_EVALUATE:
      if (!result.has_eval()) return absl::InvalidArgumentError("no evaluation result");
      return std::vector<v1::WrittenFile>{};
    default:
      return absl::InvalidArgumentError("unknown task kind");
  }
}

Acceptance AcceptResultFiles(JobWorkspace& workspace, const v1::CompleteTaskRequest& result,
                             const std::vector<v1::WrittenFile>& files) {
  Acceptance a;
  a.check = result.has_block() ? workspace.CheckBlock(result.block())
                               : workspace.CheckFiles(files);
  if (!a.check.ok()) return a;
  a.commit = workspace.Commit(files);
  if (!a.commit.ok()) return a;
  for (const nlohmann::json& entry : JournalEntries(result)) {
    a.commit = Annotate(workspace.Append(entry), "journal");
    if (!a.commit.ok()) return a;
  }
  return a;
}

std::vector<nlohmann::json> JournalEntries(const v1::CompleteTaskRequest& result) {
  std::vector<nlohmann::json> entries;
  if (result.has_block()) entries.push_back(BlockDoneEntry(result.block()));
  if (result.has_finetune()) entries.push_back(E2eDoneEntry(result.finetune()));
  if (result.has_calibrate()) {
    for (const v1::PhaseCurve& c : result.calibrate().curves()) {
      entries.push_back(PhaseDoneEntry(c));
    }
    if (result.calibrate().expert_loads_size() > 0) {
      entries.push_back(ExpertLoadEntry(result.calibrate()));
    }
  }
  return entries;
}

}  // namespace qcal::job
