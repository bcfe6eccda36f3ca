#include "runner/task_results.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "runner/journal.h"

namespace qcal::job {

std::string WorkKey(const JobScheduler::TaskInfo& info) {
  return absl::StrCat(static_cast<int>(info.kind), ":", info.index, ":", info.part);
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
      if ((info.part > 0) != (result.block().has_part() && result.block().part().index() > 0) ||
          (info.part > 0 && result.block().part().index() != info.part)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the result is for part ", result.block().part().index(), " of block ", info.index,
            ", the task was part ", info.part));
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
  if (result.has_block() && result.block().merged_parts_size() > 0) {
    // The block's shard holds its expert groups now: their part files go (a failure here loses
    // nothing; finalize removes what is left).
    std::vector<std::string> names;
    for (const v1::WrittenFile& f : result.block().merged_parts()) names.push_back(f.name());
    const Status removed = workspace.Discard(names);
    if (!removed.ok()) {
      QCAL_LOG_WARN("block {}: {}", result.block().layer(), std::string(removed.message()));
    }
  }
  return a;
}

std::vector<nlohmann::json> JournalEntries(const v1::CompleteTaskRequest& result) {
  std::vector<nlohmann::json> entries;
  if (result.has_block()) {
    const bool group = result.block().has_part() && result.block().part().index() > 0;
    entries.push_back(group ? BlockPartDoneEntry(result.block()) : BlockDoneEntry(result.block()));
  }
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
