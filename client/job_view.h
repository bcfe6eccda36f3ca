// How the CLI's service commands show jobs: JSON for scripts (--json), tables for people, and
// the watcher that follows a job's event stream. Works on the qcal.v1 messages only (no model,
// no LibTorch); talks to the coordinator through rpc::JobClient, so tests drive it with a fake.
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "client/progress.h"
#include "common/status.h"
#include "proto/qcal.pb.h"
#include "rpc/job_client.h"

namespace qcal::client {

// The exit code of a command that waited for a job: 0 SUCCEEDED, 2 CANCELLED, 1 otherwise.
int ExitCodeFor(v1::JobState state);

// The job / event as `--json` prints it (blocks sorted, evaluations, the job's result).
nlohmann::json JobToJson(const v1::Job& job);
nlohmann::json EventToJson(const v1::JobEvent& event);

// "2026-11-23 22:48:52" in local time; "-" for 0.
std::string DateTime(double unix_seconds);
// A string someone else may have chosen (a job's name, paths, error), safe to print on a
// terminal: control characters (newlines, ESC, DEL) become \xNN, the rest is unchanged.
std::string Shown(const std::string& text);

// The per-block table (block, rank or "resumed", seconds, mean relative proxy loss).
void PrintBlockTable(const v1::Job& job);
// Bits per weight from a succeeded job's result.
void PrintResult(const v1::Job& job);

// `qcal status`: the spec, progress, the per-block table and, once it succeeded, bits per weight.
void PrintJob(const v1::Job& job);

// The evaluation phase's perplexities (Job.evals, computed by the workers): one row per data
// file with the float and the quantized model's perplexity. Prints nothing without evaluations.
void PrintEvalTable(const v1::Job& job);

// Follows a job's event stream: one line per event for people (a progress bar per phase on a
// terminal) or one JSON object per event. If the stream breaks (UNAVAILABLE) it reconnects from
// the last event seen, without showing an event twice, up to 10 times in a row; other errors
// end it.
class JobWatcher {
 public:
  JobWatcher(rpc::JobClient& client, bool json);
  // Until the job is in a final state; returns the final job.
  StatusOr<v1::Job> Follow(const std::string& id);
  void set_reconnect_delay(std::chrono::milliseconds d) { reconnect_delay_ = d; }

 private:
  void Line(const v1::JobEvent& e, const std::string& text, FILE* out = stdout);
  void Show(const v1::JobEvent& e);

  rpc::JobClient& client_;
  const bool json_;
  const bool tty_;
  std::chrono::milliseconds reconnect_delay_{1000};
  std::unique_ptr<ProgressBar> bar_;
  std::string bar_phase_;
};

}  // namespace qcal::client
