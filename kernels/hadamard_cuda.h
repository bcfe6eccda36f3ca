// CUDA fast Walsh-Hadamard transform (float, batched, in place).
//
// Same transform as the CPU reference FwhtInPlace in kernels/hadamard.h (Sylvester ordering,
// H_n[i][j] = (-1)^popcount(i & j)), on device memory. No CUDA headers here: the stream is passed
// as void* (a cudaStream_t; nullptr is the legacy default stream).
#pragma once

#include <cstdint>

#include "common/status.h"

namespace qcal {

struct FwhtCudaParams {
  // Device pointer to `batch` contiguous vectors of length n (row-major [batch][n]); transformed
  // in place. Need not be 16-byte aligned (an aligned pointer takes the vectorized path).
  float* data = nullptr;
  int64_t n = 0;      // power of two, 1 ≤ n ≤ 2^30 (n ≤ 8192 runs in one pass)
  int64_t batch = 0;  // ≥ 0; 0 is a no-op
  // true: multiply by 1/sqrt(n) (orthonormal, matches FwhtInPlace); false: plain ±1 sums.
  bool normalize = true;
};

// Enqueues the transform on `stream` (a cudaStream_t) and returns without synchronizing.
// InvalidArgument for bad shapes; CUDA launch errors become a Status with the failing
// expression and file:line. Thread-safety: like any CUDA launch; distinct buffers may be
// transformed concurrently from several threads/streams.
// Implementation: n ≤ 8192 → one shared-memory kernel (each thread holds 8 consecutive elements
// in registers for the first three butterfly stages, the remaining stages run in shared memory;
// several short vectors share a block). n > 8192 → the same kernel on contiguous 8192-chunks
// followed by register-blocked radix-2..16 passes across the chunks in global memory.
Status FwhtCuda(const FwhtCudaParams& p, void* stream);

}  // namespace qcal
