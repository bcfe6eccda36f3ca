#include "methods/quip/quip_method.h"

#include "absl/strings/str_cat.h"
#include "common/seed.h"
#include "methods/quip/quip_linear.h"
#include "methods/quip/quip_rounding.h"
#include "methods/quip/quip_spec.h"
#include "methods/per_linear.h"

namespace qcal::methods::quip {
namespace {

// QuIP# F.6: 2-bit models tune the sign vectors su/sv with 10× the learning rate of everything
// else (within-block and end-to-end fine-tuning).
constexpr double kSignLrMultiplier = 10.0;

class QuipLinearRounding final : public LinearRounding {
 public:
  // `owner` keeps q alive (a rounding may outlive the recipe it came from).
  QuipLinearRounding(uint64_t seed, const QuipConfig& q, std::shared_ptr<const void> owner)
      : seed_(seed), q_(q), owner_(std::move(owner)) {}

  StatusOr<quant::QuantizedLinear> Round(int64_t layer, model::LinearKind kind, int64_t expert,
                                         const at::Tensor& weight, const at::Tensor& hessian,
                                         kernels::GpuBackend* gpu,
                                         const LinearProgressFn& progress) const override {
    QCAL_ASSIGN_OR_RETURN(quant::LinearProblem p,
                          quant::PrepareLinear(layer, kind, weight, hessian, "quip",
                                               /*needs_hessian=*/true, expert));
    return quant::FinishLinear(p, RoundProblem(p, gpu, progress));
  }

 private:
  StatusOr<quant::QuantizedLinear> RoundProblem(const quant::LinearProblem& p,
                                                kernels::GpuBackend* gpu,
                                                const LinearProgressFn& progress) const {
    QuipRoundingOptions options;
    options.gpu = gpu;
    if (progress) {
      options.progress = [&progress](int64_t rows_done, int64_t rows) {
        progress(absl::StrCat("BlockLDLQ rows ", rows_done, "/", rows));
      };
    }
    options.codebook = q_.kernel_codebook();
    options.incoherence = q_.incoherence;
    options.seed_u = TransformSeed(seed_, p.layer, p.kind, true, p.expert);
    options.seed_v = TransformSeed(seed_, p.layer, p.kind, false, p.expert);
    options.damp = q_.damp;
    options.per_row_scale = q_.scale_mode == "row";
    options.choose_scale = q_.scale_mode == "auto";
    options.refine_sweeps = q_.refine_sweeps;
    QCAL_ASSIGN_OR_RETURN(QuipRounding rounded,
                          RoundQuipLinear(p.weight(), p.out, p.in, p.hessian(), options));
    quant::QuantizedLinear result;
    result.metrics.proxy_loss = rounded.proxy_loss;
    result.metrics.relative = rounded.relative;
    result.metrics.code_bits = rounded.code_bits;
    result.metrics.transform_seconds = rounded.transform_seconds;
    result.metrics.factor_seconds = rounded.times.factor;
    result.metrics.round_seconds = rounded.times.round;
    result.metrics.refine_seconds = rounded.times.refine;
    result.metrics.proxy_seconds = rounded.proxy_seconds;
    QCAL_ASSIGN_OR_RETURN(auto linear, QuipLinear::Create(std::move(rounded.data)));
    SafetensorsWriter sizer;
    QCAL_RETURN_IF_ERROR(linear->AppendTensors("x", &sizer));
    result.metrics.stored_bits = 8.0 * sizer.data_bytes() / static_cast<double>(p.out * p.in);
    result.layer = std::move(linear);
    return result;
  }

  const uint64_t seed_;
  const QuipConfig& q_;  // owned by the recipe (shared, immutable)
  const std::shared_ptr<const void> owner_;
};

// The "quip" layer format (QuipLinear), read with the recipe's codebook and incoherence.
class QuipFormat final : public LayerFormat {
 public:
  explicit QuipFormat(const QuipConfig& q) : q_(q) {}
  const char* name() const override { return "quip"; }
  StatusOr<std::unique_ptr<model::Linear>> Load(CheckpointReader& ckpt,
                                                const std::string& prefix) const override {
    QCAL_ASSIGN_OR_RETURN(auto layer, QuipLinear::Load(ckpt, prefix, q_.kernel_codebook(), q_.incoherence));
    return std::unique_ptr<model::Linear>(std::move(layer));
  }

 private:
  const QuipConfig& q_;
};

}  // namespace

uint64_t TransformSeed(uint64_t recipe_seed, int64_t layer, model::LinearKind linear,
                       bool output, int64_t expert) {
  uint64_t x = SplitMix64(recipe_seed);
  x = SplitMix64(x ^ static_cast<uint64_t>(layer));
  x = SplitMix64(x ^ static_cast<uint64_t>(linear));
  // A dense linear's seed is what it always was; an expert's mixes its index in.
  if (expert >= 0) x = SplitMix64(x ^ (static_cast<uint64_t>(expert) + 0x100));
  return SplitMix64(x ^ (output ? 1u : 2u));
}

StatusOr<std::shared_ptr<const LinearRounding>> Rounding(const Recipe& recipe) {
  const auto* q = dynamic_cast<const QuipConfig*>(recipe.config.get());
  if (q == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' is not a quip one"));
  }
  return std::shared_ptr<const LinearRounding>(
      std::make_shared<QuipLinearRounding>(recipe.seed, *q, recipe.config));
}

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName&) {
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const LinearRounding> rounding, Rounding(recipe));
  const QuipConfig& q = recipe.method_config<QuipConfig>();
  auto formats = std::make_shared<LayerFormats>();
  formats->Add(std::make_shared<QuipFormat>(q));
  const double sign_lr = q.bits <= 2 ? kSignLrMultiplier : 1.0;
  return MakePerLinearMethod(recipe, config, std::move(rounding), std::move(formats), sign_lr);
}

}  // namespace qcal::methods::quip
