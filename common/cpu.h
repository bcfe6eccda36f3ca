// The CPUs this process may run on.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace qcal {

// Number of CPUs in this process's affinity mask (what mpirun's or Slurm's binding leaves it),
// at least 1; std::thread::hardware_concurrency() counts every online CPU instead, so a rank
// bound to one core would start as many threads as the machine has. Used only to size thread
// pools: no numeric result depends on it (docs/algorithms.md, "Determinism").
int AvailableCpus();

// OpenBLAS (a DYNAMIC_ARCH build, as Debian's) picks its kernels by the CPU when it loads. A CPU
// newer than the library falls back to the generic Prescott (SSE3) kernels: Debian 12's
// OpenBLAS 0.3.21 does so on Sapphire/Emerald Rapids Xeons (the CPUs of H100 nodes), where its
// DGEMM is 3-4x slower than with the Haswell kernels. And kernels for different CPU types sum in
// different orders, so results that go through BLAS differ by CPU type. qcal therefore runs the
// Haswell (AVX2 + FMA) kernels on every x86-64 CPU that has AVX2 and FMA, unless
// OPENBLAS_CORETYPE is already set (the user's choice wins): the same bits on every such node,
// and never the fallback. The choice must be in the environment before the library loads, so
// this sets OPENBLAS_CORETYPE and re-executes the program (/proc/self/exe, same arguments) once;
// call it first in main, before threads or MPI. It returns when there is nothing to do, or when
// the exec fails (then the run goes on with the kernels OpenBLAS chose). Children (mpirun's
// ranks, the coordinator) inherit the variable.
void SelectBlasKernelsOrReexec(char** argv);

// "openblas 0.3.21, Haswell kernels" (looked up at run time: OpenBLAS when it is the loaded BLAS),
// else "BLAS without a known kernel query".
std::string BlasKernelsDescription();

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
