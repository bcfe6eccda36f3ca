#include "methods/spinquant/spinquant_method.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "methods/quarot/quarot_method.h"
#include "methods/spinquant/rotation_phase.h"
#include "methods/spinquant/spinquant_spec.h"
#include "engine/qsim/act_quant.h"
#include "engine/quant/scalar_quantize.h"
#include "engine/qsim/kv_quantizer.h"

namespace qcal::methods::spinquant {
namespace {

constexpr char kStateFile[] = "rotations.state.safetensors";

// The learned rotations' transform: the trained smoothing scales (training.smooth) fused into
// the float weights first (Q, K rows; up rows, down columns), then QuaRot's transform with the
// learned plan. Unbound (no products of the rotations phase yet), it refuses to prepare
// anything: it would silently use the Hadamards.
class SpinquantTransform final : public ModelTransform {
 public:
  SpinquantTransform(LlamaConfig config, std::shared_ptr<const ModelTransform> rotations,
                     bool bound, at::Tensor smooth)
      : config_(std::move(config)),
        rotations_(std::move(rotations)),
        bound_(bound),
        smooth_(std::move(smooth)) {}

  Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const override {
    QCAL_RETURN_IF_ERROR(CheckBound());
    if (smooth_.defined()) {
      QCAL_RETURN_IF_ERROR(Annotate(SmoothBlockWeights(config_, smooth_[layer], weights),
                                    absl::StrCat("spinquant: block ", layer)));
    }
    return rotations_->PrepareBlock(layer, weights);
  }
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override {
    QCAL_RETURN_IF_ERROR(CheckBound());
    return rotations_->PrepareEmbeddingRows(rows);
  }
  at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const override {
    return rotations_->PrepareFinalNorm(final_norm);
  }
  StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                       const at::Tensor& final_norm) const override {
    QCAL_RETURN_IF_ERROR(CheckBound());
    return rotations_->PrepareHeadRows(rows, final_norm);
  }

 private:
  Status CheckBound() const {
    if (bound_) return Status();
    return absl::FailedPreconditionError(
        "spinquant: the learned rotations are not bound (the rotations phase must run first)");
  }

  const LlamaConfig config_;
  const std::shared_ptr<const ModelTransform> rotations_;
  const bool bound_;
  const at::Tensor smooth_;  // [layers, SmoothingSize] float64 log-scales, or undefined
};

// The global phase "rotations": R1, R2 (and the smoothing scales) trained data-parallel.
class RotationsPhase final : public GlobalPhase {
 public:
  RotationsPhase(LlamaConfig config, const SpinquantConfig* s, qsim::RotationPlan plan)
      : config_(std::move(config)), s_(s), plan_(std::move(plan)) {}

  StatusOr<PhaseResult> Run(const GlobalPhaseInputs& in) const override {
    if (in.comm == nullptr || in.source == nullptr || in.tokens == nullptr) {
      return absl::InvalidArgumentError("rotations phase: missing inputs");
    }
    QCAL_ASSIGN_OR_RETURN(RotationPhaseOptions o, PhaseOptions(*s_, config_));
    // Fused float blocks and the head stay in memory while they fit half the rank's budget.
    o.cache_bytes = in.max_memory > 0 ? in.max_memory / 2 : int64_t{4} << 30;
    if (!in.state_dir.empty()) {
      QCAL_RETURN_IF_ERROR(MakeDirs(in.state_dir));
      o.state_path = absl::StrCat(in.state_dir, "/", kStateFile);
    }
    o.state_key = in.state_key;
    QCAL_ASSIGN_OR_RETURN(RotationPhaseResult r,
                          TrainRotationsDataParallel(*in.comm, in.source, plan_, *in.tokens, o));
    const size_t n = r.losses.size(), k = std::min<size_t>(10, n);
    double first = 0, last = 0;
    for (size_t i = 0; i < k; ++i) {
      first += r.losses[i] / k;
      last += r.losses[n - k + i] / k;
    }
    QCAL_LOG_INFO("rotations phase: {} steps; training loss, mean of the first / last {} steps: "
                  "{:.4f} / {:.4f}", n, k, first, last);
    PhaseResult out;
    out.products["r1"] = r.t1;
    out.products["r2"] = r.t2;
    if (r.smooth.defined()) out.products["smooth"] = r.smooth;
    // What the run did, for its record: the start (0 Hadamard, 1 identity) and the step whose
    // rotations these are. Its losses and held-out scores are its curve.
    out.products["identity_start"] =
        at::tensor({r.init == "identity" ? int64_t{1} : int64_t{0}});
    out.products["selected_step"] = at::tensor({r.selected_step});
    out.curve.losses = r.losses;
    out.curve.validation = r.validation;
    return out;
  }

  // A rotated weight [out, in] float32 rounded to nearest on the grid w (dequantized, float32).
  static std::function<StatusOr<at::Tensor>(const at::Tensor&)> WeightRounder(
      const quant::ScalarQuantizeOptions& w) {
    return [w](const at::Tensor& weight) -> StatusOr<at::Tensor> {
      at::Tensor d = weight.to(at::kDouble).contiguous().clone();
      QCAL_RETURN_IF_ERROR(
          quant::RoundToNearestInPlace(w, d.data_ptr<double>(), d.size(0), d.size(1)));
      return d.to(at::kFloat);
    };
  }

  // Training against the quantizers inference runs (dynamic versions of static ones: the
  // static ranges are calibrated only after the rotations exist).
  static StatusOr<RotationPhaseOptions> PhaseOptions(const SpinquantConfig& s,
                                                     const LlamaConfig& config) {
    RotationPhaseOptions o;
    if (s.training.weight_bits < 16) {
      quant::ScalarQuantizeOptions w;
      w.bits = s.training.weight_bits;
      w.grid = s.scalar;
      o.training.weight_quantizer = WeightRounder(w);
    }
    if (s.activations.enabled()) {
      ActivationQuantSpec a = s.activations;
      a.is_static = false;
      QCAL_ASSIGN_OR_RETURN(o.training.act_quantizer, qsim::ActivationQuantizer::Create(a));
    }
    if (s.kv_cache.enabled()) {
      KvCacheSpec k = s.kv_cache;
      k.is_static = false;
      if (k.granularity == "per_tensor") k.granularity = "per_token";
      QCAL_ASSIGN_OR_RETURN(o.training.kv_quantizer,
                            qsim::MakeKvQuantizer(k, config, 0, nullptr));
    }
    RotationTrainingOptions& t = o.training;
    t.steps = s.training.steps;
    t.lr = s.training.lr;
    t.batch = s.training.batch;
    t.grad_clip = s.training.grad_clip;
    t.weight_bits = s.training.weight_bits;
    t.act_bits = s.activations.enabled() ? s.activations.bits : 16;
    t.kv_bits = s.kv_cache.enabled() ? s.kv_cache.bits : 16;
    t.seed = s.rotation.seed;
    t.smooth = s.training.smooth;
    t.smooth_lr = s.training.smooth_lr;
    t.identity_init = s.training.init == "identity";
    o.choose_init = s.training.init == "best";
    t.loss = s.training.loss == "ce" ? RotationTrainingOptions::Loss::kCrossEntropy
                                     : RotationTrainingOptions::Loss::kKlToFloat;
    // The range gradient follows the inference quantizers' sets: per token (activations), per
    // group within a head (KV; a per-token KV cache keeps the identity gradient).
    t.range_gradient = s.training.range_gradient;
    t.weight_symmetric = s.scalar.symmetric;
    t.weight_group = s.scalar.group_size;
    if (s.kv_cache.enabled()) {
      t.kv_grid = qsim::FakeQuantGrid{s.kv_cache.bits, s.kv_cache.symmetric, s.kv_cache.clip};
      t.kv_group = s.kv_cache.group;
      t.kv_range_gradient = s.kv_cache.granularity == "per_group";
    }
    o.checkpoint_every = s.training.checkpoint_every;
    // The held-out score: the deployed model's quantizers, the weights at the recipe's bits on
    // its grid (RTN standing in for GPTQ, which would need every block's Hessians per score).
    o.validation = s.training.validation;
    o.validation_options = o.training;
    if (s.quantizes_weights() && s.bits < 16 && o.training.weight_bits >= 16) {
      quant::ScalarQuantizeOptions w;
      w.bits = s.bits;
      w.grid = s.scalar;
      o.validation_options.weight_bits = s.bits;
      o.validation_options.weight_quantizer = WeightRounder(w);
    }
    return o;
  }

 private:
  const LlamaConfig config_;
  const SpinquantConfig* s_;  // owned by the recipe (shared, immutable)
  const qsim::RotationPlan plan_;
};

// The learned plan and smoothing scales from the rotations phase's products (validated).
Status BindProducts(const PhaseProducts& products, const SpinquantConfig& s,
                    const LlamaConfig& config, qsim::RotationPlan* learned, at::Tensor* smooth) {
  if (!products.count("r1") || !products.count("r2")) {
    return absl::FailedPreconditionError(
        "spinquant: the rotations phase's products (r1, r2) are missing");
  }
  QCAL_RETURN_IF_ERROR(Annotate(
      qsim::SetLearnedRotations(learned, products.at("r1"), products.at("r2"),
                                config.num_hidden_layers),
      "spinquant: the trained rotations"));
  auto sm = products.find("smooth");
  if (s.training.smooth) {
    const int64_t layers = config.num_hidden_layers, n = SmoothingSize(config);
    if (sm == products.end() || sm->second.dim() != 2 || sm->second.size(0) != layers ||
        sm->second.size(1) != n) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spinquant: the rotations phase's smoothing scales are missing or not [", layers,
          ", ", n, "]"));
    }
    *smooth = sm->second.to(at::kDouble).contiguous();
  } else if (sm != products.end()) {
    return absl::FailedPreconditionError(
        "spinquant: the rotations phase has smoothing scales but the recipe trains none");
  }
  return Status();
}

}  // namespace

StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe, const LlamaConfig& config,
                                       const PhaseProductsByName& products) {
  const auto* s = dynamic_cast<const SpinquantConfig*>(recipe.config.get());
  if (s == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' has method ",
                                                   recipe.method, ", not spinquant"));
  }
  QCAL_ASSIGN_OR_RETURN(qsim::RotationPlan plan, qsim::PlanRotations(s->rotation, config));
  if (!plan.r1 || !plan.r2) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe '", recipe.name, "': spinquant needs R1 and R2, the plan has ",
                     plan.Describe()));
  }
  QCAL_RETURN_IF_ERROR(quarot::CheckRotatable(recipe, config, plan));
  QCAL_RETURN_IF_ERROR(
      Annotate(CheckTrainableModel(config), absl::StrCat("recipe '", recipe.name, "'")));
  auto phase = std::make_shared<RotationsPhase>(config, s, plan);
  auto trained = products.find(kRotationsPhase);
  const bool bound = trained != products.end();
  at::Tensor smooth;
  if (bound) {
    QCAL_RETURN_IF_ERROR(BindProducts(trained->second, *s, config, &plan, &smooth));
  } else {
    QCAL_LOG_INFO(
        "SpinQuant '{}': rotations {} (R1/R2 trained: {} steps, lr {}, W{} in training)",
        recipe.name, plan.Describe(), s->training.steps, s->training.lr,
        s->training.weight_bits);
  }
  // QuaRot's parts with the learned plan, behind the smoothing scales.
  Method::Parts parts = quarot::MakeQuarotParts(recipe, config, std::move(plan));
  parts.transform = std::make_shared<SpinquantTransform>(config, std::move(parts.transform),
                                                         bound, std::move(smooth));
  parts.phases[kRotationsPhase] = std::move(phase);
  return Method::Create(recipe, config, std::move(parts));
}

}  // namespace qcal::methods::spinquant
