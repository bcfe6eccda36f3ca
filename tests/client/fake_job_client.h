// An in-memory rpc::JobClient for the CLI's tests: jobs and their event streams are set by the
// test, and Watch streams can be made to break (UNAVAILABLE, or any error) after some events.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/job_client.h"

namespace qcal::testing {

class FakeJobClient : public rpc::JobClient {
 public:
  // What one Watch call does: deliver up to `events` events after after_seq (all: -1), then
  // return `status` (OK: the stream ended normally).
  struct StreamScript {
    int events = -1;
    Status status;
  };

  std::map<std::string, v1::Job> jobs;
  std::map<std::string, std::vector<v1::JobEvent>> events;
  std::deque<StreamScript> scripts;      // consumed one per Watch call; empty: deliver all, OK
  std::vector<int64_t> watch_after_seq;  // every Watch call's after_seq
  std::vector<v1::JobSpec> submitted;
  // Called at the end of every Watch call with the call's index (0, 1, ...): lets a test change
  // the job between streams.
  std::function<void(size_t call)> after_watch;

  // A job in `state` with events of increasing seq (1, 2, ...), one per message.
  void AddJob(const std::string& id, v1::JobState state, const std::vector<std::string>& messages) {
    v1::Job job;
    job.set_id(id);
    job.set_state(state);
    jobs[id] = job;
    for (const std::string& m : messages) {
      v1::JobEvent e;
      e.set_job_id(id);
      e.set_seq(static_cast<int64_t>(events[id].size()) + 1);
      e.set_kind(v1::JOB_EVENT_KIND_LOG);
      e.set_message(m);
      events[id].push_back(e);
    }
  }

  StatusOr<std::string> Submit(const v1::JobSpec& spec) override {
    submitted.push_back(spec);
    const std::string id = absl::StrCat("job-", submitted.size());
    v1::Job job;
    job.set_id(id);
    *job.mutable_spec() = spec;
    job.set_state(v1::JOB_STATE_QUEUED);
    jobs[id] = job;
    return id;
  }
  StatusOr<v1::Job> Get(const std::string& id) override {
    auto it = jobs.find(id);
    if (it == jobs.end()) return absl::NotFoundError(absl::StrCat("no job ", id));
    return it->second;
  }
  StatusOr<std::vector<v1::Job>> List() override {
    std::vector<v1::Job> out;
    for (const auto& [id, job] : jobs) out.push_back(job);
    return out;
  }
  StatusOr<v1::Job> Cancel(const std::string& id) override {
    auto it = jobs.find(id);
    if (it == jobs.end()) return absl::NotFoundError(absl::StrCat("no job ", id));
    it->second.set_state(v1::JOB_STATE_CANCELLED);
    return it->second;
  }
  Status Watch(const std::string& id, int64_t after_seq,
               const std::function<bool(const v1::JobEvent&)>& on_event) override {
    watch_after_seq.push_back(after_seq);
    StreamScript script;
    if (!scripts.empty()) {
      script = scripts.front();
      scripts.pop_front();
    }
    if (jobs.count(id) == 0) return absl::NotFoundError(absl::StrCat("no job ", id));
    int sent = 0;
    for (const v1::JobEvent& e : events[id]) {
      if (e.seq() <= after_seq) continue;
      if (script.events >= 0 && sent == script.events) break;
      ++sent;
      if (!on_event(e)) return absl::CancelledError("the watcher stopped");
    }
    if (after_watch) after_watch(watch_after_seq.size() - 1);
    return script.status;
  }
};

}  // namespace qcal::testing
