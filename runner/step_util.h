// What the job steps' files share (runner/job_steps.h; internal to qcal_job_steps): their
// clock and their progress events.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "runner/job_steps.h"

namespace qcal::job::step {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline void Emit(const JobEventFn& on_event, const std::string& phase, int64_t done,
                 int64_t total, std::string message = "") {
  if (on_event) on_event(JobEvent{phase, done, total, std::move(message)});
}

}  // namespace qcal::job::step
