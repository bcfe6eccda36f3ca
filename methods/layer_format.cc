#include "methods/layer_format.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::methods {
namespace {

class DenseFormat final : public LayerFormat {
 public:
  const char* name() const override { return "dense"; }
  StatusOr<std::unique_ptr<model::Linear>> Load(CheckpointReader& ckpt,
                                                const std::string& prefix) const override {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(prefix + ".weight"));
    if (found.second->shape.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt.dir(), ": ", prefix, ".weight is not a matrix"));
    }
    QCAL_ASSIGN_OR_RETURN(std::vector<float> data, ckpt.ReadF32(prefix + ".weight"));
    return std::unique_ptr<model::Linear>(std::make_unique<model::DenseLinear>(
        at::from_blob(data.data(), found.second->shape, at::kFloat).clone()));
  }
};

class ScalarFormat final : public LayerFormat {
 public:
  const char* name() const override { return "scalar"; }
  StatusOr<std::unique_ptr<model::Linear>> Load(CheckpointReader& ckpt,
                                                const std::string& prefix) const override {
    QCAL_ASSIGN_OR_RETURN(auto layer, quant::ScalarQuantLinear::Load(ckpt, prefix));
    return std::unique_ptr<model::Linear>(std::move(layer));
  }
};

}  // namespace

LayerFormats::LayerFormats()
    : formats_{std::make_shared<DenseFormat>(), std::make_shared<ScalarFormat>()} {}

void LayerFormats::Add(std::shared_ptr<const LayerFormat> format) {
  for (auto& f : formats_) {
    if (std::string_view(f->name()) == format->name()) {
      f = std::move(format);
      return;
    }
  }
  formats_.push_back(std::move(format));
}

const LayerFormat* LayerFormats::Find(std::string_view name) const {
  for (const auto& f : formats_) {
    if (name == f->name()) return f.get();
  }
  return nullptr;
}

Status LayerFormats::Append(const model::Linear& linear, const std::string& prefix,
                            SafetensorsWriter* writer) const {
  const model::Linear& stored = linear.stored();
  const char* name = stored.layer_format();
  if (name == nullptr || Find(name) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, ": a layer in format '", name ? name : "none",
        "', which this method's checkpoints cannot hold"));
  }
  return stored.AppendTensors(prefix, writer);
}

StatusOr<std::unique_ptr<model::Linear>> LayerFormats::Load(CheckpointReader& ckpt,
                                                            const std::string& prefix,
                                                            const std::string& quantized) const {
  const std::string name = ckpt.Has(prefix + ".weight") ? "dense" : quantized;
  const LayerFormat* format = Find(name);
  if (format == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", prefix,
                                                   ": no layer format '", name, "'"));
  }
  return format->Load(ckpt, prefix);
}

}  // namespace qcal::methods
