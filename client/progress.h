// A one-line progress bar for people, drawn on stderr only when stderr is a terminal (logs and
// --json output stay clean). Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace qcal::client {

class ProgressBar {
 public:
  // total may be 0 when unknown yet; Update(done, total) sets it later.
  ProgressBar(std::string label, int64_t total);
  ~ProgressBar();
  void Update(int64_t done);
  void Update(int64_t done, int64_t total) {
    total_ = total;
    Update(done);
  }
  void Finish();

 private:
  std::string label_;
  int64_t total_;
  bool enabled_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace qcal::client
