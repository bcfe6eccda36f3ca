// fp64 Cholesky through cuSOLVER (kernels/linalg_cuda.h).
#include "kernels/linalg_cuda.h"

#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <climits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/cuda_util.cuh"

namespace qcal::kernels {
namespace {

// Zeroes the strict upper triangle of a row-major [n, n] matrix.
__global__ void ZeroStrictUpperKernel(double* a, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (i < n && j < n && j > i) a[i * n + j] = 0.0;
}

struct SolverFree {
  void operator()(cusolverDnContext* h) const { cusolverDnDestroy(h); }
};

}  // namespace

Status CholeskyCuda(double* a, int64_t n, void* stream) {
  if (n <= 0 || a == nullptr || n > 46340) {  // n² < 2^31 for cuSOLVER's 32-bit API
    return absl::InvalidArgumentError(
        absl::StrCat("CholeskyCuda: need 0 < n <= 46340 and a device matrix (got n = ", n, ")"));
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cusolverDnHandle_t raw = nullptr;
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnCreate(&raw));
  std::unique_ptr<cusolverDnContext, SolverFree> handle(raw);
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnSetStream(raw, s));
  // Row-major lower C is column-major upper U = Cᵀ: factor the column-major view as UᵀU.
  const int ni = static_cast<int>(n);
  int lwork = 0;
  QCAL_CUSOLVER_RETURN_IF_ERROR(
      cusolverDnDpotrf_bufferSize(raw, CUBLAS_FILL_MODE_UPPER, ni, a, ni, &lwork));
  void* work_raw = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&work_raw, (static_cast<size_t>(lwork) + 2) * sizeof(double)));
  std::unique_ptr<void, DeviceFree> work(work_raw);
  int* info_dev = reinterpret_cast<int*>(static_cast<double*>(work_raw) + lwork);
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnDpotrf(raw, CUBLAS_FILL_MODE_UPPER, ni, a, ni,
                                                 static_cast<double*>(work_raw), lwork,
                                                 info_dev));
  int info = 0;
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&info, info_dev, sizeof(int), cudaMemcpyDeviceToHost, s));
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (info > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CholeskyCuda: the matrix (n = ", n, ") is not positive definite: pivot ", info - 1,
        " is not positive; damp the Hessian more (DampHessian's delta)"));
  }
  if (info < 0) {
    return absl::InternalError(absl::StrCat("cusolverDnDpotrf: bad parameter ", -info));
  }
  const dim3 threads(32, 8);
  const dim3 blocks(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>((n + 7) / 8));
  ZeroStrictUpperKernel<<<blocks, threads, 0, s>>>(a, n);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("ZeroStrictUpperKernel");
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

Status InverseCholeskyUpperCuda(double* a, int64_t n, void* stream) {
  if (n <= 0 || a == nullptr || n > 46340) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InverseCholeskyUpperCuda: need 0 < n <= 46340 and a device matrix (got n = ", n, ")"));
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>((n * n / 2 + 255) / 256);
  Rotate180Kernel<<<blocks, 256, 0, s>>>(a, n * n);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("Rotate180Kernel");
  Status chol = CholeskyCuda(a, n, stream);  // C' lower (row-major), strict upper zero
  if (!chol.ok()) {
    if (chol.code() == absl::StatusCode::kFailedPrecondition) {
      return absl::FailedPreconditionError(absl::StrCat(
          "gptq inverse factor: ", chol.message(), " (pivots counted from the last column)"));
    }
    return chol;
  }
  cusolverDnHandle_t raw = nullptr;
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnCreate(&raw));
  std::unique_ptr<cusolverDnContext, SolverFree> handle(raw);
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnSetStream(raw, s));
  // Row-major lower = column-major upper: invert that triangle in place.
  size_t device_bytes = 0, host_bytes = 0;
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnXtrtri_bufferSize(
      raw, CUBLAS_FILL_MODE_UPPER, CUBLAS_DIAG_NON_UNIT, n, CUDA_R_64F, a, n, &device_bytes,
      &host_bytes));
  void* work_raw = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&work_raw, device_bytes + 16));
  std::unique_ptr<void, DeviceFree> work(work_raw);
  std::vector<char> host_work(host_bytes + 1);
  int* info_dev = reinterpret_cast<int*>(static_cast<char*>(work_raw) + device_bytes);
  QCAL_CUSOLVER_RETURN_IF_ERROR(cusolverDnXtrtri(raw, CUBLAS_FILL_MODE_UPPER, CUBLAS_DIAG_NON_UNIT,
                                                 n, CUDA_R_64F, a, n, work_raw, device_bytes,
                                                 host_work.data(), host_bytes, info_dev));
  int info = 0;
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&info, info_dev, sizeof(int), cudaMemcpyDeviceToHost, s));
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (info != 0) {
    return absl::InternalError(absl::StrCat("cusolverDnXtrtri: info ", info));
  }
  Rotate180Kernel<<<blocks, 256, 0, s>>>(a, n * n);  // P C'⁻¹ P: upper
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("Rotate180Kernel");
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

}  // namespace qcal::kernels
