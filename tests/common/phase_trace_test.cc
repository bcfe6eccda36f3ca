// common/phase_trace.h: phases in order with their seconds, and each phase's peak resident
// memory read from the kernel's high-water mark, nested phases included.
#include "common/phase_trace.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace qcal
