#include "methods/prefixquant/prefixquant_method.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "methods/prefixquant/prefix_search.h"
#include "methods/prefixquant/prefixquant_block.h"
#include "methods/prefixquant/prefixquant_spec.h"
#include "methods/prefixquant/static_quant.h"
#include "engine/model/tensor_io.h"
#include "engine/qsim/rotate.h"

namespace qcal::methods::prefixquant {
namespace {

class PrefixquantMethod final : public Method {
 public:
  PrefixquantMethod(Recipe recipe, LlamaConfig config, const PrefixquantConfig* q,
                    qsim::RotationPlan plan)
      : Method(std::move(recipe), std::move(config)), q_(q), plan_(std::move(plan)) {}

  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override {
    return Annotate(qsim::RotateBlockWeights(*weights, config(), plan_, layer),
                    absl::StrCat("block ", layer));
  }
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override {
    return qsim::RotateEmbeddingRows(rows, plan_);
  }
  at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const override {
    return qsim::FusedFinalNorm(final_norm, plan_);
  }
  StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                       const at::Tensor& final_norm) const override {
    return qsim::RotateHeadRows(rows, final_norm, plan_);
  }

  StatusOr<PhaseProducts> RunGlobalPhase(const std::string& phase,
                                         const GlobalPhaseInputs& in) const override {
    if (phase != kPrefixPhase || !q_->prefix) return Method::RunGlobalPhase(phase, in);
    return RunPrefixSearch(*this, *q_, plan_, in);
  }
  int64_t DroppedCalibrationPositions() const override {
    // The prefix ends with BOS (qsim::PrefixTokens), which replaces each sequence's own.
    return q_->prefix ? 1 : 0;
  }

  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& in) const override {
    if (in.rope == nullptr) {
      return absl::InvalidArgumentError("prefixquant block task: no RoPE tables");
    }
    std::shared_ptr<const model::PrefixKv> prefix;
    if (q_->prefix) {
      if (in.phases == nullptr || in.phases->count(kPrefixPhase) == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "block ", in.layer, ": no products of the prefix phase (run calibration first)"));
      }
      QCAL_ASSIGN_OR_RETURN(prefix, PrefixOfLayer(in.phases->at(kPrefixPhase), config(), in.layer));
    }
    return QuantizePrefixquantBlock(std::move(float_weights), config(), *in.rope, *q_, plan_,
                                    std::move(prefix), in.layer, in.x, in.x_float, in.batch,
                                    in.propagate);
  }
  StatusOr<at::Tensor> PropagateFloatBlock(
      model::BlockWeights prepared, int64_t layer, const at::Tensor& x, const model::Rope& rope,
      int64_t batch, const std::map<std::string, PhaseProducts>* phases) const override {
    std::shared_ptr<const model::PrefixKv> prefix;
    if (q_->prefix) {
      if (phases == nullptr || phases->count(kPrefixPhase) == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("block ", layer, ": no products of the prefix phase"));
      }
      QCAL_ASSIGN_OR_RETURN(prefix, PrefixOfLayer(phases->at(kPrefixPhase), config(), layer));
    }
    return FloatBlockForward(std::move(prepared), config(), rope, plan_, std::move(prefix), layer,
                             x, batch);
  }

  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override {
    // Norms and each linear's innermost layer (scalar format, or dense for float weights) as
    // every method writes them, then the steps and the prefix.
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "input_layernorm.weight",
                                             weights.input_norm));
    QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "post_attention_layernorm.weight",
                                             weights.post_norm));
    for (model::LinearKind k : model::kAllLinears) {
      QCAL_RETURN_IF_ERROR(
          AppendLinear(Innermost(weights.linear(k)), p + model::LinearName(k), writer));
    }
    return AppendPrefixquantExtras(layer, weights, writer);
  }
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, Method::LoadBlock(ckpt, layer));
    QCAL_RETURN_IF_ERROR(LoadPrefixquantExtras(ckpt, config(), layer, &w));
    const bool planned[4] = {plan_.r1, plan_.r2, plan_.r3, plan_.r4};
    auto applied = w.extra.find(qsim::kRotationsKey);
    if (applied == w.extra.end()) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": block ", layer, " has no ",
                                                     qsim::kRotationsKey,
                                                     " (not written by a rotation method)"));
    }
    for (int i = 0; i < 4; ++i) {
      if ((applied->second[i].item<double>() != 0) != planned[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(ckpt.dir(), ": block ", layer,
                         " was quantized with other rotations than the recipe plans (",
                         plan_.Describe(), ")"));
      }
    }
    return w;
  }
  Status InstallInference(model::DecoderBlock* block, int64_t layer) const override {
    return InstallStaticInference(*block, config(), *q_, plan_, layer);
  }
  Status CheckPlainForward() const override {
    return absl::FailedPreconditionError(absl::StrCat(
        "recipe '", recipe().name, "' (method prefixquant) computes static activation and KV "
        "quantization, online Hadamards", q_->prefix ? " and a prefixed KV cache" : "",
        " at inference time, which a plain Llama forward pass (and so this format) cannot "
        "express"));
  }
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                              const at::Tensor& x, const model::Rope& rope,
                                              int64_t batch) const override {
    model::DecoderBlock block(config(), std::move(weights));
    QCAL_RETURN_IF_ERROR(InstallStaticInference(block, config(), *q_, plan_, layer));
    at::NoGradGuard no_grad;
    try {
      std::vector<at::Tensor> outs;
      for (int64_t s = 0; s < x.size(0); s += batch) {
        outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
      }
      return at::cat(outs, 0);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("block ", layer, " forward: ", e.what()));
    }
  }

 private:
  const PrefixquantConfig* q_;  // owned by the recipe (shared, immutable)
  const qsim::RotationPlan plan_;
};

}  // namespace

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config) {
  const auto* q = dynamic_cast<const PrefixquantConfig*>(recipe.config.get());
  if (q == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' has method ",
                                                   recipe.method, ", not prefixquant"));
  }
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(q->rotation, config));
  QCAL_LOG_INFO("PrefixQuant '{}': rotations {}, W{}A{}KV{} static{}", recipe.name,
                plan.Describe(), q->bits, q->act_bits, q->kv_bits,
                q->prefix ? ", outlier-token prefix" : "");
  return std::unique_ptr<Method>(
      std::make_unique<PrefixquantMethod>(recipe, config, q, std::move(plan)));
}

}  // namespace qcal::methods::prefixquant
