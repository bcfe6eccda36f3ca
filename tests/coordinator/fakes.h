// Test doubles for the coordinator's boundaries: clock, state filesystem, launcher, job
// workspace (test-only; header-only target qcal_coordinator_fakes).
#pragma once

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator/clock.h"
#include "coordinator/launcher.h"
#include "coordinator/state_fs.h"
#include "runner/workspace.h"

namespace qcal::coordinator::testing {

using job::JobDirOf;
using job::JobWorkspace;

class FakeClock : public Clock {
 public:
  double MonotonicSeconds() const override {
    std::lock_guard<std::mutex> l(mu_);
    return now_;
  }
  double UnixSeconds() const override {
    std::lock_guard<std::mutex> l(mu_);
    return 1.7e9 + now_;
  }
  void Advance(double seconds) {
    std::lock_guard<std::mutex> l(mu_);
    now_ += seconds;
  }

 private:
  mutable std::mutex mu_;
  double now_ = 1000;
};

// An in-memory state directory; writes can be made to fail.
class MemStateFs : public StateFs {
 public:
  Status MakeDirs(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    dirs_.insert(path);
    return absl::OkStatus();
  }
  Status WriteFileAtomic(const std::string& path, const std::string& contents) override {
    std::lock_guard<std::mutex> l(mu_);
    if (fail_writes) return absl::UnavailableError(path + ": disk full (fake)");
    files_[path] = contents;
    return absl::OkStatus();
  }
  StatusOr<std::string> ReadFile(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = files_.find(path);
    if (it == files_.end()) return absl::NotFoundError(path + ": no such file (fake)");
    return it->second;
  }
  StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) override {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::string> out;
    for (const auto& [path, contents] : files_) {
      if (path.size() > dir.size() + 1 && path.compare(0, dir.size() + 1, dir + "/") == 0 &&
          path.find('/', dir.size() + 1) == std::string::npos) {
        out.push_back(path.substr(dir.size() + 1));
      }
    }
    return out;
  }
  void Put(const std::string& path, const std::string& contents) {
    std::lock_guard<std::mutex> l(mu_);
    files_[path] = contents;
  }
  // A copy of every file (to "restart" a coordinator from the state it had at this moment).
  std::map<std::string, std::string> Snapshot() {
    std::lock_guard<std::mutex> l(mu_);
    return files_;
  }
  void Restore(const std::map<std::string, std::string>& files) {
    std::lock_guard<std::mutex> l(mu_);
    files_ = files;
  }
  std::atomic<bool> fail_writes{false};

 private:
  std::mutex mu_;
  std::set<std::string> dirs_;
  std::map<std::string, std::string> files_;
};

// What a FakeLauncher's group went through; shared with the test.
struct FakeGroupState {
  std::mutex mu;
  LaunchSpec spec;
  std::optional<std::string> exit;  // set by the test: the group exited
  int terminates = 0;
  int kills = 0;
  bool ignore_sigterm = false;  // else Terminate makes the group exit
  std::string log = "line 1\nline 2: something broke\n";
};

class FakeLauncher : public Launcher {
 public:
  StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec& spec) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!fail_with.ok()) return fail_with;
    auto state = std::make_shared<FakeGroupState>();
    state->spec = spec;
    state->ignore_sigterm = ignore_sigterm;
    groups_.push_back(state);
    return std::unique_ptr<WorkerGroup>(new Group(state));
  }
  std::vector<std::shared_ptr<FakeGroupState>> groups() {
    std::lock_guard<std::mutex> l(mu_);
    return groups_;
  }
  Status fail_with = absl::OkStatus();
  bool ignore_sigterm = false;  // for the groups launched from now on

 private:
  class Group : public WorkerGroup {
   public:
    explicit Group(std::shared_ptr<FakeGroupState> s) : s_(std::move(s)) {}
    std::optional<std::string> Poll() override {
      std::lock_guard<std::mutex> l(s_->mu);
      return s_->exit;
    }
    void Terminate() override {
      std::lock_guard<std::mutex> l(s_->mu);
      ++s_->terminates;
      if (!s_->ignore_sigterm) s_->exit = "killed by signal 15";
    }
    void Kill() override {
      std::lock_guard<std::mutex> l(s_->mu);
      ++s_->kills;
      s_->exit = "killed by signal 9";
    }
    std::string LogTail(int) override {
      std::lock_guard<std::mutex> l(s_->mu);
      return s_->log;
    }
    std::string Describe() const override { return "fake group"; }

   private:
    std::shared_ptr<FakeGroupState> s_;
  };
  std::mutex mu_;
  std::vector<std::shared_ptr<FakeGroupState>> groups_;
};

// A job directory in memory: a model of `num_blocks` blocks, some already finished.
struct FakeWorkspaceState {
  std::mutex mu;
  int64_t num_blocks = 4;
  std::set<int64_t> finished;      // blocks an earlier run finished
  Status open_error = absl::OkStatus();
  Status finalize_error = absl::OkStatus();
  Status check_error = absl::OkStatus();  // CheckBlock's / CheckFiles' answer
  std::vector<std::string> committed;       // the files Commit renamed, in order
  // When set, Commit waits for it before renaming (a slow filesystem), outside `mu`.
  std::shared_future<void> commit_gate;
  std::atomic<int> commits_waiting{0};
  std::vector<nlohmann::json> journal;
  int finalized = 0;
};

class FakeWorkspace : public JobWorkspace {
 public:
  explicit FakeWorkspace(std::shared_ptr<FakeWorkspaceState> s) : s_(std::move(s)) {}
  StatusOr<JobPlan> Open(const Recipe& recipe, const v1::JobSpec& spec) override {
    std::lock_guard<std::mutex> l(s_->mu);
    if (!s_->open_error.ok()) return s_->open_error;
    JobPlan plan;
    plan.num_blocks = s_->num_blocks;
    plan.job_dir = JobDirOf(spec);
    plan.block_finished.assign(s_->num_blocks, false);
    for (int64_t b : s_->finished) {
      plan.block_finished[b] = true;
      plan.block_done[b] = {{"event", "block_done"}, {"layer", b}, {"seconds", 0.5}};
    }
    plan.e2e_enabled = recipe.finetune.end_to_end.enabled;
    s_->journal.push_back({{"event", "job_start"}});
    return plan;
  }
  Status CheckBlock(const v1::BlockResult&) override {
    std::lock_guard<std::mutex> l(s_->mu);
    return s_->check_error;
  }
  Status CheckFiles(const std::vector<v1::WrittenFile>&) override {
    std::lock_guard<std::mutex> l(s_->mu);
    return s_->check_error;
  }
  Status Commit(const std::vector<v1::WrittenFile>& files) override {
    std::shared_future<void> gate;
    {
      std::lock_guard<std::mutex> l(s_->mu);
      gate = s_->commit_gate;
    }
    if (gate.valid()) {
      ++s_->commits_waiting;
      gate.wait();
      --s_->commits_waiting;
    }
    std::lock_guard<std::mutex> l(s_->mu);
    for (const v1::WrittenFile& f : files) s_->committed.push_back(f.name());
    return absl::OkStatus();
  }
  Status Append(const nlohmann::json& entry) override {
    std::lock_guard<std::mutex> l(s_->mu);
    s_->journal.push_back(entry);
    return absl::OkStatus();
  }
  StatusOr<nlohmann::json> Finalize(const Recipe&, const v1::JobSpec&) override {
    std::lock_guard<std::mutex> l(s_->mu);
    if (!s_->finalize_error.ok()) return s_->finalize_error;
    ++s_->finalized;
    s_->journal.push_back({{"event", "job_done"}});
    return nlohmann::json{{"code_bits_per_weight", 2.0}};
  }

 private:
  std::shared_ptr<FakeWorkspaceState> s_;
};

}  // namespace qcal::coordinator::testing
