#include "methods/per_linear.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/quant/finetune.h"

namespace qcal::methods {
namespace {

class ScalarGrid final : public LinearRounding {
 public:
  ScalarGrid(std::string method, quant::ScalarQuantizeOptions options)
      : method_(std::move(method)), options_(std::move(options)) {}
  StatusOr<quant::QuantizedLinear> Round(int64_t layer, model::LinearKind kind,
                                         const at::Tensor& weight, const at::Tensor& hessian,
                                         kernels::GpuBackend* gpu,
                                         const LinearProgressFn& /*progress*/) const override {
    // RTN and GPTQ take seconds per linear even at 70B shapes: no notes.
    QCAL_ASSIGN_OR_RETURN(quant::LinearProblem p,
                          quant::PrepareLinear(layer, kind, weight, hessian, method_.c_str(),
                                               /*needs_hessian=*/options_.gptq));
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
                             model::LinearKind kind, std::chrono::milliseconds every) {
  if (!in.progress) return nullptr;
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(
      std::chrono::steady_clock::now());
  return [&in, done, steps, kind, last, every](const std::string& note) {
    const auto now = std::chrono::steady_clock::now();
    if (now - *last < every) return;
    *last = now;
    ReportBlockStep(in, done, steps,
                    absl::StrCat("rounding ", model::LinearName(kind), ": ", note));
  };
}

}  // namespace

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
  if (finetune_) return QuantizeWithFinetune(std::move(float_weights), in);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t layer = in.layer;
  quant::BlockTaskResult result;
  result.layer = layer;
  result.weights.input_norm = float_weights.input_norm.clone();
  result.weights.post_norm = float_weights.post_norm.clone();
  calib::HessianMeans means(in.hessians);  // consumes the accumulators kind by kind
  const int64_t steps = static_cast<int64_t>(std::size(model::kAllLinears));
  int64_t done = 0;
  for (model::LinearKind kind : model::kAllLinears) {
    const at::Tensor h = means.For(kind);
    QCAL_ASSIGN_OR_RETURN(quant::QuantizedLinear q,
                          rounding_->Round(layer, kind, float_weights.linear(kind).DenseWeight(),
                                           h, in.gpu,
                                           LinearNotes(in, done, steps, kind, note_every_)));
    result.weights.linears[static_cast<int>(kind)] = std::move(q.layer);
    result.linears.push_back(q.metrics);
    // The float linear is done with: at a 70B shape the others' fp32 weights (2.5 GB) would
    // otherwise sit beside down_proj's Hessian and GPTQ's work matrices.
    float_weights.linears[static_cast<int>(kind)].reset();
    ReportBlockStep(in, ++done, steps, model::LinearName(kind));
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// QuIP# Algorithm 5 within the block: the groups rounded in order, the block tuned after each.
StatusOr<quant::BlockTaskResult> PerLinearQuantizer::QuantizeWithFinetune(
    model::BlockWeights float_weights, const BlockInputs& in) const {
  const int64_t layer = in.layer;
  auto hessian_of = [&](model::LinearKind k) {
    return in.hessians ? in.hessians->Mean(calib::HessianKindOf(k)) : at::Tensor();
  };
  quant::FinetuneOptions options = options_;
  options.device = in.device;
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<quant::BlockTuner> tuner,
                        quant::BlockTuner::Start(options, config_, layer, float_weights,
                                                 *in.rope, *in.ft_inputs, *in.ft_targets));
  const auto& groups = quant::BlockTuner::Groups();
  // Steps: each linear rounded, the no-FT baseline, each group's tuning.
  const int64_t steps = static_cast<int64_t>(std::size(model::kAllLinears) + 1 + groups.size());
  int64_t done = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::string group;
    for (model::LinearKind k : groups[g]) {
      QCAL_ASSIGN_OR_RETURN(quant::QuantizedLinear q,
                            rounding_->Round(layer, k, tuner->Weight(k).to(at::kCPU),
                                             hessian_of(k), in.gpu,
                                             LinearNotes(in, done, steps, k, note_every_)));
      QCAL_RETURN_IF_ERROR(tuner->Install(k, std::move(q)));
      ReportBlockStep(in, ++done, steps, model::LinearName(k));
      group += group.empty() ? model::LinearName(k) : std::string(", ") + model::LinearName(k);
    }
    if (g == 0) {
      // The no-FT baseline: every other linear rounded from the float weights.
      std::vector<std::unique_ptr<model::Linear>> others(7);
      for (model::LinearKind k : model::kAllLinears) {
        if (std::find(groups[0].begin(), groups[0].end(), k) != groups[0].end()) continue;
        QCAL_ASSIGN_OR_RETURN(
            quant::QuantizedLinear q,
            rounding_->Round(layer, k, float_weights.linear(k).DenseWeight(), hessian_of(k),
                             in.gpu, LinearNotes(in, done, steps, k, note_every_)));
        others[static_cast<int>(k)] = std::move(q.layer);
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
