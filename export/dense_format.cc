// dense: each linear's dequantized weight as the checkpoint's method computes it (float32), for
// any method whose function a plain Llama forward computes; a Llama 4 MoE block's experts fused
// into the float checkpoint's 3-D tensors, as Hugging Face's Llama4TextExperts holds them.
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "export/format.h"

namespace qcal::exporter {
namespace {

class DenseFormat final : public Format {
 public:
  DenseFormat(const Source& source, TensorPlan* plan) : source_(source), plan_(plan) {}

  // Tables stay as stored (their values, whatever the dtype, are what qcal computed with).
  std::optional<DType> FloatDType() const override { return std::nullopt; }

  Status Check() override { return CheckServed(source_, "dense", /*linear_inputs_allowed=*/false); }

  Status PlanLinear(const LinearRef& ref) override {
    plan_->AddDenseWeight(ref, DType::kF32);
    return absl::OkStatus();
  }

  // Llama 4: experts.gate_up_proj [E, hidden, 2·inter] (each expert's gate_projᵀ then up_projᵀ)
  // and experts.down_proj [E, inter, hidden] (down_projᵀ), written expert by expert. Mixtral:
  // per-expert w1 / w3 / w2, as its float checkpoints.
  Status PlanExperts(const std::vector<LinearRef>& experts) override {
    const LlamaConfig& c = source_.config;
    if (c.family != ModelFamily::kLlama4) return Format::PlanExperts(experts);
    if (experts.empty()) return absl::OkStatus();
    const int64_t layer = experts.front().layer, e_count = c.num_experts;
    const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
    const std::string f =
        c.TensorName(absl::StrCat("model.layers.", layer, ".feed_forward.experts."));
    plan_->AddBlockTensor(
        f + "gate_up_proj", DType::kF32, {e_count, hidden, 2 * inter}, layer,
        [e_count](const LoadedBlock& b, const Sink& sink) -> Status {
          for (int64_t e = 0; e < e_count; ++e) {
            const model::ExpertWeights& x = b.weights.moe->experts.at(e);
            const at::Tensor gate_up =
                at::cat({x.linear(model::ExpertLinear::kGate).DenseWeight().t(),
                         x.linear(model::ExpertLinear::kUp).DenseWeight().t()},
                        1).to(at::kFloat).contiguous();
            QCAL_RETURN_IF_ERROR(sink(gate_up.data_ptr<float>(), gate_up.numel() * sizeof(float)));
          }
          return absl::OkStatus();
        });
    plan_->AddBlockTensor(
        f + "down_proj", DType::kF32, {e_count, inter, hidden}, layer,
        [e_count](const LoadedBlock& b, const Sink& sink) -> Status {
          for (int64_t e = 0; e < e_count; ++e) {
            const at::Tensor down = b.weights.moe->experts.at(e)
                                        .linear(model::ExpertLinear::kDown)
                                        .DenseWeight().t().to(at::kFloat).contiguous();
            QCAL_RETURN_IF_ERROR(sink(down.data_ptr<float>(), down.numel() * sizeof(float)));
          }
          return absl::OkStatus();
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
