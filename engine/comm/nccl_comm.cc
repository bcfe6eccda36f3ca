#include "engine/comm/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kernels/cuda_status.h"
#include "engine/comm/mpi_comm.h"

namespace qcal::comm {
namespace {

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<char, DeviceFree>;

StatusOr<DeviceBuffer> AllocDevice(size_t bytes) {
  void* p = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return DeviceBuffer(static_cast<char*>(p));
}

// Owns the NCCL communicator (non-copyable). The destructor destroys it and only warns on
// failure; Abort() is the explicit way out after an error (pending operations are abandoned).
class NcclComm final : public Comm {
 public:
  NcclComm(ncclComm_t comm, cudaStream_t stream, MPI_Comm mpi, int rank, int size, int device,
           DeviceBuffer scratch)
      : comm_(comm),
        stream_(stream),
        mpi_(mpi),
        rank_(rank),
        size_(size),
        device_(device),
        scratch_(std::move(scratch)) {}
  ~NcclComm() override {
    if (!aborted_) {
      const ncclResult_t r = ncclCommDestroy(comm_);
      if (r != ncclSuccess) {
        QCAL_LOG_WARN("ncclCommDestroy (rank {}) failed: {}", rank_, ncclGetErrorString(r));
      }
    }
    scratch_.reset();
    cudaStreamDestroy(stream_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&mpi_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }

  Status AllReduceSum(int64_t* data, size_t count) override {
    QCAL_RETURN_IF_ERROR(Usable());
    QCAL_NCCL_RETURN_IF_ERROR(
        ncclAllReduce(data, data, count, ncclInt64, ncclSum, comm_, stream_));
    return Sync();
  }
  Status AllReduceSum(double* data, size_t count) override {
    QCAL_RETURN_IF_ERROR(Usable());
    QCAL_NCCL_RETURN_IF_ERROR(
        ncclAllReduce(data, data, count, ncclDouble, ncclSum, comm_, stream_));
    return Sync();
  }
  Status Broadcast(void* data, size_t bytes, int root) override {
    QCAL_RETURN_IF_ERROR(Usable(root));
    QCAL_NCCL_RETURN_IF_ERROR(ncclBroadcast(data, data, bytes, ncclChar, root, comm_, stream_));
    return Sync();
  }
  Status Gather(const void* data, size_t bytes, int root, std::vector<char>* out) override {
    QCAL_RETURN_IF_ERROR(Usable(root));
    uint64_t mine = bytes;
    std::vector<uint64_t> sizes(size_);
    QCAL_MPI_RETURN_IF_ERROR(
        MPI_Gather(&mine, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T, root, mpi_));
    if (rank_ != root) {
      if (bytes > 0) {
        QCAL_NCCL_RETURN_IF_ERROR(ncclSend(data, bytes, ncclChar, root, comm_, stream_));
      }
      return Sync();
    }
    uint64_t total = 0;
    for (uint64_t s : sizes) total += s;
    QCAL_ASSIGN_OR_RETURN(DeviceBuffer staging, AllocDevice(total));
    QCAL_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    uint64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ && sizes[r] > 0) {
        QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.get() + offset, data, sizes[r],
                                                  cudaMemcpyDeviceToDevice, stream_));
      } else if (sizes[r] > 0) {
        QCAL_NCCL_RETURN_IF_ERROR(
            ncclRecv(staging.get() + offset, sizes[r], ncclChar, r, comm_, stream_));
      }
      offset += sizes[r];
    }
    QCAL_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    QCAL_RETURN_IF_ERROR(Sync());
    out->resize(total);
    if (total > 0) {
      QCAL_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(out->data(), staging.get(), total, cudaMemcpyDeviceToHost));
    }
    return absl::OkStatus();
  }
  Status Barrier() override {
    QCAL_RETURN_IF_ERROR(Usable());
    QCAL_NCCL_RETURN_IF_ERROR(
        ncclAllReduce(scratch_.get(), scratch_.get(), 1, ncclInt32, ncclSum, comm_, stream_));
    return Sync();
  }

  // Abandons the communicator after an error (ncclCommAbort); later calls fail.
  Status Abort() {
    if (aborted_) return absl::OkStatus();
    aborted_ = true;
    QCAL_NCCL_RETURN_IF_ERROR(ncclCommAbort(comm_));
    return absl::OkStatus();
  }

 private:
  Status Usable(int root = 0) {
    if (aborted_) return absl::FailedPreconditionError("nccl comm was aborted after an error");
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl comm: root ", root, " is not a rank of ", size_));
    }
    QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return absl::OkStatus();
  }
  Status Sync() {
    const cudaError_t err = cudaStreamSynchronize(stream_);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess) {
      const Status s = NcclStatus(async, "ncclCommGetAsyncError", __FILE__, __LINE__);
      Abort().IgnoreError();
      return s;
    }
    QCAL_CUDA_RETURN_IF_ERROR(err);
    return absl::OkStatus();
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  MPI_Comm mpi_;
  const int rank_, size_, device_;
  DeviceBuffer scratch_;
  bool aborted_ = false;
};

}  // namespace

StatusOr<std::unique_ptr<Comm>> MakeNcclComm(MPI_Comm mpi_comm, int device) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError("MakeNcclComm: MPI is not initialized (call MPI_Init)");
  }
  MPI_Comm mpi = MPI_COMM_NULL;
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_dup(mpi_comm, &mpi));
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_rank(mpi, &rank));
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_size(mpi, &size));
  // Free the duplicate on every error path below.
  struct MpiFree {
    MPI_Comm* comm;
    bool release = false;
    ~MpiFree() {
      if (!release) MPI_Comm_free(comm);
    }
  } guard{&mpi};
  QCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank == 0) QCAL_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  QCAL_MPI_RETURN_IF_ERROR(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi));
  cudaStream_t stream = nullptr;
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRank(&comm, size, id, rank);
  if (init != ncclSuccess) {
    cudaStreamDestroy(stream);
    return NcclStatus(init, "ncclCommInitRank(&comm, size, id, rank)", __FILE__, __LINE__);
  }
  auto scratch = AllocDevice(sizeof(int32_t));
  if (!scratch.ok()) {
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
    return scratch.status();
  }
  guard.release = true;
  return std::unique_ptr<Comm>(std::make_unique<NcclComm>(comm, stream, mpi, rank, size, device,
                                                          std::move(*scratch)));
}

}  // namespace qcal::comm
