#include "kernels/gpu_backend.h"

#include <utility>

namespace qcal::kernels {
namespace {
std::unique_ptr<GpuBackend>& Slot() {
  static std::unique_ptr<GpuBackend> backend;
  return backend;
}
}  // namespace

GpuBackend* ActiveGpuBackend() { return Slot().get(); }

std::unique_ptr<GpuBackend> SetActiveGpuBackend(std::unique_ptr<GpuBackend> backend) {
  return std::exchange(Slot(), std::move(backend));
}

}  // namespace qcal::kernels
