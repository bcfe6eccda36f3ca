#include "runner/workspace.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "report/report.h"

namespace qcal::job {
namespace {

class DiskWorkspace : public JobWorkspace {
 public:
  explicit DiskWorkspace(std::string holder) : holder_(std::move(holder)) {}

  StatusOr<JobPlan> Open(const Recipe& recipe, const v1::JobSpec& spec) override {
    const std::string holder =
        holder_.empty() ? absl::StrCat("qcal-coordinator, job for ", spec.out_dir()) : holder_;
    QCAL_ASSIGN_OR_RETURN(job_lock_, JobDirLock::Acquire(JobDirOf(spec), holder));
    job_lock_held_ = true;
    QCAL_ASSIGN_OR_RETURN(JobPlan plan, PlanJob(recipe, spec.model_dir(), spec.out_dir(),
                                                JobDirOf(spec), spec.data_root()));
    QCAL_ASSIGN_OR_RETURN(lock_, OutputDirLock::Acquire(spec.out_dir()));
    QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(JobPaths(plan.job_dir).journal));
    journal_.emplace(std::move(journal));
    out_dir_ = spec.out_dir();
    num_blocks_ = plan.num_blocks;
    plan.experts_per_task = spec.experts_per_task();
    QCAL_RETURN_IF_ERROR(
        journal_->Append(JobStartEntry(recipe, plan, spec.model_dir(), spec.out_dir())));
    return plan;
  }

  Status CheckBlock(const v1::BlockResult& result) override {
    return CheckBlockResult(result, out_dir_, num_blocks_);
  }

  Status CheckFiles(const std::vector<v1::WrittenFile>& files) override {
    return CheckStagedFiles(out_dir_, files);
  }

  Status Commit(const std::vector<v1::WrittenFile>& files) override {
    return CommitFiles(out_dir_, files);
  }

  Status Append(const nlohmann::json& entry) override {
    if (!journal_) return absl::FailedPreconditionError("the job's journal is not open");
    return journal_->Append(entry);
  }

  Status Discard(const std::vector<std::string>& part_files) override {
    for (const std::string& name : part_files) {
      if (!IsPartFileName(name)) {
        return absl::InvalidArgumentError(absl::StrCat("'", name, "' is no part file"));
      }
      const std::string path = out_dir_ + "/" + name;
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
        return absl::InternalError(
            absl::StrCat(path, ": cannot remove: ", std::strerror(errno)));
      }
    }
    return Status();
  }

  bool HoldsJobDir() const override { return job_lock_held_; }

  void Close() override {
    lock_ = OutputDirLock();
    job_lock_ = JobDirLock();
  }

  StatusOr<nlohmann::json> Finalize(const Recipe& recipe, const v1::JobSpec& spec) override {
    if (!journal_) return absl::FailedPreconditionError("the job's journal is not open");
    QCAL_ASSIGN_OR_RETURN(nlohmann::json summary,
                          FinalizeJob(recipe, spec.model_dir(), spec.out_dir(), &*journal_));
    // The job report (report/report.h); the checkpoint is finished whether or not it is written.
    const JobPaths paths(JobDirOf(spec));
    const Status written =
        report::WriteReport(ReportInputsOf(paths.dir, spec.out_dir()), paths.report);
    if (written.ok()) {
      summary["report"] = paths.report;
    } else {
      QCAL_LOG_WARN("the job report was not written: {}", written.ToString());
    }
    return summary;
  }

 private:
  const std::string holder_;
  bool job_lock_held_ = false;
  std::optional<Journal> journal_;
  OutputDirLock lock_;
  JobDirLock job_lock_;
  std::string out_dir_;     // set by Open, read-only afterwards
  int64_t num_blocks_ = 0;
};

}  // namespace

std::unique_ptr<JobWorkspace> MakeDiskWorkspace(std::string holder) {
  return std::make_unique<DiskWorkspace>(std::move(holder));
}

std::string JobDirOf(const v1::JobSpec& spec) {
  return JobDirFor(spec.job_dir(), spec.out_dir());
}

report::ReportInputs ReportInputsOf(const std::string& job_dir, const std::string& out_dir) {
  const JobPaths paths(job_dir);
  report::ReportInputs in;
  in.journal = paths.journal;
  in.out_dir = out_dir;
  return in;
}

}  // namespace qcal::job
