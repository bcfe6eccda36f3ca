// CUDA, cuBLAS, cuSOLVER and NCCL return codes as absl::Status.
//
// Library return codes are errors, not invariants: they become a Status carrying the failing
// expression, the library's name for the code, its description and file:line, e.g.
//   "CUDA error cudaErrorInvalidValue (invalid argument) in `cudaMemcpyAsync(...)` at
//    kernels/hadamard_cuda.cu:120".
// Use the QCAL_*_RETURN_IF_ERROR macros inside functions returning qcal::Status (or StatusOr),
// and QCAL_CUDA_RETURN_IF_LAUNCH_ERROR(name) right after every kernel launch.
//
// Only for targets that link CUDA (qcal_kernels_cuda and its users); the header pulls in the
// CUDA runtime, cuBLAS, cuSOLVER and NCCL declarations.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <string>

#include "common/status.h"

namespace qcal {

// Status for a CUDA runtime code: OK for cudaSuccess. Codes map to absl codes as:
// allocation failures → ResourceExhausted, no device / driver problems → Unavailable,
// invalid values/configurations → InvalidArgument, everything else → Internal.
Status CudaStatus(cudaError_t code, const char* expr, const char* file, int line);
Status CublasStatus(cublasStatus_t code, const char* expr, const char* file, int line);
Status CusolverStatus(cusolverStatus_t code, const char* expr, const char* file, int line);
Status NcclStatus(ncclResult_t code, const char* expr, const char* file, int line);

// True when at least one CUDA device is usable from this process. Otherwise false, with the
// reason (driver missing, no device, CUDA error text) in *why when why != nullptr. Thread-safe.
bool CudaDeviceAvailable(std::string* why);

}  // namespace qcal

#define QCAL_GPU_RETURN_IF_ERROR_IMPL_(fn, expr)                             \
  do {                                                                       \
    ::absl::Status qcal_gpu_status_ = fn((expr), #expr, __FILE__, __LINE__); \
    if (!qcal_gpu_status_.ok()) return qcal_gpu_status_;                     \
  } while (0)

// Evaluates a cudaError_t expression; returns a Status from the enclosing function on failure.
#define QCAL_CUDA_RETURN_IF_ERROR(expr) QCAL_GPU_RETURN_IF_ERROR_IMPL_(::qcal::CudaStatus, expr)
#define QCAL_CUBLAS_RETURN_IF_ERROR(expr) QCAL_GPU_RETURN_IF_ERROR_IMPL_(::qcal::CublasStatus, expr)
#define QCAL_CUSOLVER_RETURN_IF_ERROR(expr) \
  QCAL_GPU_RETURN_IF_ERROR_IMPL_(::qcal::CusolverStatus, expr)
#define QCAL_NCCL_RETURN_IF_ERROR(expr) QCAL_GPU_RETURN_IF_ERROR_IMPL_(::qcal::NcclStatus, expr)

// Checks the most recent kernel launch (cudaGetLastError); `name` is the kernel's name for the
// message. Launch errors are asynchronous-safe to check here: this catches configuration errors;
// execution errors surface at the next synchronizing call.
#define QCAL_CUDA_RETURN_IF_LAUNCH_ERROR(name)                                         \
  do {                                                                                 \
    ::absl::Status qcal_gpu_status_ =                                                  \
        ::qcal::CudaStatus(cudaGetLastError(), "launch of " name, __FILE__, __LINE__); \
    if (!qcal_gpu_status_.ok()) return qcal_gpu_status_;                               \
  } while (0)
