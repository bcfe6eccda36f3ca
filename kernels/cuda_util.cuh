// Small helpers shared by the CUDA kernels' .cu files: owned device buffers, grid sizes, the
// index reversal P A P and a wall-clock timer. Internal linkage (each .cu has its own copy).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/cuda_status.h"

namespace qcal::kernels {
namespace {

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, DeviceFree>;

// cudaMalloc of `count` T (at least one), owned.
template <typename T>
StatusOr<DevicePtr<T>> Alloc(size_t count) {
  void* p = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return DevicePtr<T>(static_cast<T*>(p));
}

// Blocks of `threads` covering `count` items.
inline unsigned Blocks(int64_t count, int threads) {
  return static_cast<unsigned>((count + threads - 1) / threads);
}

// a[e] <-> a[n² − 1 − e]: (P A P)[i][j] = A[n−1−i][n−1−j] with P the exchange matrix.
__global__ void Rotate180Kernel(double* a, int64_t n2) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n2 / 2) return;
  const double t = a[e];
  a[e] = a[n2 - 1 - e];
  a[n2 - 1 - e] = t;
}

inline double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace
}  // namespace qcal::kernels
