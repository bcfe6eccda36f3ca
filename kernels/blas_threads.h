// The BLAS library's own thread pool, pinned to one thread.
#pragma once

#include <string>

namespace qcal::kernels {

// OpenBLAS (the BLAS here, and LibTorch's) splits one GEMM across as many threads as the
// process's affinity mask allows, and the result's bits depend on that split: the same
// calibration gave different Hessians on a rank that mpirun bound to one core than on an unbound
// one (issue 18). qcal therefore runs every BLAS call on one thread and gets its parallelism from
// its own fixed partitions (row chunks of a linear layer, rows of a rounding), whose results do
// not depend on the thread count. Idempotent and cheap; returns what it did, for the log:
// "openblas: 1 thread", or "no known BLAS thread control" for a BLAS qcal does not know (MKL is
// set through LibTorch's own thread setting).
std::string PinBlasToOneThread();

// Sets the BLAS library's thread count (benchmarks measure a dense GEMM with every core this
// way, then pin again). Same return convention.
std::string SetBlasThreads(int threads);

}  // namespace qcal::kernels
