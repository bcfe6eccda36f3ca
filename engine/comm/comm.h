// Collectives between the ranks of one job (the data plane). Tensors move between ranks only
// through this interface, never through the coordinator.
//
// Implementations:
//   MpiComm    (engine/comm/mpi_comm.cc)    host buffers over an MPI communicator
//   NcclComm   (engine/comm/nccl_comm.cc)   device buffers; rank 0 makes the ncclUniqueId and
//                                           broadcasts it over MPI (built with QCAL_CUDA)
//   ThreadComm (engine/comm/thread_comm.cc) N ranks as N threads of one process (tests;
//                                           c10d-style threads-as-ranks)
//   SelfComm   world of one (the single-process `qcal quantize`)
//
// Contract: every rank calls the same collectives in the same order with the same counts.
// Integer sums are exact, so any reduction tree gives identical bits; floating-point sums are
// not guaranteed to be bitwise reproducible across world sizes (use the fixed-point Hessian
// accumulator when bits matter). Buffers for MpiComm / ThreadComm / SelfComm are host memory;
// for NcclComm, device memory. Errors are returned, not thrown; after an error the
// communicator is unusable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace qcal::comm {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "mpi", "nccl", "threads", "self"

  // In-place sums over all ranks.
  virtual Status AllReduceSum(int64_t* data, size_t count) = 0;
  virtual Status AllReduceSum(double* data, size_t count) = 0;
  // In-place broadcast of `bytes` bytes from `root`.
  virtual Status Broadcast(void* data, size_t bytes, int root) = 0;
  // Each rank contributes `bytes` bytes (may differ per rank); on `root`, *out receives every
  // rank's bytes in rank order (out is untouched elsewhere).
  virtual Status Gather(const void* data, size_t bytes, int root, std::vector<char>* out) = 0;
  virtual Status Barrier() = 0;
};

// Every rank's `bytes` bytes (the count may differ per rank), concatenated in rank order into
// *out on every rank; *sizes (when given) gets each rank's count. A collective built from
// AllReduceSum (the counts) and one Broadcast per rank, so every Comm has it. The data moved is
// each rank's bytes to every other rank: meant for activations of one calibration chunk, not
// for anything that grows with the model.
Status AllGather(Comm& comm, const void* data, size_t bytes, std::vector<char>* out,
                 std::vector<size_t>* sizes = nullptr);

// Personalised exchange: rank r sends send[d] to every rank d (send.size() == size(); sizes may
// differ and be 0) and gets recv[s], what rank s sent it, for every s (its own included). Built
// from AllReduceSum (the size × size byte counts) and one Gather per rank that receives
// anything, so every Comm has it. Collective.
Status AllToAll(Comm& comm, const std::vector<std::vector<char>>& send,
                std::vector<std::vector<char>>* recv);

// A world of one: reductions and broadcasts are no-ops.
std::unique_ptr<Comm> MakeSelfComm();

// Creates `n` connected communicators, one per thread-rank (index i has rank i).
std::vector<std::unique_ptr<Comm>> MakeThreadComms(int n);

// The contiguous part [begin, end) of `total` items that `rank` of `size` owns: the first
// total % size ranks get one more. Deterministic and independent of anything else.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Range SliceForRank(int64_t total, int rank, int size);

}  // namespace qcal::comm
