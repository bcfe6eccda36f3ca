// Progress of a job's phases on stderr (stdout and --json output stay clean): a one-line bar
// redrawn in place on a terminal; elsewhere (a log, a Slurm job's output) a plain line
// "calibrate 12/80, 3 min 5 s elapsed, ETA 17 min 2 s" at most every 10 s and when the phase is
// done, so a long phase is never silent. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace qcal::client {

class ProgressBar {
 public:
  // total may be 0 when unknown yet; Update(done, total) sets it later. Without `lines` nothing
  // is printed when stderr is not a terminal (a caller that prints its own lines).
  ProgressBar(std::string label, int64_t total, bool lines = true);
  ~ProgressBar();
  void Update(int64_t done);
  void Update(int64_t done, int64_t total) {
    total_ = total;
    Update(done);
  }
  // What the running step is doing ("block 3: mlp.down_proj (7/7)"): shown after the count on a
  // terminal; off a terminal a line at most every kLineEvery (whatever `lines`), so a step that
  // takes minutes is never silent.
  void Note(const std::string& note);
  void Finish();

 private:
  void Draw(int64_t done, std::chrono::steady_clock::time_point now);

  std::string label_;
  int64_t total_;
  static constexpr std::chrono::seconds kLineEvery{10};
  bool tty_, lines_;
  bool finished_ = false;
  int64_t last_done_ = -1;
  int64_t done_ = 0;
  std::string note_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace qcal::client
