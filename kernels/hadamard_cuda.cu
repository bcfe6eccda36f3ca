// CUDA fast Walsh-Hadamard transform. Host API in kernels/hadamard_cuda.h; the kernels are
// file-local. Reference: FwhtInPlace (kernels/hadamard.h), compared in
// tests/kernels/hadamard_cuda_test.cc.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/hadamard_cuda.h"

namespace qcal {
namespace {

// Elements each thread keeps in registers in the shared-memory kernel; the first log2(8) = 3
// butterfly stages run there without touching shared memory.
constexpr int kPerThread = 8;
// Largest vector (or chunk) one block transforms in shared memory: 8192 floats = 32 KiB.
constexpr int64_t kMaxSmemN = 8192;
// Short vectors are packed so a block holds at least this many elements (256 threads).
constexpr int64_t kMinBlockElems = 2048;

__device__ __forceinline__ void Butterfly(float& a, float& b) {
  const float s = a + b;
  b = a - b;
  a = s;
}

// In-register Walsh-Hadamard transform of r[0..F).
template <int F>
__device__ __forceinline__ void RegisterWht(float (&r)[F]) {
#pragma unroll
  for (int h = 1; h < F; h *= 2) {
#pragma unroll
    for (int i = 0; i < F; ++i) {
      if ((i & h) == 0) Butterfly(r[i], r[i + h]);
    }
  }
}

// One block transforms `vectors_per_block` consecutive vectors of length n (8 ≤ n ≤ 8192, power
// of two); blockDim.x = vectors_per_block · n / 8. Thread t owns elements [8t, 8t + 8) of the
// block's range: stages h = 1, 2, 4 in registers, stages h ≥ 8 in shared memory.
template <bool kVectorized>
__global__ void __launch_bounds__(1024)
    FwhtSmemKernel(float* __restrict__ x, int64_t n, int64_t num_vectors, int64_t vectors_per_block,
                   float scale) {
  extern __shared__ float smem[];
  const int64_t first_vector = static_cast<int64_t>(blockIdx.x) * vectors_per_block;
  const int64_t valid_vectors =
      min(vectors_per_block, num_vectors - first_vector);  // ≥ 1 by grid construction
  const int64_t block_elems = vectors_per_block * n;
  const int64_t valid_elems = valid_vectors * n;
  float* block_ptr = x + first_vector * n;
  const int t = threadIdx.x;
  const int64_t local = static_cast<int64_t>(t) * kPerThread;
  const bool active = local < valid_elems;

  float r[kPerThread];
  if (active) {
    if (kVectorized) {
      const float4 lo = reinterpret_cast<const float4*>(block_ptr + local)[0];
      const float4 hi = reinterpret_cast<const float4*>(block_ptr + local)[1];
      r[0] = lo.x;
      r[1] = lo.y;
      r[2] = lo.z;
      r[3] = lo.w;
      r[4] = hi.x;
      r[5] = hi.y;
      r[6] = hi.z;
      r[7] = hi.w;
    } else {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) r[i] = block_ptr[local + i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) r[i] = 0.0f;
  }
  RegisterWht<kPerThread>(r);

  if (n > kPerThread) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) smem[local + i] = r[i];
    __syncthreads();
    const int64_t half = block_elems / 2;
    for (int64_t h = kPerThread; h < n; h *= 2) {
      for (int64_t k = t; k < half; k += blockDim.x) {
        const int64_t i = (k / h) * (2 * h) + (k % h);
        float a = smem[i], b = smem[i + h];
        Butterfly(a, b);
        smem[i] = a;
        smem[i + h] = b;
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) r[i] = smem[local + i];
  }

  if (!active) return;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) r[i] *= scale;
  if (kVectorized) {
    reinterpret_cast<float4*>(block_ptr + local)[0] = make_float4(r[0], r[1], r[2], r[3]);
    reinterpret_cast<float4*>(block_ptr + local)[1] = make_float4(r[4], r[5], r[6], r[7]);
  } else {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) block_ptr[local + i] = r[i];
  }
}

// n ∈ {1, 2, 4}: one thread per vector.
__global__ void FwhtTinyKernel(float* __restrict__ x, int n, int64_t batch, float scale) {
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < batch;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float* p = x + v * n;
    for (int i = 0; i < n; ++i) r[i] = p[i];
    for (int h = 1; h < n; h *= 2)
      for (int i = 0; i < n; ++i)
        if ((i & h) == 0) Butterfly(r[i], r[i + h]);
    for (int i = 0; i < n; ++i) p[i] = r[i] * scale;
  }
}

// Butterfly stages h0, 2·h0, ..., (F/2)·h0 of length-n vectors in global memory: each thread
// loads the F elements base + j·h0, transforms them in registers and stores them back.
// Consecutive threads take consecutive `base`, so every load and store is coalesced.
template <int F>
__global__ void FwhtStridedKernel(float* __restrict__ x, int64_t n, int64_t h0,
                                  int64_t total_groups, float scale) {
  const int64_t groups_per_vector = n / F;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < total_groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = g / groups_per_vector;
    const int64_t gi = g % groups_per_vector;
    const int64_t lo = gi % h0, hi = gi / h0;
    float* p = x + v * n + hi * (h0 * F) + lo;
    float r[F];
#pragma unroll
    for (int j = 0; j < F; ++j) r[j] = p[j * h0];
    RegisterWht<F>(r);
#pragma unroll
    for (int j = 0; j < F; ++j) p[j * h0] = r[j] * scale;
  }
}

int GridFor(int64_t work_items, int threads) {
  // Grid-stride kernels: cap the grid, the loop covers the rest.
  const int64_t blocks = (work_items + threads - 1) / threads;
  return static_cast<int>(std::min<int64_t>(blocks, int64_t{1} << 20));
}

Status LaunchSmem(float* x, int64_t n, int64_t num_vectors, float scale, cudaStream_t stream) {
  const int64_t vectors_per_block = n >= kMinBlockElems ? 1 : kMinBlockElems / n;
  const int64_t block_elems = vectors_per_block * n;
  const int threads = static_cast<int>(block_elems / kPerThread);
  const int64_t blocks = (num_vectors + vectors_per_block - 1) / vectors_per_block;
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("FwhtCuda: batch too large (", blocks, " blocks)"));
  }
  const size_t smem_bytes = static_cast<size_t>(block_elems) * sizeof(float);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (aligned) {
    FwhtSmemKernel<true><<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(
        x, n, num_vectors, vectors_per_block, scale);
    QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FwhtSmemKernel<vectorized>");
  } else {
    FwhtSmemKernel<false><<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(
        x, n, num_vectors, vectors_per_block, scale);
    QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FwhtSmemKernel<scalar>");
  }
  return absl::OkStatus();
}

template <int F>
Status LaunchStrided(float* x, int64_t n, int64_t batch, int64_t h0, float scale,
                     cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total_groups = batch * (n / F);
  FwhtStridedKernel<F>
      <<<GridFor(total_groups, kThreads), kThreads, 0, stream>>>(x, n, h0, total_groups, scale);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FwhtStridedKernel");
  return absl::OkStatus();
}

}  // namespace

Status FwhtCuda(const FwhtCudaParams& p, void* stream_ptr) {
  const int64_t n = p.n;
  if (n < 1 || (n & (n - 1)) != 0 || n > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FwhtCuda: n must be a power of two in [1, 2^30], got ", n));
  }
  if (p.batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("FwhtCuda: negative batch ", p.batch));
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.data == nullptr) return absl::InvalidArgumentError("FwhtCuda: null data pointer");
  if (p.batch > std::numeric_limits<int64_t>::max() / n) {
    return absl::InvalidArgumentError("FwhtCuda: batch * n overflows");
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const float scale =
      p.normalize ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))) : 1.0f;

  if (n < kPerThread) {
    constexpr int kThreads = 256;
    FwhtTinyKernel<<<GridFor(p.batch, kThreads), kThreads, 0, stream>>>(p.data, static_cast<int>(n),
                                                                        p.batch, scale);
    QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FwhtTinyKernel");
    return absl::OkStatus();
  }
  if (n <= kMaxSmemN) return LaunchSmem(p.data, n, p.batch, scale, stream);

  // n > 8192: transform each contiguous 8192-chunk (stages h < 8192), then the stages across
  // chunks, up to 16 at a time (4 butterfly levels per pass); the last pass applies the scale.
  QCAL_RETURN_IF_ERROR(LaunchSmem(p.data, kMaxSmemN, p.batch * (n / kMaxSmemN), 1.0f, stream));
  int64_t h0 = kMaxSmemN;
  while (h0 < n) {
    const int64_t remaining = n / h0;
    const bool last = remaining <= 16;
    const float pass_scale = last ? scale : 1.0f;
    switch (remaining >= 16 ? 16 : static_cast<int>(remaining)) {
      case 2:
        QCAL_RETURN_IF_ERROR(LaunchStrided<2>(p.data, n, p.batch, h0, pass_scale, stream));
        h0 *= 2;
        break;
      case 4:
        QCAL_RETURN_IF_ERROR(LaunchStrided<4>(p.data, n, p.batch, h0, pass_scale, stream));
        h0 *= 4;
        break;
      case 8:
        QCAL_RETURN_IF_ERROR(LaunchStrided<8>(p.data, n, p.batch, h0, pass_scale, stream));
        h0 *= 8;
        break;
      default:
        QCAL_RETURN_IF_ERROR(LaunchStrided<16>(p.data, n, p.batch, h0, pass_scale, stream));
        h0 *= 16;
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace qcal
