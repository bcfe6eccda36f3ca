// Exact batched E8P encoding on the GPU (kernels/e8p_cuda.h). Mirrors E8pCodebook::ScanShift,
// ScoreSourceRows and BestNegationMask (kernels/e8p.cc) operation for operation.
#include "kernels/e8p_cuda.h"

#include <cuda_runtime_api.h>

#include <climits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/e8p_device.cuh"

namespace qcal::kernels {
namespace {

__global__ void E8pEncodeKernel(const float* __restrict__ x, int64_t count,
                                uint32_t* __restrict__ codes, float* __restrict__ out) {
  __shared__ E8pTables tables;
  LoadE8pTables(&tables);
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= count) return;
  float xv[8];
  for (int j = 0; j < 8; ++j) xv[j] = x[v * 8 + j];
  const uint32_t result = EncodeOne(tables, xv);
  codes[v] = result;
  if (out != nullptr) DecodeE8p(tables, result, out + v * 8);
}

}  // namespace

Status E8pEncodeCuda(const float* x, int64_t count, uint32_t* codes, float* out, void* stream) {
  if (count < 0 || (count > 0 && (x == nullptr || codes == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("E8pEncodeCuda: bad arguments (count ", count, ", null pointer?)"));
  }
  if (count == 0) return absl::OkStatus();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  QCAL_RETURN_IF_ERROR(UploadE8pTables(s));
  constexpr int kThreads = 128;
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > INT_MAX) return absl::InvalidArgumentError("E8pEncodeCuda: count too large");
  E8pEncodeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(x, count, codes, out);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("E8pEncodeKernel");
  return absl::OkStatus();
}

}  // namespace qcal::kernels
