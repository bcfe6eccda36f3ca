# worker/runtime executables and the task-loop library (included by worker/CMakeLists.txt after
# qcal_worker is defined).

# The task loop and the coordinator client (gRPC). Separate from qcal_worker so the qcal CLI does
# not link the service stubs.
qcal_add_library(qcal_worker_runtime
  SOURCES runtime/task_loop.cc runtime/coordinator_client.cc
  DEPS qcal_worker qcal_comm qcal_job qcal_service_proto qcal_service_client gRPC::grpc++)

add_executable(qcal-worker runtime/worker_main.cc)
target_link_libraries(qcal-worker PRIVATE qcal_worker_runtime CLI11::CLI11 MPI::MPI_CXX)
# Calibration runs LibTorch on the CPU, so ranks exchange host buffers (MpiComm); NcclComm
# (qcal_comm_nccl) is built and tested beside it for device-resident steps.
qcal_target_defaults(qcal-worker)
