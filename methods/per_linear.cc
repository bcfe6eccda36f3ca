#include "methods/per_linear.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/quant/finetune.h"

namespace qcal::methods {
namespace {

class ScalarGrid final : public LinearRounding {
 public:
  ScalarGrid(std::string method, quant::ScalarQuantizeOptions options)
      : method_(std::move(method)), options_(std::move(options)) {}
  StatusOr<quant::QuantizedLinear> Round(int64_t layer, model::LinearKind kind, int64_t expert,
                                         const at::Tensor& weight, const at::Tensor& hessian,
                                         kernels::GpuBackend* gpu,
                                         const LinearProgressFn& /*progress*/) const override {
    // RTN and GPTQ take seconds per linear even at 70B shapes: no notes.
    QCAL_ASSIGN_OR_RETURN(quant::LinearProblem p,
                          quant::PrepareLinear(layer, kind, weight, hessian, method_.c_str(),
                                               /*needs_hessian=*/options_.gptq, expert));
    quant::ScalarQuantizeOptions options = options_;
    options.gpu = gpu;
    return quant::FinishLinear(
        p, quant::QuantizeScalarLinear(options, p.weight(), p.out, p.in, p.hessian()));
  }

 private:
  const std::string method_;
  const quant::ScalarQuantizeOptions options_;
};

// The notes of one linear's rounding as the block's progress: "rounding <linear>: <note>" at the
// count of linears done so far, at most one every `every`.
LinearProgressFn LinearNotes(const BlockInputs& in, int64_t done, int64_t steps,
                             std::string linear, std::chrono::milliseconds every) {
  if (!in.progress) return nullptr;
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(
      std::chrono::steady_clock::now());
  return [&in, done, steps, linear = std::move(linear), last, every](const std::string& note) {
    const auto now = std::chrono::steady_clock::now();
    if (now - *last < every) return;
    *last = now;
    ReportBlockStep(in, done, steps, absl::StrCat("rounding ", linear, ": ", note));
  };
}

}  // namespace

StatusOr<at::Tensor> ExpertHessian(calib::BlockHessians* hessians, int64_t layer, int64_t expert,
                                   calib::ExpertInput input) {
  if (hessians == nullptr) return at::Tensor();
  at::Tensor mean = hessians->ExpertMean(expert, input);
  if (expert < static_cast<int64_t>(hessians->experts.size())) {
    hessians->experts[expert].at(input).ReleasePacked();
  }
  if (!mean.defined()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, " expert ", expert, ": the calibration has no ",
        calib::ExpertInputName(input), " Hessian for it"));
  }
  if (mean.abs().max().item<double>() == 0.0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, " expert ", expert, ": no calibration token reached it, so its ",
        calib::ExpertInputName(input), " Hessian is zero; set calibration.moe_min_tokens above 0 "
        "(every token for a starved expert) or calibration.moe_route_all: true"));
  }
  return mean;
}

std::shared_ptr<const LinearRounding> ScalarGridRounding(std::string method,
                                                         quant::ScalarQuantizeOptions options) {
  return std::make_shared<ScalarGrid>(std::move(method), std::move(options));
}

PerLinearQuantizer::PerLinearQuantizer(LlamaConfig config, bool finetune,
                                       quant::FinetuneOptions options,
                                       std::shared_ptr<const LinearRounding> rounding)
    : config_(std::move(config)),
      finetune_(finetune),
      options_(std::move(options)),
      rounding_(std::move(rounding)) {}

StatusOr<quant::BlockTaskResult> PerLinearQuantizer::QuantizeBlock(
    model::BlockWeights float_weights, const BlockInputs& in) const {
  const model::MoeWeights* moe = float_weights.moe.get();
  const int64_t experts = moe ? static_cast<int64_t>(moe->experts.size()) : 0;
  // A part of a block split over tasks: its dense weights, its experts [first, last).
  const int64_t first = in.expert_begin;
  const int64_t last = in.expert_end < 0 ? experts : in.expert_end;
  const bool whole = in.dense && first == 0 && last == experts;
  if (first < 0 || first > last || last > experts) {
    return absl::InvalidArgumentError(absl::StrCat("block ", in.layer, ": experts [", first, ", ",
                                                   last, ") out of range [0, ", experts, ")"));
  }
  if (finetune_ && !whole) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", in.layer, ": within-block fine-tuning tunes the whole block; it cannot run on "
        "a part of it"));
  }
  if (finetune_) return QuantizeWithFinetune(std::move(float_weights), in);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t layer = in.layer;
  quant::BlockTaskResult result;
  result.layer = layer;
  result.weights.layer = float_weights.layer;
  if (in.dense) {
    result.weights.input_norm = float_weights.input_norm.clone();
    result.weights.post_norm = float_weights.post_norm.clone();
  }
  // The dense linears the block has (a Mixtral MoE block has no dense MLP), then each routed
  // expert's gate, up and down_proj.
  int64_t steps = 3 * (last - first);
  for (model::LinearKind kind : model::kAllLinears) {
    steps += in.dense && float_weights.has(kind) ? 1 : 0;
  }
  int64_t done = 0;
  // Rounds one linear; its float weights are released as soon as it is rounded (at a 70B shape
  // the others' fp32 weights, 2.5 GB, would otherwise sit beside down_proj's Hessian and GPTQ's
  // work matrices).
  auto round = [&](model::LinearKind kind, int64_t expert, std::unique_ptr<model::Linear>& weight,
                   const at::Tensor& h) -> StatusOr<std::unique_ptr<model::Linear>> {
    const std::string name = quant::LinearProblemName(kind, expert);
    QCAL_ASSIGN_OR_RETURN(quant::QuantizedLinear q,
                          rounding_->Round(layer, kind, expert, weight->DenseWeight(), h, in.gpu,
                                           LinearNotes(in, done, steps, name, note_every_)));
    result.linears.push_back(q.metrics);
    weight.reset();
    ReportBlockStep(in, ++done, steps, name);
    return std::move(q.layer);
  };
  calib::HessianMeans means(in.hessians);  // consumes the accumulators kind by kind
  for (model::LinearKind kind : model::kAllLinears) {
    if (!in.dense || !float_weights.has(kind)) continue;
    const int i = static_cast<int>(kind);
    QCAL_ASSIGN_OR_RETURN(result.weights.linears[i],
                          round(kind, -1, float_weights.linears[i], means.For(kind)));
  }
  if (moe != nullptr) {
    result.weights.moe = std::make_unique<model::MoeWeights>();
    if (in.dense) result.weights.moe->router = moe->router.clone();  // kept in float
    result.weights.moe->experts.resize(experts);
    for (int64_t e = first; e < last; ++e) {
      auto& from = float_weights.moe->experts[e].linears;
      auto& to = result.weights.moe->experts[e].linears;
      for (calib::ExpertInput input : calib::kExpertInputs) {
        QCAL_ASSIGN_OR_RETURN(const at::Tensor h,
                              ExpertHessian(in.hessians, layer, e, input));
        const bool gate_up = input == calib::ExpertInput::kGateUp;
        for (model::ExpertLinear k : model::kExpertLinears) {
          if ((k != model::ExpertLinear::kDown) != gate_up) continue;
          const int i = static_cast<int>(k);
          QCAL_ASSIGN_OR_RETURN(to[i], round(model::ExpertLinearKind(k), e, from[i], h));
        }
      }
    }
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// QuIP# Algorithm 5 within the block: the groups rounded in order, the block tuned after each.
// A MoE block's routed experts are rounded in their groups (each with its own Hessian: its
// gate_up input for gate and up, its down input for down), after the block's dense linears.
StatusOr<quant::BlockTaskResult> PerLinearQuantizer::QuantizeWithFinetune(
    model::BlockWeights float_weights, const BlockInputs& in) const {
  const int64_t layer = in.layer;
  // Each linear's Hessian: a dense linear's kind, or a routed expert's own, made once (its
  // in-memory sums released then: ExpertHessian) and kept for the block's rounds (the baseline
  // rounds the later groups first): a MoE block's fine-tuning holds every expert's means.
  std::map<std::pair<int64_t, int>, at::Tensor> expert_means;
  auto hessian_of = [&](const quant::TunedLinear& l) -> StatusOr<at::Tensor> {
    if (in.hessians == nullptr) return at::Tensor();
    if (l.expert < 0) return in.hessians->Mean(calib::HessianKindOf(l.kind));
    const calib::ExpertInput input = l.kind == model::LinearKind::kDown
                                         ? calib::ExpertInput::kDown
                                         : calib::ExpertInput::kGateUp;
    const std::pair<int64_t, int> key{l.expert, static_cast<int>(input)};
    auto it = expert_means.find(key);
    if (it != expert_means.end()) return it->second;
    QCAL_ASSIGN_OR_RETURN(at::Tensor h, ExpertHessian(in.hessians, layer, l.expert, input));
    expert_means[key] = h;
    return h;
  };
  auto name_of = [](const quant::TunedLinear& l) {
    return quant::LinearProblemName(l.kind, l.expert);
  };
  quant::FinetuneOptions options = options_;
  options.device = in.device;
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<quant::BlockTuner> tuner,
                        quant::BlockTuner::Start(options, config_, layer, float_weights,
                                                 *in.rope, *in.ft_inputs, *in.ft_targets));
  const size_t groups = quant::BlockTuner::Groups().size();
  // Steps: each linear rounded, the no-FT baseline, each group's tuning.
  int64_t steps = static_cast<int64_t>(1 + groups);
  for (size_t g = 0; g < groups; ++g) steps += tuner->GroupLinears(g).size();
  int64_t done = 0;
  for (size_t g = 0; g < groups; ++g) {
    std::string group;
    const std::vector<quant::TunedLinear> linears = tuner->GroupLinears(g);
    for (const quant::TunedLinear& l : linears) {
      QCAL_ASSIGN_OR_RETURN(const at::Tensor h, hessian_of(l));
      QCAL_ASSIGN_OR_RETURN(quant::QuantizedLinear q,
                            rounding_->Round(layer, l.kind, l.expert,
                                             tuner->Weight(l).to(at::kCPU), h, in.gpu,
                                             LinearNotes(in, done, steps, name_of(l),
                                                         note_every_)));
      QCAL_RETURN_IF_ERROR(tuner->Install(l, std::move(q)));
      ReportBlockStep(in, ++done, steps, name_of(l));
      if (l.expert < 0) group += group.empty() ? name_of(l) : ", " + name_of(l);
    }
    if (linears.size() > 0 && linears.back().expert >= 0) {
      absl::StrAppend(&group, group.empty() ? "" : ", ", "the routed experts' ",
                      g + 1 == groups ? "down_proj" : "gate_proj and up_proj");
    }
    if (g == 0) {
      // The no-FT baseline: every other linear rounded from the float weights.
      std::vector<std::pair<quant::TunedLinear, std::unique_ptr<model::Linear>>> others;
      for (size_t later = 1; later < groups; ++later) {
        for (const quant::TunedLinear& l : tuner->GroupLinears(later)) {
          const model::Linear& w =
              l.expert < 0 ? float_weights.linear(l.kind)
                           : float_weights.moe->experts[l.expert].linear(
                                 quant::ExpertRoleOf(l.kind));
          QCAL_ASSIGN_OR_RETURN(const at::Tensor h, hessian_of(l));
          QCAL_ASSIGN_OR_RETURN(
              quant::QuantizedLinear q,
              rounding_->Round(layer, l.kind, l.expert, w.DenseWeight(), h, in.gpu,
                               LinearNotes(in, done, steps, name_of(l), note_every_)));
          others.emplace_back(l, std::move(q.layer));
        }
      }
      QCAL_RETURN_IF_ERROR(tuner->MeasureBaseline(std::move(others)));
      ReportBlockStep(in, ++done, steps, "the baseline without fine-tuning");
    }
    QCAL_RETURN_IF_ERROR(tuner->TuneGroup(g));
    ReportBlockStep(in, ++done, steps, "fine-tuning after " + group);
  }
  return tuner->Finish();
}

StatusOr<std::unique_ptr<Method>> MakePerLinearMethod(
    const Recipe& recipe, const LlamaConfig& config, std::shared_ptr<const LinearRounding> rounding,
    std::shared_ptr<const LayerFormats> formats, double tunable_lr_multiplier) {
  quant::FinetuneOptions block;
  block.stage = recipe.finetune.block;
  block.seed = recipe.seed;
  block.sign_lr_multiplier = tunable_lr_multiplier;
  Method::Parts parts;
  parts.quantizer = std::make_shared<PerLinearQuantizer>(config, recipe.finetune.enabled, block,
                                                         std::move(rounding));
  parts.layer_formats = std::move(formats);
  parts.tunable_lr_multiplier = tunable_lr_multiplier;
  return Method::Create(recipe, config, std::move(parts));
}

}  // namespace qcal::methods
