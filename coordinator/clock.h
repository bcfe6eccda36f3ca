// Time for the coordinator, behind an interface so that heartbeat expiry, kill grace periods and
// ETAs are testable with a fake clock (tests/coordinator/fakes.h).
#pragma once

namespace qcal::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic seconds (for timeouts and durations); the origin is arbitrary.
  virtual double MonotonicSeconds() const = 0;
  // Seconds since the Unix epoch (for records shown to people).
  virtual double UnixSeconds() const = 0;
};

// The system clocks (steady_clock, system_clock). Thread-safe; a process-wide instance.
Clock* SystemClock();

}  // namespace qcal::coordinator
