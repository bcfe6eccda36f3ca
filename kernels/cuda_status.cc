#include "kernels/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace qcal {
namespace {

std::string Where(const char* expr, const char* file, int line) {
  return absl::StrCat(" in `", expr, "` at ", file, ":", line);
}

const char* CublasName(cublasStatus_t code) {
  switch (code) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
    default:
      break;
  }
  return "CUBLAS_STATUS_<unknown>";
}

const char* CusolverName(cusolverStatus_t code) {
  switch (code) {
    case CUSOLVER_STATUS_SUCCESS:
      return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:
      return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:
      return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED:
      return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:
      return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default:
      break;
  }
  return "CUSOLVER_STATUS_<other>";
}

absl::StatusCode CudaCode(cudaError_t code) {
  switch (code) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidMemcpyDirection:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

Status CudaStatus(cudaError_t code, const char* expr, const char* file, int line) {
  if (code == cudaSuccess) return absl::OkStatus();
  return Status(CudaCode(code),
                absl::StrCat("CUDA error ", cudaGetErrorName(code), " (", cudaGetErrorString(code),
                             ")", Where(expr, file, line)));
}

Status CublasStatus(cublasStatus_t code, const char* expr, const char* file, int line) {
  if (code == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode status_code =
      code == CUBLAS_STATUS_ALLOC_FAILED    ? absl::StatusCode::kResourceExhausted
      : code == CUBLAS_STATUS_INVALID_VALUE ? absl::StatusCode::kInvalidArgument
                                            : absl::StatusCode::kInternal;
  return Status(status_code,
                absl::StrCat("cuBLAS error ", CublasName(code), " (", cublasGetStatusString(code),
                             ")", Where(expr, file, line)));
}

Status CusolverStatus(cusolverStatus_t code, const char* expr, const char* file, int line) {
  if (code == CUSOLVER_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode status_code =
      code == CUSOLVER_STATUS_ALLOC_FAILED    ? absl::StatusCode::kResourceExhausted
      : code == CUSOLVER_STATUS_INVALID_VALUE ? absl::StatusCode::kInvalidArgument
                                              : absl::StatusCode::kInternal;
  return Status(status_code, absl::StrCat("cuSOLVER error ", CusolverName(code), " (code ",
                                          static_cast<int>(code), ")", Where(expr, file, line)));
}

Status NcclStatus(ncclResult_t code, const char* expr, const char* file, int line) {
  if (code == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode status_code =
      code == ncclInvalidArgument || code == ncclInvalidUsage ? absl::StatusCode::kInvalidArgument
      : code == ncclRemoteError || code == ncclSystemError    ? absl::StatusCode::kUnavailable
                                                              : absl::StatusCode::kInternal;
  return Status(status_code, absl::StrCat("NCCL error ", static_cast<int>(code), " (",
                                          ncclGetErrorString(code), ")", Where(expr, file, line)));
}

bool CudaDeviceAvailable(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = absl::StrCat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    }
    cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "cudaGetDeviceCount reports 0 devices";
    return false;
  }
  if (why != nullptr) why->clear();
  return true;
}

}  // namespace qcal
