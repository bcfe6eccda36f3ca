// The compute backend a worker process uses for its heavy kernels: the CPU code everywhere, or a
// GPU backend installed once per process (kernels/device_select.h picks the device and installs
// kernels/gpu_backend_cuda.cc's implementation). Callers ask ActiveGpuBackend() and fall back to
// the CPU path when it is null or declines an operation; tests install fakes.
//
// The interface is deliberately in CPU-side types (host arrays, Fixed128 sums), so the methods
// and the calibration code never include CUDA headers and CPU-only builds are unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/fixed_point.h"
#include "kernels/rounding.h"

namespace qcal::kernels {

// Exact fixed-point Hessian sums of one linear input on the device (fixed_point.h's format).
class DeviceHessian {
 public:
  virtual ~DeviceHessian() = default;
  // x: host fp32 [seqs, t, n] row-major (each sequence's xᵀx rounded and summed exactly).
  virtual Status Add(const float* x, int64_t seqs, int64_t t) = 0;
  // The packed sums T and the row count; the object is spent afterwards.
  virtual StatusOr<std::vector<Fixed128>> Finish(int64_t* count) = 0;
};

class GpuBackend {
 public:
  virtual ~GpuBackend() = default;
  // "cuda:0 (NVIDIA H100 80GB HBM3, 79.2 GiB)".
  virtual std::string description() const = 0;
  virtual StatusOr<std::unique_ptr<DeviceHessian>> NewHessian(int64_t n) = 0;
  // BlockLDLQ with the E8P codebook (BlockLdlq's contract for codebook "e8p"; refine_sweeps 0).
  virtual StatusOr<VectorRoundingResult> BlockLdlqE8p(const double* w, int64_t m, int64_t n,
                                                      const double* h,
                                                      const VectorRoundingConfig& config) = 0;
  // GPTQ (Gptq's contract, refinement sweeps included).
  virtual StatusOr<ScalarRoundingResult> Gptq(const double* w, int64_t m, int64_t n,
                                              const double* h,
                                              const ScalarRoundingConfig& config) = 0;
};

// The process's backend (borrowed; null: CPU). Set once at start-up, before worker threads run.
GpuBackend* ActiveGpuBackend();
// Installs `backend` (owned by the process from then on; nullptr restores the CPU path) and
// returns the previous one, for tests.
std::unique_ptr<GpuBackend> SetActiveGpuBackend(std::unique_ptr<GpuBackend> backend);

}  // namespace qcal::kernels
