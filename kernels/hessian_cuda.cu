// Exact fixed-point Hessian accumulation on the GPU (kernels/hessian_cuda.h).
#include "kernels/hessian_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"

namespace qcal::kernels {
namespace {

constexpr unsigned long long kNoError = ~0ull;

cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }

// Records the smallest failing packed index (atomicMin; kNoError when none).
__device__ void RecordError(unsigned long long* error, int64_t index) {
  atomicMin(error, static_cast<unsigned long long>(index));
}

// For the strip of columns [j0, j0 + w) against rows [0, r): products[g][i][jj] = P_g(i, j0 + jj)
// (row-major per sequence g < gs). Adds 2·Σ_g q(P_g(i, j)) to T(i, j) for i ≤ j. One thread
// per entry: consecutive threads take consecutive jj, so both the product reads and the packed
// 16-byte read-modify-writes are coalesced.
__global__ void AccumulateStripKernel(const float* __restrict__ products, int64_t gs, int64_t r,
                                      int64_t w, int64_t j0, int64_t n,
                                      Fixed128* __restrict__ packed,
                                      unsigned long long* error) {
  const int64_t jj = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (jj >= w || i >= r) return;
  const int64_t j = j0 + jj;
  if (i > j) return;
  const int64_t index = HessianPackedIndex(n, i, j);
  Fixed128 sum = 0;
  bool ok = true;
  for (int64_t g = 0; g < gs; ++g) {
    Fixed128 q = 0;
    ok &= ToFixed128(static_cast<double>(products[(g * r + i) * w + jj]), &q);
    ok &= AddFixed128(&sum, q);  // checked: a group's sum can leave 128 bits only if T would
  }
  ok &= AddFixed128(&sum, sum);  // 2·Σ q
  if (!ok || !AddFixed128(&packed[index], sum)) RecordError(error, index);
}

__global__ void ToDigitsKernel(const Fixed128* __restrict__ packed, int64_t size,
                               int64_t* __restrict__ limbs) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < size) SplitFixedDigits(packed[e], limbs + 4 * e);
}

// packed and limbs start at packed index `first`; errors name the packed index.
__global__ void FromDigitsKernel(const int64_t* __restrict__ limbs, int64_t size, int64_t first,
                                 Fixed128* __restrict__ packed, unsigned long long* error) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= size) return;
  Fixed128 v = 0;
  if (!CombineFixedDigits(limbs + 4 * e, &v)) RecordError(error, first + e);
  packed[e] = v;
}

unsigned Blocks(int64_t size, int threads) {
  return static_cast<unsigned>((size + threads - 1) / threads);
}

}  // namespace

StatusOr<HessianAccumulatorCuda> HessianAccumulatorCuda::Create(int64_t n, void* stream,
                                                                HessianCudaOptions options) {
  if (n <= 0 || options.strip <= 0 || options.max_group <= 0 || options.max_group > 64 ||
      options.workspace_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HessianAccumulatorCuda: n must be > 0 (got ", n, "), strip > 0 (", options.strip,
        "), max_group in 1..64 (", options.max_group, "), workspace_bytes > 0"));
  }
  HessianAccumulatorCuda acc;
  acc.n_ = n;
  acc.stream_ = stream;
  acc.options_ = options;
  acc.options_.strip = std::min(options.strip, n);
  const size_t bytes = static_cast<size_t>(HessianPackedSize(n)) * sizeof(Fixed128);
  QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&acc.packed_), bytes));
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.packed_, 0, bytes, AsStream(stream)));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&acc.error_), sizeof(unsigned long long)));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(acc.error_, 0xFF, sizeof(unsigned long long), AsStream(stream)));
  cublasHandle_t handle = nullptr;
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  acc.cublas_ = handle;
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, AsStream(stream)));
  return acc;
}

HessianAccumulatorCuda::HessianAccumulatorCuda(HessianAccumulatorCuda&& o) noexcept {
  *this = std::move(o);
}

HessianAccumulatorCuda& HessianAccumulatorCuda::operator=(HessianAccumulatorCuda&& o) noexcept {
  if (this != &o) {
    Release();
    n_ = std::exchange(o.n_, 0);
    count_ = std::exchange(o.count_, 0);
    stream_ = std::exchange(o.stream_, nullptr);
    options_ = o.options_;
    packed_ = std::exchange(o.packed_, nullptr);
    products_ = std::exchange(o.products_, nullptr);
    products_capacity_ = std::exchange(o.products_capacity_, 0);
    error_ = std::exchange(o.error_, nullptr);
    cublas_ = std::exchange(o.cublas_, nullptr);
  }
  return *this;
}

HessianAccumulatorCuda::~HessianAccumulatorCuda() { Release(); }

void HessianAccumulatorCuda::Release() {
  // Frees wait for the stream's work (cudaFree synchronizes the device).
  if (packed_ != nullptr) cudaFree(packed_);
  if (products_ != nullptr) cudaFree(products_);
  if (error_ != nullptr) cudaFree(error_);
  if (cublas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  packed_ = nullptr;
  products_ = nullptr;
  error_ = nullptr;
  cublas_ = nullptr;
  products_capacity_ = 0;
}

Status HessianAccumulatorCuda::Add(const void* x, HessianInputType type, int64_t seqs, int64_t t) {
  if (packed_ == nullptr) return absl::FailedPreconditionError("HessianAccumulatorCuda: moved from");
  if (seqs < 0 || t < 0 || (seqs > 0 && t > 0 && x == nullptr) || t > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("HessianAccumulatorCuda::Add: bad shape seqs=", seqs, " t=", t));
  }
  if (seqs == 0 || t == 0) return absl::OkStatus();
  const int64_t n = n_, w = options_.strip;
  // Sequences per batched GEMM: the product buffer holds group·n·w floats at most.
  const int64_t per_seq = n * w;
  const int64_t group = std::max<int64_t>(
      1, std::min({options_.max_group, seqs, options_.workspace_bytes / (per_seq * 4)}));
  if (products_capacity_ < group * per_seq) {
    if (products_ != nullptr) QCAL_CUDA_RETURN_IF_ERROR(cudaFree(products_));
    products_ = nullptr;
    products_capacity_ = 0;
    QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&products_),
                                         static_cast<size_t>(group * per_seq) * sizeof(float)));
    products_capacity_ = group * per_seq;
  }
  cublasHandle_t handle = static_cast<cublasHandle_t>(cublas_);
  const bool bf16 = type == HessianInputType::kBf16;
  const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC;
  const size_t elem = bf16 ? 2 : 4;
  const float alpha = 1.0f, beta = 0.0f;
  const char* base = static_cast<const char*>(x);
  for (int64_t s0 = 0; s0 < seqs; s0 += group) {
    const int64_t gs = std::min(group, seqs - s0);
    const char* xs = base + static_cast<size_t>(s0 * t * n) * elem;
    for (int64_t j0 = 0; j0 < n; j0 += w) {
      const int64_t we = std::min(w, n - j0);
      const int64_t r = j0 + we;  // rows 0..r-1 meet the strip's upper triangle
      // Column-major view: X_s is [n, t] (ld n). C = X_s[j0:j0+we, :] · X_s[0:r, :]ᵀ, [we, r]
      // column-major = products[g][i][jj] row-major.
      QCAL_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(we), static_cast<int>(r),
          static_cast<int>(t), &alpha, xs + static_cast<size_t>(j0) * elem, in_type,
          static_cast<int>(n), t * n, xs, in_type, static_cast<int>(n), t * n, &beta, products_,
          CUDA_R_32F, static_cast<int>(we), r * we, static_cast<int>(gs), compute,
          CUBLAS_GEMM_DEFAULT));
      const dim3 threads(64, 4);
      const dim3 blocks(Blocks(we, 64), Blocks(r, 4));
      AccumulateStripKernel<<<blocks, threads, 0, AsStream(stream_)>>>(products_, gs, r, we, j0,
                                                                      n, packed_, error_);
      QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("AccumulateStripKernel");
    }
  }
  count_ += seqs * t;
  return absl::OkStatus();
}

Status HessianAccumulatorCuda::Sync() {
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(AsStream(stream_)));
  unsigned long long error = kNoError;
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&error, error_, sizeof(error), cudaMemcpyDeviceToHost));
  if (error == kNoError) return absl::OkStatus();
  // The packed index back to (i, j).
  int64_t i = 0;
  while (i + 1 < n_ && HessianPackedIndex(n_, i + 1, i + 1) <= static_cast<int64_t>(error)) ++i;
  const int64_t j = i + (static_cast<int64_t>(error) - HessianPackedIndex(n_, i, i));
  return absl::OutOfRangeError(absl::StrCat(
      "GPU Hessian entry (", i, ", ", j, ") of dimension ", n_,
      " is not finite or leaves the 128-bit fixed-point range (|sum| < 2^76, resolution 2^-",
      kHessianFracBits, ")"));
}

StatusOr<std::vector<Fixed128>> HessianAccumulatorCuda::Download() {
  QCAL_RETURN_IF_ERROR(Sync());
  std::vector<Fixed128> out(static_cast<size_t>(HessianPackedSize(n_)));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(out.data(), packed_, out.size() * sizeof(Fixed128), cudaMemcpyDeviceToHost));
  return out;
}

Status HessianAccumulatorCuda::ToDigits(int64_t* device_limbs) const {
  return ToDigits(0, HessianPackedSize(n_), device_limbs);
}

Status HessianAccumulatorCuda::FromDigits(const int64_t* device_limbs, int64_t count) {
  QCAL_RETURN_IF_ERROR(FromDigits(0, HessianPackedSize(n_), device_limbs));
  count_ = count;
  return absl::OkStatus();
}

Status HessianAccumulatorCuda::ToDigits(int64_t first, int64_t size, int64_t* device_limbs) const {
  if (first < 0 || size < 0 || first + size > HessianPackedSize(n_)) {
    return absl::OutOfRangeError(absl::StrCat("HessianAccumulatorCuda::ToDigits: [", first, ", ",
                                              first + size, ") outside ",
                                              HessianPackedSize(n_), " packed values"));
  }
  if (size == 0) return absl::OkStatus();
  ToDigitsKernel<<<Blocks(size, 256), 256, 0, AsStream(stream_)>>>(packed_ + first, size,
                                                                  device_limbs);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("ToDigitsKernel");
  return absl::OkStatus();
}

Status HessianAccumulatorCuda::FromDigits(int64_t first, int64_t size,
                                          const int64_t* device_limbs) {
  if (first < 0 || size < 0 || first + size > HessianPackedSize(n_)) {
    return absl::OutOfRangeError(absl::StrCat("HessianAccumulatorCuda::FromDigits: [", first,
                                              ", ", first + size, ") outside ",
                                              HessianPackedSize(n_), " packed values"));
  }
  if (size == 0) return absl::OkStatus();
  FromDigitsKernel<<<Blocks(size, 256), 256, 0, AsStream(stream_)>>>(device_limbs, size, first,
                                                                    packed_ + first, error_);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FromDigitsKernel");
  return absl::OkStatus();
}

}  // namespace qcal::kernels
