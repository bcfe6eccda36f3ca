// Device-free checks of the CUDA glue: Status conversion of CUDA/cuBLAS/cuSOLVER/NCCL codes and
// FwhtCuda's argument validation (which happens before any CUDA call). Runs without a GPU.
#include "kernels/cuda_status.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/hadamard_cuda.h"

namespace qcal {
namespace {

// Argument validation happens before any CUDA call, so it runs without a device too.
TEST(FwhtCudaArgsTest, RejectsBadShapes) {
  FwhtCudaParams p;
  float dummy = 0;
  p.data = &dummy;
  p.batch = 1;
  for (int64_t n : {int64_t{0}, int64_t{3}, int64_t{12}, int64_t{6144}, int64_t{1} << 31}) {
    p.n = n;
    EXPECT_EQ(FwhtCuda(p, nullptr).code(), absl::StatusCode::kInvalidArgument) << n;
  }
  p.n = 8;
  p.batch = -1;
  EXPECT_EQ(FwhtCuda(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.batch = 0;
  EXPECT_TRUE(FwhtCuda(p, nullptr).ok());  // empty batch: nothing to launch
  p.batch = 1;
  p.data = nullptr;
  EXPECT_EQ(FwhtCuda(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaStatusTest, CarriesExpressionAndLocation) {
  const Status ok = CudaStatus(cudaSuccess, "x", "f.cc", 1);
  EXPECT_TRUE(ok.ok());
  const Status s = CudaStatus(cudaErrorInvalidValue, "cudaMemcpy(a, b)", "file.cu", 42);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cudaErrorInvalidValue"), std::string::npos) << s;
  EXPECT_NE(s.message().find("cudaMemcpy(a, b)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("file.cu:42"), std::string::npos) << s;
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "m", "f", 1).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "c", "f", 1).ok());
  EXPECT_FALSE(CusolverStatus(CUSOLVER_STATUS_INVALID_VALUE, "c", "f", 1).ok());
  EXPECT_FALSE(NcclStatus(ncclInvalidArgument, "c", "f", 1).ok());
}

}  // namespace
}  // namespace qcal
