// The compute backend a worker process uses for its heavy kernels: the CPU code everywhere, or a
// GPU backend installed once per process (kernels/device_select.h picks the device and installs
// kernels/gpu_backend_cuda.cc's implementation). Callers ask ActiveGpuBackend() and fall back to
// the CPU path when it is null or declines an operation; tests install fakes.
//
// The interface is deliberately in CPU-side types (host arrays, Fixed128 sums), so the methods
// and the calibration code never include CUDA headers and CPU-only builds are unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/fixed_point.h"
#include "kernels/rounding.h"

namespace qcal::kernels {

// An in-place sum over the job's ranks of `count` int64 values in device memory: NCCL's
// all-reduce on the GPU ranks' communicator. The worker supplies it (kernels/ knows no
// communicator); every rank calls it at the same point with the same count.
using DeviceInt64Sum = std::function<Status(int64_t* device_data, size_t count)>;

// Exact fixed-point Hessian sums of one linear input on the device (fixed_point.h's format).
class DeviceHessian {
 public:
  virtual ~DeviceHessian() = default;
  // x: host fp32 [seqs, t, n] row-major (each sequence's xᵀx rounded and summed exactly).
  virtual Status Add(const float* x, int64_t seqs, int64_t t) = 0;
  // Rows (tokens) added on this rank.
  virtual int64_t count() const = 0;
  // Replaces this rank's sums with the sums over all ranks without leaving the device: the
  // packed sums as reduction digits (fixed_point.h; integers, so the result is exact and the same
  // for any reduction order or rank count) through `sum`, piece by piece so the digit buffer
  // stays small; the row count becomes `total_rows` (the caller sums the counts on the host).
  // A collective: every rank calls it at the same point for the same n. Unimplemented (the
  // default) when the backend cannot; the caller then reduces the downloaded sums on the host.
  virtual Status AllReduce(const DeviceInt64Sum& sum, int64_t total_rows) {
    return absl::UnimplementedError("this backend reduces Hessian sums on the host");
  }
  // The packed sums T and the row count; the object is spent afterwards.
  virtual StatusOr<std::vector<Fixed128>> Finish(int64_t* count) = 0;
};

// One Llama decoder block's calibration forward on the device (kernels/block_forward_cuda.h for
// the arithmetic): shape, host weights, precision.
struct BlockForwardShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double rms_eps = 1e-5;
};

// Host fp32 weights of one block, row-major; linears[k] in LinearKind order (q, k, v, o, gate,
// up, down), each [out, in].
struct BlockForwardWeights {
  const float* input_norm = nullptr;  // [hidden]
  const float* post_norm = nullptr;   // [hidden]
  const float* linears[7] = {};
};

enum class BlockForwardPrecision { kFloat32, kBf16 };

// InvalidArgument naming the problem when the device forward cannot run this shape (heads not a
// multiple of kv_heads, head_dim odd or above 128, sizes not positive); OK otherwise.
Status CheckBlockForwardShape(const BlockForwardShape& shape);

// A block's weights resident on the device, for the whole calibration of that block.
class DeviceBlock {
 public:
  virtual ~DeviceBlock() = default;
  // x, out: host fp32 [seqs, t, hidden]; cos, sin: host fp32 [t, head_dim], the RoPE tables of
  // positions 0..t-1. hessians[k] (engine/calib's HessianKind order: qkv, o, gate_up, down; null:
  // not collected) receive the linears' inputs, which stay on the device.
  virtual Status Forward(const float* x, int64_t seqs, int64_t t, const float* cos,
                         const float* sin, DeviceHessian* const hessians[4], float* out) = 0;
};

class GpuBackend {
 public:
  virtual ~GpuBackend() = default;
  // "cuda:0 (NVIDIA H100 80GB HBM3, 79.2 GiB)".
  virtual std::string description() const = 0;
  // The CUDA device index the backend computes on (LibTorch's work on the rank goes there when
  // LibTorch has CUDA); -1 (the default) for a backend that is not a CUDA device.
  virtual int cuda_device() const { return -1; }
  virtual StatusOr<std::unique_ptr<DeviceHessian>> NewHessian(int64_t n) = 0;
  // BlockLDLQ with the E8P codebook (BlockLdlq's contract for codebook "e8p"; refine_sweeps 0).
  virtual StatusOr<VectorRoundingResult> BlockLdlqE8p(const double* w, int64_t m, int64_t n,
                                                      const double* h,
                                                      const VectorRoundingConfig& config) = 0;
  // GPTQ (Gptq's contract, refinement sweeps included).
  virtual StatusOr<ScalarRoundingResult> Gptq(const double* w, int64_t m, int64_t n,
                                              const double* h,
                                              const ScalarRoundingConfig& config) = 0;
  // Uploads a plain decoder block (no hooks, dense fp32 weights) for its calibration forward.
  // Unimplemented (the default): the caller runs the CPU forward and feeds NewHessian's sums.
  virtual StatusOr<std::unique_ptr<DeviceBlock>> NewBlock(const BlockForwardShape& shape,
                                                          const BlockForwardWeights& weights,
                                                          BlockForwardPrecision precision) {
    return absl::UnimplementedError("this backend has no device block forward");
  }
  // The device memory high-water mark in bytes since the previous call (the first: since the
  // backend started), then a new mark from the memory in use now; -1 when unknown (the default).
  // The job's phase traces read it (common/phase_trace.h's device probe). Any thread.
  virtual int64_t TakePeakDeviceBytes() { return -1; }
};

// Kernel dispatch: a rounding kernel on `gpu` (the rank's backend, passed down by its caller;
// null: the CPU) when the backend has it, else the CPU's. Same contracts, same algorithms.
//
// GPTQ of W with H (GptqInPlace's contract: H is the CPU pass's work space and is as it was on
// return; the device reads it).
StatusOr<ScalarRoundingResult> RunGptq(GpuBackend* gpu, const double* w, int64_t rows,
                                       int64_t cols, double* h,
                                       const ScalarRoundingConfig& config);
// BlockLDLQ consuming H (BlockLdlqConsumingHessian's contract): the E8P pass on the device when
// `gpu` is given and the codebook is "e8p", the refinement sweeps on the host after it exactly
// as the CPU path runs them (RefineAfterBlockLdlq); other codebooks on the CPU.
StatusOr<VectorRoundingResult> RunBlockLdlq(GpuBackend* gpu, const double* w, int64_t rows,
                                            int64_t cols, std::vector<double> h,
                                            const VectorCodebook& codebook,
                                            const VectorRoundingConfig& config);

// The process's backend (borrowed; null: CPU), as device selection (device_select.h) installed
// it. Read once per job, where the job opens (runner/job_steps.cc OpenJob); everything below
// gets the backend passed to it. Set once at start-up, before worker threads run.
GpuBackend* ActiveGpuBackend();
// Installs `backend` (owned by the process from then on; nullptr restores the CPU path) and
// returns the previous one, for tests.
std::unique_ptr<GpuBackend> SetActiveGpuBackend(std::unique_ptr<GpuBackend> backend);

}  // namespace qcal::kernels
