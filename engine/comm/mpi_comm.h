// MpiComm: Comm over an MPI communicator, host buffers. MPI_Init / MPI_Finalize belong to the
// caller (qcal-worker's main); the communicator is duplicated (so qcal's traffic never mixes
// with the caller's) with MPI_ERRORS_RETURN, so MPI failures come back as Status naming the
// call, the MPI error text and file:line instead of aborting.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "engine/comm/comm.h"

namespace qcal::comm {

// Status for an MPI return code: OK for MPI_SUCCESS, else Internal with the expression, MPI's
// error string and file:line.
Status MpiStatus(int code, const char* expr, const char* file, int line);

// Duplicates `comm` (MPI must be initialized). The returned Comm frees its duplicate on
// destruction, which must happen before MPI_Finalize.
StatusOr<std::unique_ptr<Comm>> MakeMpiComm(MPI_Comm comm = MPI_COMM_WORLD);

}  // namespace qcal::comm

#define QCAL_MPI_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                     \
    ::absl::Status qcal_mpi_status_ =                                                      \
        ::qcal::comm::MpiStatus((expr), #expr, __FILE__, __LINE__);                     \
    if (!qcal_mpi_status_.ok()) return qcal_mpi_status_;                                   \
  } while (0)
