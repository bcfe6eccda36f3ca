#include "methods/quip/quip_method.h"

#include "absl/strings/str_cat.h"
#include "common/seed.h"
#include "methods/quip/quip_linear.h"
#include "methods/quip/quip_rounding.h"
#include "methods/quip/quip_spec.h"

namespace qcal::methods::quip {
namespace {

class QuipMethod final : public PerLinearMethod {
 public:
  QuipMethod(Recipe recipe, LlamaConfig config)
      : PerLinearMethod(std::move(recipe), std::move(config)),
        q_(this->recipe().method_config<QuipConfig>()) {}

  StatusOr<quant::QuantizedLinear> QuantizeLinear(int64_t layer, model::LinearKind kind,
                                                  const at::Tensor& weight,
                                                  const at::Tensor& hessian) const override {
    return quant::RoundLinear(
        layer, kind, weight, hessian, "quip", /*needs_hessian=*/true,
        [&](const double* w, int64_t out, int64_t in,
            double* h) -> StatusOr<quant::QuantizedLinear> {
          QuipRoundingOptions options;
          options.codebook = q_.codebook;
          options.incoherence = q_.incoherence;
          options.seed_u = TransformSeed(recipe().seed, layer, kind, true);
          options.seed_v = TransformSeed(recipe().seed, layer, kind, false);
          options.damp = q_.damp;
          options.per_row_scale = q_.scale_mode == "row";
          options.choose_scale = q_.scale_mode == "auto";
          options.refine_sweeps = q_.refine_sweeps;
          QCAL_ASSIGN_OR_RETURN(QuipRounding rounded, RoundQuipLinear(w, out, in, h, options));
          quant::QuantizedLinear result;
          result.metrics.proxy_loss = rounded.proxy_loss;
          result.metrics.relative = rounded.relative;
          result.metrics.code_bits = rounded.code_bits;
          QCAL_ASSIGN_OR_RETURN(auto linear, QuipLinear::Create(std::move(rounded.data)));
          SafetensorsWriter sizer;
          QCAL_RETURN_IF_ERROR(linear->AppendTensors("x", &sizer));
          result.metrics.stored_bits = 8.0 * sizer.data_bytes() / static_cast<double>(out * in);
          result.layer = std::move(linear);
          return result;
        });
  }

 protected:
  double SignLrMultiplier() const override {
    return q_.bits <= 2 ? quant::kSignLrMultiplier : 1.0;
  }
  StatusOr<bool> AppendOwnFormat(const model::Linear& linear, const std::string& prefix,
                                 SafetensorsWriter* writer) const override {
    const auto* q = dynamic_cast<const QuipLinear*>(&linear);
    if (q == nullptr) return false;
    QCAL_RETURN_IF_ERROR(q->AppendTensors(prefix, writer));
    return true;
  }
  StatusOr<std::unique_ptr<model::Linear>> LoadOwnFormat(CheckpointReader& ckpt,
                                                         const std::string& prefix) const override {
    QCAL_ASSIGN_OR_RETURN(auto layer, QuipLinear::Load(ckpt, prefix, q_.codebook, q_.incoherence));
    return std::unique_ptr<model::Linear>(std::move(layer));
  }

 private:
  const QuipConfig& q_;
};

}  // namespace

uint64_t TransformSeed(uint64_t recipe_seed, int64_t layer, model::LinearKind linear,
                       bool output) {
  uint64_t x = SplitMix64(recipe_seed);
  x = SplitMix64(x ^ static_cast<uint64_t>(layer));
  x = SplitMix64(x ^ static_cast<uint64_t>(linear));
  return SplitMix64(x ^ (output ? 1u : 2u));
}

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config) {
  if (dynamic_cast<const QuipConfig*>(recipe.config.get()) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' is not a quip one"));
  }
  return std::unique_ptr<Method>(std::make_unique<QuipMethod>(recipe, config));
}

}  // namespace qcal::methods::quip
