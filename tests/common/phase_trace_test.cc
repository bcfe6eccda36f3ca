// common/phase_trace.h: phases in order with their seconds, and each phase's peak resident
// memory read from the kernel's high-water mark, nested phases included.
#include "common/phase_trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace qcal {
namespace {

// Allocates and touches `bytes` (so they are resident), returns them.
std::unique_ptr<char[]> Touch(size_t bytes) {
  std::unique_ptr<char[]> p(new char[bytes]);
  for (size_t i = 0; i < bytes; i += 4096) p[i] = static_cast<char>(i);
  return p;
}

TEST(PhaseTraceTest, PhasesInOrderWithTheirSeconds) {
  PhaseTrace t;
  t.Begin("a");
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  t.Begin("b");  // ends a
  t.End();
  t.End();  // nothing running: no effect
  ASSERT_EQ(t.phases().size(), 2u);
  EXPECT_EQ(t.phases()[0].name(), "a");
  EXPECT_EQ(t.phases()[1].name(), "b");
  EXPECT_GE(t.phases()[0].seconds(), 0.029);
  EXPECT_LT(t.phases()[1].seconds(), t.phases()[0].seconds());
  EXPECT_EQ(t.phases()[0].peak_device_bytes(), -1);
}

TEST(PhaseTraceTest, PeaksFollowTheResidentSetAndNest) {
  if (ResidentPeakBytes() < 0) GTEST_SKIP() << "no VmHWM in /proc/self/status on this system";
  constexpr size_t kBig = size_t{256} << 20;
  PhaseTrace outer, inner;
  outer.Begin("job");
  inner.Begin("small");
  inner.Begin("big");
  {
    auto p = Touch(kBig);
    inner.Begin("after");  // `big` ends while the memory is still held
  }
  inner.End();
  outer.End();
  const auto& in = inner.phases();
  ASSERT_EQ(in.size(), 3u);
  const int64_t small = in[0].peak_host_bytes(), big = in[1].peak_host_bytes();
  EXPECT_GT(small, 0);
  EXPECT_GE(big, small + static_cast<int64_t>(kBig) * 9 / 10) << "small " << small;
  // The enclosing phase saw the inner peak, although the inner phases reset the mark.
  EXPECT_GE(outer.phases()[0].peak_host_bytes(), big);
  // After the memory is freed, a phase's peak falls again (where the mark can be reset).
  const int64_t after = in[2].peak_host_bytes();
  EXPECT_GE(after, small + static_cast<int64_t>(kBig) * 9 / 10)
      << "`after` began while the block was held";
  PhaseTrace later;
  later.Begin("later");
  later.End();
  EXPECT_LT(later.phases()[0].peak_host_bytes(), big - static_cast<int64_t>(kBig) / 2)
      << "the kernel did not reset the high-water mark (/proc/self/clear_refs)";
}

// A device the test drives by hand: `used` is the memory in use, `mark` its high-water mark since
// the probe's last call, as a GPU backend's sampler keeps them.
struct FakeDevice {
  int64_t used = 0;
  int64_t mark = 0;
  int calls = 0;
  void Use(int64_t bytes) {
    used = bytes;
    mark = std::max(mark, used);
  }
  int64_t Take() {
    ++calls;
    const int64_t peak = std::max(mark, used);
    mark = used;
    return peak;
  }
};

TEST(PhaseTraceTest, DevicePeaksComeFromTheProbeAndNest) {
  FakeDevice device;
  device.Use(100);
  SetDevicePeakProbe([&device] { return device.Take(); });
  PhaseTrace outer, inner;
  outer.Begin("job");
  inner.Begin("upload");
  device.Use(1000);  // weights uploaded
  inner.Begin("round");
  device.Use(5000);  // work space of the rounding kernel, freed before the phase ends
  device.Use(1000);
  inner.Begin("free");
  device.Use(100);
  inner.End();
  outer.End();
  EXPECT_GT(device.calls, 0);
  DevicePeakProbe previous = SetDevicePeakProbe(nullptr);
  EXPECT_TRUE(previous) << "the installed probe is handed back";
  const auto& in = inner.phases();
  ASSERT_EQ(in.size(), 3u);
  EXPECT_EQ(in[0].peak_device_bytes(), 1000);
  EXPECT_EQ(in[1].peak_device_bytes(), 5000) << "a peak inside the phase, gone at its end";
  EXPECT_EQ(in[2].peak_device_bytes(), 1000) << "began while 1000 bytes were in use";
  EXPECT_EQ(outer.phases()[0].peak_device_bytes(), 5000) << "the enclosing phase saw it";
  // Without a probe the device peak is unknown again.
  PhaseTrace after;
  after.Begin("cpu");
  after.End();
  EXPECT_EQ(after.phases()[0].peak_device_bytes(), -1);
}

}  // namespace
}  // namespace qcal
