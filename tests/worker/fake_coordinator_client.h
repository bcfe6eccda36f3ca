// A fake coordinator for task-loop tests (test-only): an in-process scheduler behind the
// CoordinatorClient interface, shared by all thread-ranks of a test. It plans with
// runner/job_plan.h (as the real coordinator does), hands CALIBRATE (with the params the plan
// needs) to every rank, then QUANTIZE_BLOCK tasks to whoever asks, then FINETUNE_E2E (with the
// finished blocks) to one rank, commits the workers' staged files and journals their results
// (checking each block result against its staged shard), finalizes, and answers SHUTDOWN.
// Knobs: cancel the job after some heartbeats / progress reports; fail the job on the first
// FailTask. Thread-safe.
#pragma once

#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/job_plan.h"
#include "runner/task_plan.h"
#include "runner/job_steps.h"
#include "worker/coordinator_client.h"

namespace qcal::testing {

class FakeCoordinator final : public worker::CoordinatorClient {
 public:
  struct Failure {
    std::string worker_id, task_id, error;
    bool retryable = false;
  };

  FakeCoordinator(v1::JobSpec spec, const Recipe& recipe, int world_size)
      : spec_(std::move(spec)), recipe_(recipe), world_size_(world_size) {
    const std::string job_dir =
        JobDirFor(spec_.job_dir(), spec_.out_dir());
    auto plan = PlanJob(recipe_, spec_.model_dir(), spec_.out_dir(), job_dir, spec_.data_root());
    if (!plan.ok()) {
      error_ = std::string(plan.status().message());
      return;
    }
    plan_ = std::move(*plan);
    auto journal = Journal::Open(plan_.job_dir + "/journal.jsonl");
    if (!journal.ok()) {
      error_ = std::string(journal.status().message());
      return;
    }
    journal_.emplace(std::move(*journal));
    (void)journal_->Append(JobStartEntry(recipe_, plan_, spec_.model_dir(), spec_.out_dir()));
    const TaskPlan tasks = MakeTaskPlan(recipe_, plan_);  // the coordinator's plan
    calibrate_ = tasks.calibrate;
    calibrate_params_ = tasks.calibrate_params;
    for (const auto& [layer, entry] : plan_.block_done) finished_[layer] = BlockResultFromEntry(entry);
    for (int64_t l : tasks.blocks) pending_.push_back(l);
    e2e_ = tasks.finetune_e2e;
  }

  // Knobs (call before the ranks start).
  void CancelAfterHeartbeats(int n) { cancel_after_heartbeats_ = n; }
  void CancelAfterProgressReports(int n) { cancel_after_progress_ = n; }
  void set_heartbeat_interval_ms(int64_t ms) { heartbeat_ms_ = ms; }

  // Observations.
  std::string error() const {
    std::lock_guard<std::mutex> l(mu_);
    return error_;
  }
  bool finalized() const {
    std::lock_guard<std::mutex> l(mu_);
    return finalized_;
  }
  std::vector<Failure> failures() const {
    std::lock_guard<std::mutex> l(mu_);
    return failures_;
  }
  std::map<std::string, int64_t> blocks_by_worker() const {
    std::lock_guard<std::mutex> l(mu_);
    return blocks_by_worker_;
  }
  int heartbeats() const {
    std::lock_guard<std::mutex> l(mu_);
    return heartbeats_;
  }
  int progress_reports() const {
    std::lock_guard<std::mutex> l(mu_);
    return progress_;
  }
  std::vector<std::string> calibrate_results() const {
    std::lock_guard<std::mutex> l(mu_);
    return calibrate_results_;
  }
  nlohmann::json summary() const {
    std::lock_guard<std::mutex> l(mu_);
    return summary_;
  }

  // ---- CoordinatorClient
  StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request) override {
    std::lock_guard<std::mutex> l(mu_);
    if (request.world_size() != world_size_ || request.rank() < 0 ||
        request.rank() >= world_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad rank ", request.rank(), " of ", request.world_size()));
    }
    v1::RegisterWorkerResponse r;
    r.set_worker_id(absl::StrCat("w", request.rank()));
    rank_of_[r.worker_id()] = request.rank();
    r.set_heartbeat_interval_ms(heartbeat_ms_);
    *r.mutable_spec() = spec_;
    r.set_inputs_key(plan_.inputs.key);
    return r;
  }

  StatusOr<v1::Task> NextTask(const std::string& worker_id) override {
    std::lock_guard<std::mutex> l(mu_);
    v1::Task t;
    t.set_job_id("job");
    if (!rank_of_.count(worker_id)) return absl::NotFoundError("unknown worker " + worker_id);
    if (!error_.empty() || cancelled_) {
      t.set_kind(v1::TASK_KIND_SHUTDOWN);
      t.set_reason(cancelled_ ? "cancelled" : "failed: " + error_);
      return t;
    }
    if (calibrate_) {
      if (!calibrate_given_.count(worker_id)) {
        calibrate_given_.insert(worker_id);
        t.set_kind(v1::TASK_KIND_CALIBRATE);
        t.set_task_id("calibrate");
        t.set_attempt(1);
        *t.mutable_calibrate() = calibrate_params_;
        return t;
      }
      return Wait();
    }
    if (!pending_.empty()) {
      const int64_t l = pending_.front();
      pending_.pop_front();
      t.set_kind(v1::TASK_KIND_QUANTIZE_BLOCK);
      t.set_task_id(absl::StrCat("block-", l));
      t.set_block(l);
      t.set_attempt(1);
      outstanding_.insert(t.task_id());
      return t;
    }
    if (!outstanding_.empty()) return Wait();
    if (e2e_) {
      if (!e2e_given_) {
        e2e_given_ = true;
        t.set_kind(v1::TASK_KIND_FINETUNE_E2E);
        t.set_task_id("e2e");
        t.set_attempt(1);
        for (const auto& [layer, r] : finished_) *t.add_finished_blocks() = r;
        return t;
      }
      return Wait();
    }
    if (!finalized_) {
      auto s = FinalizeJob(recipe_, spec_.model_dir(), spec_.out_dir(), &*journal_);
      if (!s.ok()) {
        error_ = std::string(s.status().message());
      } else {
        summary_ = *s;
        finalized_ = true;
      }
    }
    t.set_kind(v1::TASK_KIND_SHUTDOWN);
    t.set_reason(finalized_ ? "done" : "failed: " + error_);
    return t;
  }

  StatusOr<bool> ReportProgress(const v1::ReportProgressRequest&) override {
    std::lock_guard<std::mutex> l(mu_);
    ++progress_;
    if (cancel_after_progress_ > 0 && progress_ >= cancel_after_progress_) cancelled_ = true;
    return cancelled_;
  }

  Status CompleteTask(const v1::CompleteTaskRequest& request) override {
    std::lock_guard<std::mutex> l(mu_);
    const std::string& worker_id = request.worker_id();
    const std::string& task_id = request.task_id();
    if (task_id == "calibrate") {
      if (!request.has_calibrate()) return absl::InvalidArgumentError("no calibration result");
      calibrate_results_.push_back(request.calibrate().DebugString());
      calibrate_done_.insert(worker_id);
      if (static_cast<int>(calibrate_done_.size()) == world_size_) calibrate_ = false;
      return absl::OkStatus();
    }
    if (task_id == "e2e") {
      if (!request.has_finetune()) return absl::InvalidArgumentError("no fine-tuning result");
      e2e_ = false;
      const std::vector<v1::WrittenFile> files(request.finetune().shards().begin(),
                                               request.finetune().shards().end());
      QCAL_RETURN_IF_ERROR(CommitFiles(spec_.out_dir(), files));
      return journal_->Append(E2eDoneEntry(request.finetune()));
    }
    if (!outstanding_.erase(task_id)) return absl::NotFoundError("unknown task " + task_id);
    if (!request.has_block()) return absl::InvalidArgumentError("no block result");
    const v1::BlockResult& result = request.block();
    Status ok = CheckBlockResult(result, spec_.out_dir(), plan_.num_blocks);
    if (ok.ok()) ok = CommitFiles(spec_.out_dir(), FilesOf(result));
    if (!ok.ok()) {
      error_ = std::string(ok.message());
      return ok;
    }
    ++blocks_by_worker_[worker_id];
    finished_[result.layer()] = result;
    return journal_->Append(BlockDoneEntry(result));
  }

  Status FailTask(const std::string& worker_id, const std::string& task_id,
                  const std::string& error, bool retryable) override {
    std::lock_guard<std::mutex> l(mu_);
    failures_.push_back({worker_id, task_id, error, retryable});
    outstanding_.erase(task_id);
    if (error_.empty()) error_ = error;
    return absl::OkStatus();
  }

  StatusOr<bool> Heartbeat(const std::string&) override {
    std::lock_guard<std::mutex> l(mu_);
    ++heartbeats_;
    if (cancel_after_heartbeats_ > 0 && heartbeats_ >= cancel_after_heartbeats_) cancelled_ = true;
    return cancelled_;
  }

 private:
  v1::Task Wait() {
    v1::Task t;
    t.set_kind(v1::TASK_KIND_WAIT);
    t.set_retry_after_ms(5);
    return t;
  }

  const v1::JobSpec spec_;
  const Recipe recipe_;
  const int world_size_;
  mutable std::mutex mu_;
  JobPlan plan_;
  std::optional<Journal> journal_;
  std::map<std::string, int> rank_of_;
  bool calibrate_ = false;
  v1::CalibrateParams calibrate_params_;
  std::map<int64_t, v1::BlockResult> finished_;
  std::set<std::string> calibrate_given_, calibrate_done_;
  std::deque<int64_t> pending_;
  std::set<std::string> outstanding_;
  bool e2e_ = false, e2e_given_ = false;
  bool finalized_ = false;
  bool cancelled_ = false;
  std::string error_;
  std::vector<Failure> failures_;
  std::map<std::string, int64_t> blocks_by_worker_;
  std::vector<std::string> calibrate_results_;
  nlohmann::json summary_;
  int heartbeats_ = 0, progress_ = 0;
  int cancel_after_heartbeats_ = 0, cancel_after_progress_ = 0;
  int64_t heartbeat_ms_ = 20;
};

}  // namespace qcal::testing
