// Picks the compute device of a worker process: `--device auto|cpu|cuda|cuda:N` (qcal-worker,
// qcal quantize, qcal run).
//   cpu     the CPU kernels.
//   cuda    a local GPU: cuda:N, or N = the rank's local index (OMPI_COMM_WORLD_LOCAL_RANK,
//           SLURM_LOCALID or MPI_LOCALRANKID; 0 without one) modulo the device count. An error
//           when this build has no CUDA or the machine no usable device.
//   auto    cuda when a device is usable, else cpu (the reason is in the description).
// A CUDA choice binds the process to the device and installs the GPU backend
// (kernels/gpu_backend.h). Returns the description the worker reports when it registers, e.g.
// "cuda:0 (NVIDIA H100 80GB HBM3, 79.2 GiB)" or "cpu".
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace qcal::kernels {

StatusOr<std::string> SelectComputeDevice(std::string_view requested);

// The CUDA device the last SelectComputeDevice bound this process to; -1 for the CPU.
int SelectedCudaDevice();

// The local rank index from the launcher's environment (see above); 0 when none is set.
int LocalRankFromEnvironment();

}  // namespace qcal::kernels
