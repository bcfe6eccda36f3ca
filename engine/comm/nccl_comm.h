// NcclComm: Comm over NCCL, device buffers (built only with QCAL_CUDA; QCAL_HAVE_CUDA is defined
// for users of qcal_kernels_cuda). Rank 0 of `mpi_comm` creates the ncclUniqueId and broadcasts it
// over MPI (nccl-tests style); every rank then joins with ncclCommInitRank on `device`.
//
// All calls are synchronous: each enqueues on the communicator's own stream and waits for it, so
// buffers may be reused as soon as a call returns. Gather stages the root's result through a
// device buffer and copies it to the host vector. Sizes for Gather travel over MPI.
// NCCL/CUDA/MPI failures are Status naming the call and file:line. Not thread-safe.
#pragma once

#include <mpi.h>

#include <memory>

#include "common/status.h"
#include "engine/comm/comm.h"

namespace qcal::comm {

// Requires MPI to be initialized and a CUDA device `device` (cudaSetDevice is called).
StatusOr<std::unique_ptr<Comm>> MakeNcclComm(MPI_Comm mpi_comm, int device);

}  // namespace qcal::comm
