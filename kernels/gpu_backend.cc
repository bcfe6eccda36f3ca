#include "kernels/gpu_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace qcal::kernels {
namespace {
std::unique_ptr<GpuBackend>& Slot() {
  static std::unique_ptr<GpuBackend> backend;
  return backend;
}
}  // namespace

Status CheckBlockForwardShape(const BlockForwardShape& s) {
  if (s.hidden < 1 || s.intermediate < 1 || s.heads < 1 || s.kv_heads < 1 || s.head_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block forward: sizes must be positive (hidden ", s.hidden, ", intermediate ",
        s.intermediate, ", heads ", s.heads, ", kv_heads ", s.kv_heads, ", head_dim ", s.head_dim,
        ")"));
  }
  if (s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("block forward: ", s.heads,
                                                   " heads are not a multiple of ", s.kv_heads,
                                                   " KV heads"));
  }
  if (s.head_dim % 2 != 0 || s.head_dim > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block forward: head_dim ", s.head_dim, " (the device kernel takes even sizes up to 128)"));
  }
  if (!(s.rms_eps >= 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat("block forward: rms_eps ", s.rms_eps));
  }
  return absl::OkStatus();
}

GpuBackend* ActiveGpuBackend() { return Slot().get(); }

std::unique_ptr<GpuBackend> SetActiveGpuBackend(std::unique_ptr<GpuBackend> backend) {
  return std::exchange(Slot(), std::move(backend));
}

}  // namespace qcal::kernels
