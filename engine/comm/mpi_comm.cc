#include "engine/comm/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace qcal::comm {
namespace {

// MPI counts are int: large buffers go in pieces of at most this many elements.
constexpr size_t kMaxChunk = size_t{1} << 30;
constexpr int kGatherTag = 0x5143;  // point-to-point messages of Gather

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  Status AllReduceSum(int64_t* data, size_t count) override {
    for (size_t off = 0; off < count; off += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, count - off));
      QCAL_MPI_RETURN_IF_ERROR(
          MPI_Allreduce(MPI_IN_PLACE, data + off, n, MPI_INT64_T, MPI_SUM, comm_));
    }
    return absl::OkStatus();
  }
  Status AllReduceSum(double* data, size_t count) override {
    for (size_t off = 0; off < count; off += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, count - off));
      QCAL_MPI_RETURN_IF_ERROR(
          MPI_Allreduce(MPI_IN_PLACE, data + off, n, MPI_DOUBLE, MPI_SUM, comm_));
    }
    return absl::OkStatus();
  }
  Status Broadcast(void* data, size_t bytes, int root) override {
    QCAL_RETURN_IF_ERROR(CheckRoot(root));
    char* p = static_cast<char*>(data);
    for (size_t off = 0; off < bytes; off += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, bytes - off));
      QCAL_MPI_RETURN_IF_ERROR(MPI_Bcast(p + off, n, MPI_BYTE, root, comm_));
    }
    return absl::OkStatus();
  }
  // Sizes through MPI_Gather, then point-to-point pieces (Gatherv's int displacements would cap
  // the total at 2 GiB; activations of real models are larger).
  Status Gather(const void* data, size_t bytes, int root, std::vector<char>* out) override {
    QCAL_RETURN_IF_ERROR(CheckRoot(root));
    uint64_t mine = bytes;
    std::vector<uint64_t> sizes(rank_ == root ? size_ : 0);
    QCAL_MPI_RETURN_IF_ERROR(MPI_Gather(&mine, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T,
                                        root, comm_));
    if (rank_ != root) {
      const char* p = static_cast<const char*>(data);
      for (size_t off = 0; off < bytes; off += kMaxChunk) {
        const int n = static_cast<int>(std::min(kMaxChunk, bytes - off));
        QCAL_MPI_RETURN_IF_ERROR(
            MPI_Send(p + off, n, MPI_BYTE, root, kGatherTag, comm_));
      }
      return absl::OkStatus();
    }
    uint64_t total = 0;
    for (uint64_t s : sizes) total += s;
    out->resize(total);
    size_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      char* dst = out->data() + offset;
      if (r == rank_) {
        if (bytes > 0) std::memcpy(dst, data, bytes);
      } else {
        for (size_t off = 0; off < sizes[r]; off += kMaxChunk) {
          const int n = static_cast<int>(std::min<uint64_t>(kMaxChunk, sizes[r] - off));
          QCAL_MPI_RETURN_IF_ERROR(
              MPI_Recv(dst + off, n, MPI_BYTE, r, kGatherTag, comm_, MPI_STATUS_IGNORE));
        }
      }
      offset += sizes[r];
    }
    return absl::OkStatus();
  }
  Status Barrier() override {
    QCAL_MPI_RETURN_IF_ERROR(MPI_Barrier(comm_));
    return absl::OkStatus();
  }

 private:
  Status CheckRoot(int root) const {
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("mpi comm: root ", root, " is not a rank of ", size_));
    }
    return absl::OkStatus();
  }

  MPI_Comm comm_;
  const int rank_, size_;
};

}  // namespace

Status MpiStatus(int code, const char* expr, const char* file, int line) {
  if (code == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "unknown MPI error");
  }
  return absl::InternalError(absl::StrCat("MPI error ", code, " (", std::string(text), ") in `",
                                          expr, "` at ", file, ":", line));
}

StatusOr<std::unique_ptr<Comm>> MakeMpiComm(MPI_Comm comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError("MakeMpiComm: MPI is not initialized (call MPI_Init)");
  }
  MPI_Comm dup = MPI_COMM_NULL;
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_dup(comm, &dup));
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_rank(dup, &rank));
  QCAL_MPI_RETURN_IF_ERROR(MPI_Comm_size(dup, &size));
  return std::unique_ptr<Comm>(std::make_unique<MpiComm>(dup, rank, size));
}

}  // namespace qcal::comm
