// dense: each linear's dequantized weight as the checkpoint's method computes it (float32), for
// any method whose function a plain Llama forward computes.
#include <ATen/ATen.h>

#include "export/format.h"

namespace qcal::exporter {
namespace {

class DenseFormat final : public Format {
 public:
  DenseFormat(const Source& source, TensorPlan* plan) : source_(source), plan_(plan) {}

  // Tables stay as stored (their values, whatever the dtype, are what qcal computed with).
  std::optional<DType> FloatDType() const override { return std::nullopt; }

  Status Check() override { return CheckServed(source_, "dense", /*linear_inputs_allowed=*/false); }

  Status PlanLinear(int64_t layer, model::LinearKind k) override {
    plan_->AddBlockTensor(LinearPrefix(layer, k) + ".weight", DType::kF32,
                          model::LinearShape(source_.config, k), layer,
                          [k](const LoadedBlock& b, const Sink& sink) -> Status {
                            const at::Tensor w = b.weights.linear(k).DenseWeight().contiguous();
                            return sink(w.data_ptr<float>(), w.numel() * sizeof(float));
                          });
    return absl::OkStatus();
  }

  StatusOr<nlohmann::json> Finish(const std::string&, nlohmann::json* config) override {
    (*config)["torch_dtype"] = "float32";
    return nlohmann::json();
  }

 private:
  const Source& source_;
  TensorPlan* plan_;
};

}  // namespace

std::unique_ptr<Format> MakeDenseFormat(const Source& source, TensorPlan* plan) {
  return std::make_unique<DenseFormat>(source, plan);
}

}  // namespace qcal::exporter
