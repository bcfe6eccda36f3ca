// The CPUs this process may run on.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace qcal {

// Number of CPUs in this process's affinity mask (what mpirun's or Slurm's binding leaves it),
// at least 1; std::thread::hardware_concurrency() counts every online CPU instead, so a rank
// bound to one core would start as many threads as the machine has. Used only to size thread
// pools: no numeric result depends on it (docs/architecture.md, "Determinism").
int AvailableCpus();

// Runs fn(task) for every task in [0, count) on up to `threads` threads (0: AvailableCpus()),
// handing tasks out in order from a shared counter; returns when all are done. Results must not
// depend on which thread runs a task (fixed task boundaries make a kernel's bits independent of
// the thread count).
template <class Fn>
void ParallelTasks(int64_t count, int threads, Fn&& fn) {
  if (count <= 0) return;
  int64_t t = threads > 0 ? threads : AvailableCpus();
  t = std::max<int64_t>(1, std::min<int64_t>(t, count));
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next++; i < count; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t - 1));
  for (int64_t i = 1; i < t; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace qcal
