#include "kernels/gpu_backend_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/block_forward_cuda.h"
#include "kernels/cuda_status.h"
#include "kernels/gptq_cuda.h"
#include "kernels/hessian_cuda.h"
#include "kernels/ldlq_cuda.h"

namespace qcal::kernels {
namespace {

class CudaHessian final : public DeviceHessian {
 public:
  CudaHessian(HessianAccumulatorCuda acc, int64_t n) : acc_(std::move(acc)), n_(n) {}
  ~CudaHessian() override { cudaFree(staging_); }

  Status Add(const float* x, int64_t seqs, int64_t t) override {
    const size_t count = static_cast<size_t>(seqs * t * n_);
    if (count == 0) return absl::OkStatus();
    if (count > capacity_) {
      QCAL_RETURN_IF_ERROR(acc_.Sync());  // the old buffer may still be read
      if (staging_ != nullptr) QCAL_CUDA_RETURN_IF_ERROR(cudaFree(staging_));
      staging_ = nullptr;
      capacity_ = 0;
      QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&staging_), count * 4));
      capacity_ = count;
    }
    // Synchronous copy (pageable host memory): the previous Add's GEMMs have read the buffer by
    // the time the copy runs on the same (default) stream.
    QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(staging_, x, count * 4, cudaMemcpyHostToDevice));
    return acc_.Add(staging_, HessianInputType::kFloat32, seqs, t);
  }

  int64_t count() const override { return acc_.count(); }

  // Pieces of kReducePiece packed values: 4 digits of 8 bytes each, 128 MiB of device buffer,
  // in place of 13 GB for the whole 28672-wide triangle at once.
  Status AllReduce(const DeviceInt64Sum& sum, int64_t total_rows) override {
    constexpr int64_t kReducePiece = int64_t{1} << 22;
    const int64_t size = HessianPackedSize(n_);
    const int64_t piece = std::min(size, kReducePiece);
    int64_t* limbs = nullptr;
    QCAL_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&limbs), static_cast<size_t>(piece) * 4 * 8));
    struct Free {
      int64_t* p;
      ~Free() { cudaFree(p); }
    } free_limbs{limbs};
    for (int64_t first = 0; first < size; first += piece) {
      const int64_t m = std::min(piece, size - first);
      QCAL_RETURN_IF_ERROR(acc_.ToDigits(first, m, limbs));
      // The communicator runs on its own stream: the digits must be written before it reads
      // them (and the previous piece's FromDigits, on this stream, is done with the buffer).
      QCAL_RETURN_IF_ERROR(acc_.Sync());
      QCAL_RETURN_IF_ERROR(sum(limbs, static_cast<size_t>(4 * m)));  // returns when complete
      QCAL_RETURN_IF_ERROR(acc_.FromDigits(first, m, limbs));
    }
    acc_.set_count(total_rows);
    return acc_.Sync();  // before the buffer is freed; reports an overflow past 128 bits
  }

  StatusOr<std::vector<Fixed128>> Finish(int64_t* count) override {
    QCAL_ASSIGN_OR_RETURN(std::vector<Fixed128> packed, acc_.Download());
    *count = acc_.count();
    return packed;
  }

  HessianAccumulatorCuda* accumulator() { return &acc_; }

 private:
  HessianAccumulatorCuda acc_;
  int64_t n_;
  float* staging_ = nullptr;
  size_t capacity_ = 0;
};

class CudaBlock final : public DeviceBlock {
 public:
  explicit CudaBlock(std::unique_ptr<BlockForwardCuda> block) : block_(std::move(block)) {}
  Status Forward(const float* x, int64_t seqs, int64_t t, const float* cos, const float* sin,
                 DeviceHessian* const hessians[4], float* out) override {
    HessianAccumulatorCuda* acc[4] = {};
    for (int k = 0; k < 4; ++k) {
      if (hessians[k] == nullptr) continue;
      auto* h = dynamic_cast<CudaHessian*>(hessians[k]);
      if (h == nullptr) {
        return absl::InvalidArgumentError("device block forward: a Hessian of another backend");
      }
      acc[k] = h->accumulator();
    }
    return block_->Forward(x, seqs, t, cos, sin, acc, out);
  }

 private:
  std::unique_ptr<BlockForwardCuda> block_;
};

// The device's memory in use (cudaMemGetInfo: total - free, so the CUDA context and any other
// process on the device count too), sampled every kSamplePeriod on a thread of its own; its
// high-water mark between two Take calls. Kernels' work spaces live for at least a kernel's
// duration, far above the period, so the peak a phase reports is the rounding's or the forward's.
class DeviceMemorySampler {
 public:
  static constexpr std::chrono::milliseconds kSamplePeriod{5};

  explicit DeviceMemorySampler(int device) : device_(device) {
    mark_ = Used();
    thread_ = std::thread([this] { Run(); });
  }
  ~DeviceMemorySampler() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  int64_t Take() {
    const int64_t used = Used();
    const int64_t peak = mark_.exchange(used);
    return used < 0 && peak < 0 ? -1 : std::max(peak, used);
  }

 private:
  int64_t Used() const {
    size_t free = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      return -1;
    }
    return static_cast<int64_t>(total - free);
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const int64_t used = Used();
      int64_t mark = mark_.load();
      while (used > mark && !mark_.compare_exchange_weak(mark, used)) {
      }
      wake_.wait_for(lock, kSamplePeriod, [this] { return stop_; });
    }
  }

  const int device_;
  std::atomic<int64_t> mark_{-1};
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // under mu_
  std::thread thread_;
};

class CudaBackend final : public GpuBackend {
 public:
  CudaBackend(int index, std::string description)
      : index_(index), description_(std::move(description)), memory_(index) {}
  std::string description() const override { return description_; }
  int cuda_device() const override { return index_; }

  int64_t TakePeakDeviceBytes() override { return memory_.Take(); }

  StatusOr<std::unique_ptr<DeviceHessian>> NewHessian(int64_t n) override {
    QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    QCAL_ASSIGN_OR_RETURN(HessianAccumulatorCuda acc, HessianAccumulatorCuda::Create(n, nullptr));
    return std::unique_ptr<DeviceHessian>(std::make_unique<CudaHessian>(std::move(acc), n));
  }

  StatusOr<VectorRoundingResult> BlockLdlqE8p(const double* w, int64_t m, int64_t n,
                                              const double* h,
                                              const VectorRoundingConfig& config) override {
    QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    return BlockLdlqE8pCuda(w, m, n, h, config, nullptr);
  }

  StatusOr<ScalarRoundingResult> Gptq(const double* w, int64_t m, int64_t n, const double* h,
                                      const ScalarRoundingConfig& config) override {
    QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    return GptqCuda(w, m, n, h, config, nullptr);
  }

  StatusOr<std::unique_ptr<DeviceBlock>> NewBlock(const BlockForwardShape& shape,
                                                  const BlockForwardWeights& weights,
                                                  BlockForwardPrecision precision) override {
    QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<BlockForwardCuda> block,
                          BlockForwardCuda::Create(shape, weights, precision, nullptr));
    return std::unique_ptr<DeviceBlock>(std::make_unique<CudaBlock>(std::move(block)));
  }

 private:
  int index_;
  std::string description_;
  DeviceMemorySampler memory_;
};

}  // namespace

int CudaDeviceCount(std::string* why) {
  if (!CudaDeviceAvailable(why)) return 0;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (why != nullptr) *why = cudaGetErrorString(e);
    return 0;
  }
  return count;
}

StatusOr<std::unique_ptr<GpuBackend>> CreateCudaBackend(int index) {
  QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  cudaDeviceProp prop{};
  QCAL_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, index));
  const std::string description =
      absl::StrFormat("cuda:%d (%s, %.1f GiB)", index, prop.name,
                      static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
  return std::unique_ptr<GpuBackend>(std::make_unique<CudaBackend>(index, description));
}

}  // namespace qcal::kernels
