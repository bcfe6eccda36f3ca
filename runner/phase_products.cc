#include "runner/phase_products.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "engine/calib/cache.h"
#include "engine/model/tensor_io.h"
#include "methods/method_factory.h"
#include "runner/job_dir.h"
#include "runner/journal.h"

namespace qcal::job {

namespace {
constexpr char kCurveKey[] = "training_curve";
}  // namespace

std::optional<v1::PhaseCurve> CurveOf(const std::string& phase,
                                      const methods::TrainingCurve& curve) {
  if (curve.empty()) return std::nullopt;
  v1::PhaseCurve c;
  c.set_phase(phase);
  for (double v : curve.losses) c.add_losses(v);
  for (const auto& [step, loss] : curve.validation) {
    c.add_validation_steps(step);
    c.add_validation_losses(loss);
  }
  return c;
}

Status SavePhaseResult(const std::string& path, const methods::PhaseResult& result,
                       const std::string& phase, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  writer.SetMetadata("phase", phase);
  if (auto curve = CurveOf(phase, result.curve)) {
    writer.SetMetadata(kCurveKey, PhaseDoneEntry(*curve).dump());
  }
  for (const auto& [name, t] : result.products) {
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, name, t.detach().to(at::kDouble)));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return calib::WriteCacheChecksum(path);
}

StatusOr<methods::PhaseResult> LoadPhaseResult(const std::string& path, const std::string& phase,
                                               const std::string& key) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no products of phase '", phase, "'"));
  }
  const Status verified = calib::VerifyCacheChecksum(path);
  if (!verified.ok()) return absl::DataLossError(verified.message());
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const auto& meta = file->metadata();
  auto it = meta.find("calibration_key");
  auto ph = meta.find("phase");
  if (it == meta.end() || it->second != key || ph == meta.end() || ph->second != phase) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": made for another calibration or phase (stale): it is recomputed"));
  }
  methods::PhaseResult out;
  if (auto c = meta.find(kCurveKey); c != meta.end()) {
    const nlohmann::json entry =
        nlohmann::json::parse(c->second, nullptr, /*allow_exceptions=*/false);
    StatusOr<v1::PhaseCurve> curve = PhaseCurveFromEntry(entry);
    if (!curve.ok() || curve->phase() != phase) {
      return absl::DataLossError(absl::StrCat(path, ": malformed ", kCurveKey, " metadata"));
    }
    out.curve.losses.assign(curve->losses().begin(), curve->losses().end());
    for (int i = 0; i < curve->validation_steps_size(); ++i) {
      out.curve.validation.emplace_back(curve->validation_steps(i), curve->validation_losses(i));
    }
  }
  for (const TensorInfo& info : file->tensors()) {
    if (info.dtype != DType::kF64) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", info.name, "' is not F64"));
    }
    at::Tensor t = at::empty(info.shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), file->Data(info), t.numel() * sizeof(double));
    out.products[info.name] = t;
  }
  return out;
}

Status BindPhaseProducts(JobContext* ctx, int64_t layer) {
  const MethodNeeds needs = ctx->recipe.needs();
  if (needs.global_phases.empty() || ctx->method_bound) return absl::OkStatus();
  const JobPaths paths(ctx->spec.job_dir());
  methods::PhaseProductsByName phases;
  for (const std::string& phase : needs.global_phases) {
    auto products = LoadPhaseResult(paths.PhaseProducts(phase), phase, ctx->calib_key);
    if (!products.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", layer, ": no usable products of phase ", phase,
                       " (run calibration first): ", products.status().message()));
    }
    phases[phase] = std::move(products->products);
  }
  QCAL_ASSIGN_OR_RETURN(ctx->method, methods::MakeMethod(ctx->recipe, ctx->config, phases));
  ctx->method_bound = true;
  return absl::OkStatus();
}

}  // namespace qcal::job
