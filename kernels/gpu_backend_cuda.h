// The CUDA implementation of kernels/gpu_backend.h: Hessians through HessianAccumulatorCuda (fp32
// inputs, exact fixed-point sums), BlockLDLQ (E8P) through BlockLdlqE8pCuda and GPTQ through
// GptqCuda, on one device.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "kernels/gpu_backend.h"

namespace qcal::kernels {

// Usable CUDA devices (0 with the reason in *why when none).
int CudaDeviceCount(std::string* why);

// Binds the calling process to device `index` (cudaSetDevice) and returns its backend.
StatusOr<std::unique_ptr<GpuBackend>> CreateCudaBackend(int index);

}  // namespace qcal::kernels
