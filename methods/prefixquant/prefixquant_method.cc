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
#include "methods/rotated_block.h"

namespace qcal::methods::prefixquant {
namespace {

// PrefixQuant's parts (they share the recipe's settings, the rotation plan and, once the
// prefix phase has run, its products).
class PrefixquantParts final : public ModelTransform,
                               public BlockQuantizer,
                               public SequentialForward,
                               public BlockFormat,
                               public Inference {
 public:
  PrefixquantParts(Recipe recipe, LlamaConfig config, const PrefixquantConfig* q,
                   qsim::RotationPlan plan, const PhaseProducts* prefix)
      : recipe_(std::move(recipe)),
        config_(config),
        q_(q),
        plan_(std::move(plan)),
        has_prefix_(prefix != nullptr),
        prefix_(prefix ? *prefix : PhaseProducts()),
        standard_(std::move(config), std::make_shared<LayerFormats>(), "scalar") {}

  // --- ModelTransform: QuaRot's rotations
  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override {
    return Annotate(RotateAndMarkBlock(*weights, config_, plan_, layer),
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

  // --- BlockQuantizer
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& in) const override {
    QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const model::PrefixKv> prefix, PrefixOf(in.layer));
    return QuantizePrefixquantBlock(std::move(float_weights), config_, *in.rope, *q_, plan_,
                                    std::move(prefix), in.layer, in.x, in.x_float, in.batch,
                                    in.propagate, in.progress);
  }

  // --- SequentialForward
  int64_t DroppedCalibrationPositions() const override {
    // The prefix ends with BOS (qsim::PrefixTokens), which replaces each sequence's own.
    return q_->prefix ? 1 : 0;
  }
  StatusOr<at::Tensor> PropagateFloatBlock(model::BlockWeights prepared, int64_t layer,
                                           const at::Tensor& x, const model::Rope& rope,
                                           int64_t batch) const override {
    QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const model::PrefixKv> prefix, PrefixOf(layer));
    return FloatBlockForward(std::move(prepared), config_, rope, plan_, std::move(prefix), layer,
                             x, batch);
  }
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                              const at::Tensor& x, const model::Rope& rope,
                                              int64_t batch) const override {
    model::DecoderBlock block(config_, std::move(weights));
    QCAL_RETURN_IF_ERROR(InstallStaticInference(block, config_, *q_, plan_, layer));
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

  // --- BlockFormat: the standard tensors (each linear's stored layer), then the steps and the
  // prefix.
  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override {
    QCAL_RETURN_IF_ERROR(standard_.AppendBlockTensors(layer, weights, writer));
    return AppendPrefixquantExtras(layer, weights, writer);
  }
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, standard_.LoadBlock(ckpt, layer));
    QCAL_RETURN_IF_ERROR(LoadPrefixquantExtras(ckpt, config_, layer, &w));
    const bool planned[4] = {plan_.r1, plan_.r2, plan_.r3, plan_.r4};
    auto applied = w.extra.find(kRotationsKey);
    if (applied == w.extra.end()) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": block ", layer, " has no ",
                                                     kRotationsKey,
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

  // --- Inference
  Status Install(model::DecoderBlock* block, int64_t layer) const override {
    return InstallStaticInference(*block, config_, *q_, plan_, layer);
  }
  StatusOr<ServedForward> Served() const override {
    ServedForward served;
    served.online = {{"static activation and KV quantization"}, {"online Hadamards"}};
    if (q_->prefix) served.online.push_back({"a prefixed KV cache"});
    return served;
  }

 private:
  // Block `layer`'s prefix (null without one). FailedPrecondition before the prefix phase ran.
  StatusOr<std::shared_ptr<const model::PrefixKv>> PrefixOf(int64_t layer) const {
    if (!q_->prefix) return std::shared_ptr<const model::PrefixKv>();
    if (!has_prefix_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no products of the prefix phase (run calibration first)"));
    }
    return PrefixOfLayer(prefix_, config_, layer);
  }

  const Recipe recipe_;
  const LlamaConfig config_;
  const PrefixquantConfig* q_;  // owned by the recipe (shared, immutable)
  const qsim::RotationPlan plan_;
  const bool has_prefix_;
  const PhaseProducts prefix_;
  const StandardBlockFormat standard_;
};

// The global phase "prefix": the outlier-token prefix searched on the rotated float model.
class PrefixPhase final : public GlobalPhase {
 public:
  PrefixPhase(std::shared_ptr<const ModelTransform> transform, const PrefixquantConfig* q,
              qsim::RotationPlan plan)
      : transform_(std::move(transform)), q_(q), plan_(std::move(plan)) {}
  StatusOr<PhaseResult> Run(const GlobalPhaseInputs& in) const override {
    PhaseResult out;  // the search trains nothing: no curve
    QCAL_ASSIGN_OR_RETURN(out.products, RunPrefixSearch(*transform_, *q_, plan_, in));
    return out;
  }

 private:
  const std::shared_ptr<const ModelTransform> transform_;
  const PrefixquantConfig* q_;
  const qsim::RotationPlan plan_;
};

}  // namespace

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products) {
  const auto* q = dynamic_cast<const PrefixquantConfig*>(recipe.config.get());
  if (q == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' has method ",
                                                   recipe.method, ", not prefixquant"));
  }
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(q->rotation, config));
  QCAL_LOG_INFO("PrefixQuant '{}': rotations {}, W{}A{}KV{} static{}", recipe.name,
                plan.Describe(), q->bits, q->act_bits, q->kv_bits,
                q->prefix ? ", outlier-token prefix" : "");
  auto found = products.find(kPrefixPhase);
  auto parts = std::make_shared<PrefixquantParts>(
      recipe, config, q, plan, found == products.end() ? nullptr : &found->second);
  Method::Parts p = PartsOf(parts);
  if (q->prefix) p.phases[kPrefixPhase] = std::make_shared<PrefixPhase>(parts, q, std::move(plan));
  return Method::Create(recipe, config, std::move(p));
}

}  // namespace qcal::methods::prefixquant
