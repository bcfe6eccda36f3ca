#include "coordinator/clock.h"

#include <chrono>

namespace qcal::coordinator {
namespace {

class RealClock : public Clock {
 public:
  double MonotonicSeconds() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  double UnixSeconds() const override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

Clock* SystemClock() {
  static RealClock clock;
  return &clock;
}

}  // namespace qcal::coordinator
