# worker/runtime: the worker's task loop, coordinator client and Comm implementations.
# Included by worker/CMakeLists.txt; appends to QCAL_WORKER_SOURCES / QCAL_WORKER_EXTRA_DEPS.

# The collectives (no LibTorch): a small target of their own so their tests build quickly.
qcal_add_library(qcal_comm
  SOURCES runtime/comm.cc runtime/thread_comm.cc runtime/mpi_comm.cc
  DEPS qcal_common MPI::MPI_CXX Threads::Threads)
# NcclComm (device buffers) only with CUDA, in its own target so that qcal_worker and the qcal
# CLI do not link the CUDA libraries; qcal-worker links it (and defines QCAL_HAVE_CUDA through
# qcal_kernels_cuda).
if(QCAL_CUDA)
  qcal_add_library(qcal_comm_nccl SOURCES runtime/nccl_comm.cc DEPS qcal_comm qcal_kernels_cuda)
endif()

list(APPEND QCAL_WORKER_EXTRA_DEPS qcal_job qcal_comm)

# The job's steps (shared by the single-process job and the worker task loop).
list(APPEND QCAL_WORKER_SOURCES quant/job_steps.cc)
