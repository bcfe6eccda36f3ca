#include "kernels/gpu_backend.h"

#include <chrono>
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

StatusOr<ScalarRoundingResult> RunGptq(GpuBackend* gpu, const double* w, int64_t rows,
                                       int64_t cols, double* h,
                                       const ScalarRoundingConfig& config) {
  if (gpu == nullptr) return GptqInPlace(w, rows, cols, h, config);
  const auto t = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(ScalarRoundingResult res, gpu->Gptq(w, rows, cols, h, config));
  res.times = RoundingTimes();
  res.times.round = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  return res;
}

StatusOr<VectorRoundingResult> RunBlockLdlq(GpuBackend* gpu, const double* w, int64_t rows,
                                            int64_t cols, std::vector<double> h,
                                            const VectorCodebook& codebook,
                                            const VectorRoundingConfig& config) {
  if (gpu == nullptr || codebook.name() != "e8p") {
    return BlockLdlqConsumingHessian(w, rows, cols, std::move(h), codebook, config);
  }
  QCAL_RETURN_IF_ERROR(CheckHessianValues(h.size(), cols, "block ldlq"));
  VectorRoundingConfig device_config = config;
  device_config.refine_sweeps = 0;
  auto t = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(VectorRoundingResult res,
                        gpu->BlockLdlqE8p(w, rows, cols, h.data(), device_config));
  res.times = RoundingTimes();
  res.times.round = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  if (config.refine_sweeps <= 0) return res;
  // The sweeps see W with its dead input columns zeroed, as the pass treated them.
  std::vector<double> live;
  const double* W = ZeroDeadColumns(w, rows, cols, h.data(), &live);
  t = std::chrono::steady_clock::now();
  QCAL_RETURN_IF_ERROR(RefineAfterBlockLdlq(W, h.data(), codebook, config, &res));
  res.times.refine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  return res;
}

GpuBackend* ActiveGpuBackend() { return Slot().get(); }

std::unique_ptr<GpuBackend> SetActiveGpuBackend(std::unique_ptr<GpuBackend> backend) {
  return std::exchange(Slot(), std::move(backend));
}

}  // namespace qcal::kernels
