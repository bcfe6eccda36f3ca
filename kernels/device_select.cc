#include "kernels/device_select.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/gpu_backend.h"

#if defined(QCAL_HAVE_CUDA)
#include "kernels/gpu_backend_cuda.h"
#endif

namespace qcal::kernels {

int LocalRankFromEnvironment() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* v = std::getenv(name);
    int r = 0;
    if (v != nullptr && absl::SimpleAtoi(v, &r) && r >= 0) return r;
  }
  return 0;
}

namespace {
int g_selected_cuda_device = -1;
}  // namespace

int SelectedCudaDevice() { return g_selected_cuda_device; }

StatusOr<std::string> SelectComputeDevice(std::string_view requested_view) {
  const std::string requested(requested_view);
  g_selected_cuda_device = -1;
  int index = -1;  // -1: by local rank
  bool want_cuda = false;
  if (requested == "cpu") {
    SetActiveGpuBackend(nullptr);
    return std::string("cpu");
  }
  if (requested == "auto") {
  } else if (requested == "cuda") {
    want_cuda = true;
  } else if (requested.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(requested.substr(5), &index) &&
             index >= 0) {
    want_cuda = true;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device: '", requested, "' is not one of auto, cpu, cuda, cuda:N"));
  }
#if defined(QCAL_HAVE_CUDA)
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count <= 0) {
    if (want_cuda) {
      return absl::UnavailableError(
          absl::StrCat("--device ", requested, ": no usable CUDA device (", why, ")"));
    }
    SetActiveGpuBackend(nullptr);
    return absl::StrCat("cpu (auto: no CUDA device: ", why, ")");
  }
  if (index >= count) {
    return absl::InvalidArgumentError(absl::StrCat("--device ", requested, ": this machine has ",
                                                   count, " CUDA device(s)"));
  }
  if (index < 0) index = LocalRankFromEnvironment() % count;
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<GpuBackend> backend, CreateCudaBackend(index));
  std::string description = backend->description();
  SetActiveGpuBackend(std::move(backend));
  g_selected_cuda_device = index;
  return description;
#else
  if (want_cuda) {
    return absl::UnavailableError(absl::StrCat(
        "--device ", requested, ": this build has no CUDA support (configure with QCAL_CUDA=ON "
        "on a machine with the CUDA toolkit)"));
  }
  SetActiveGpuBackend(nullptr);
  return std::string("cpu (auto: built without CUDA)");
#endif
}

}  // namespace qcal::kernels
