#include "methods/method.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/model/tensor_io.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::methods {

Method::Method(Recipe recipe, LlamaConfig config)
    : recipe_(std::move(recipe)), config_(std::move(config)) {}

nlohmann::json Method::QuantizationFields() const {
  nlohmann::json q = nlohmann::json::object();
  if (recipe_.config) recipe_.config->AddToQuantizationConfig(&q);
  return q;
}

Status Method::PrepareBlock(int64_t, model::BlockWeights*) const { return Status(); }
StatusOr<at::Tensor> Method::PrepareEmbeddingRows(const at::Tensor& rows) const { return rows; }
at::Tensor Method::PrepareFinalNorm(const at::Tensor& final_norm) const { return final_norm; }
StatusOr<at::Tensor> Method::PrepareHeadRows(const at::Tensor& rows, const at::Tensor&) const {
  return rows;
}

StatusOr<std::unique_ptr<Method>> Method::BindPhaseProducts(
    const std::map<std::string, PhaseProducts>&) const {
  return std::unique_ptr<Method>();
}

StatusOr<PhaseProducts> Method::RunGlobalPhase(const std::string& phase,
                                               const GlobalPhaseInputs&) const {
  return absl::UnimplementedError(
      absl::StrCat("method ", recipe_.method, " has no global phase '", phase, "'"));
}

Status Method::InstallInference(model::DecoderBlock*, int64_t) const { return Status(); }
Status Method::CheckPlainForward() const { return Status(); }

StatusOr<at::Tensor> Method::PropagateFloatBlock(model::BlockWeights, int64_t layer,
                                                 const at::Tensor&, const model::Rope&, int64_t,
                                                 const std::map<std::string, PhaseProducts>*) const {
  return absl::UnimplementedError(absl::StrCat("method ", recipe_.method,
                                               " does not propagate float blocks (block ", layer,
                                               ")"));
}

StatusOr<at::Tensor> Method::PropagateFinishedBlock(model::BlockWeights, int64_t layer,
                                                    const at::Tensor&, const model::Rope&,
                                                    int64_t) const {
  return absl::UnimplementedError(absl::StrCat("method ", recipe_.method,
                                               " does not propagate finished blocks (block ",
                                               layer, ")"));
}

StatusOr<bool> Method::AppendOwnFormat(const model::Linear&, const std::string&,
                                       SafetensorsWriter*) const {
  return false;
}

StatusOr<std::unique_ptr<model::Linear>> Method::LoadOwnFormat(CheckpointReader& ckpt,
                                                               const std::string& prefix) const {
  return absl::InvalidArgumentError(absl::StrCat(
      ckpt.dir(), ": ", prefix, ": method ", recipe_.method, " has no layer format of its own"));
}

Status Method::AppendLinear(const model::Linear& linear, const std::string& prefix,
                            SafetensorsWriter* writer) const {
  QCAL_ASSIGN_OR_RETURN(bool own, AppendOwnFormat(linear, prefix, writer));
  if (own) return Status();
  if (auto* s = dynamic_cast<const quant::ScalarQuantLinear*>(&linear)) {
    return s->AppendTensors(prefix, writer);
  }
  return model::AddF32Tensor(writer, prefix + ".weight", linear.DenseWeight());
}

StatusOr<std::unique_ptr<model::Linear>> Method::LoadLinear(CheckpointReader& ckpt,
                                                            const std::string& prefix) const {
  if (ckpt.Has(prefix + ".weight")) {
    // A linear left in float (e.g. by a partial recipe).
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(prefix + ".weight"));
    QCAL_ASSIGN_OR_RETURN(std::vector<float> data, ckpt.ReadF32(prefix + ".weight"));
    return std::unique_ptr<model::Linear>(std::make_unique<model::DenseLinear>(
        at::from_blob(data.data(), found.second->shape, at::kFloat).clone()));
  }
  const std::string format = QuantizationFields().value("format", "");
  if (format == "scalar") {
    QCAL_ASSIGN_OR_RETURN(auto layer, quant::ScalarQuantLinear::Load(ckpt, prefix));
    return std::unique_ptr<model::Linear>(std::move(layer));
  }
  return LoadOwnFormat(ckpt, prefix);
}

Status Method::AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                                  SafetensorsWriter* writer) const {
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "input_layernorm.weight",
                                           weights.input_norm));
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "post_attention_layernorm.weight",
                                           weights.post_norm));
  for (model::LinearKind k : model::kAllLinears) {
    QCAL_RETURN_IF_ERROR(AppendLinear(weights.linear(k), p + model::LinearName(k), writer));
  }
  return Status();
}

StatusOr<model::BlockWeights> Method::LoadBlock(CheckpointReader& ckpt, int64_t layer) const {
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  model::BlockWeights w;
  QCAL_ASSIGN_OR_RETURN(w.input_norm, model::LoadTensorF32(ckpt, p + "input_layernorm.weight",
                                                           {config_.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.post_norm,
                        model::LoadTensorF32(ckpt, p + "post_attention_layernorm.weight",
                                             {config_.hidden_size}));
  for (model::LinearKind k : model::kAllLinears) {
    const std::string name = p + model::LinearName(k);
    QCAL_ASSIGN_OR_RETURN(w.linears[static_cast<int>(k)], LoadLinear(ckpt, name));
    const model::Linear& l = w.linear(k);
    const std::vector<int64_t> shape = model::LinearShape(config_, k);
    if (l.out_features() != shape[0] || l.in_features() != shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.dir(), ": ", name, " is ", l.out_features(), "x", l.in_features(), ", expected ",
          shape[0], "x", shape[1], " from config.json"));
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------

quant::FinetuneOptions Method::FinetuneOptionsFor(const FinetuneStage& stage) const {
  quant::FinetuneOptions o;
  o.stage = stage;
  o.seed = recipe().seed;
  o.sign_lr_multiplier = SignLrMultiplier();
  return o;
}

StatusOr<quant::BlockTaskResult> PerLinearMethod::QuantizeBlock(model::BlockWeights float_weights,
                                                                const BlockInputs& in) const {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t layer = in.layer;
  if (needs().float_hessians && in.hessians == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": method ", recipe().method,
                                                   " needs Hessians"));
  }
  if (recipe().finetune.enabled) {
    if (in.ft_inputs == nullptr || in.ft_targets == nullptr || in.rope == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", layer, ": fine-tuning needs the block's float inputs and outputs"));
    }
    return quant::QuantizeBlockWithFinetune(
        FinetuneOptionsFor(recipe().finetune.block), config(), layer, float_weights, in.hessians,
        [&](model::LinearKind kind, const at::Tensor& w, const at::Tensor& h) {
          return QuantizeLinear(layer, kind, w, h);
        },
        *in.rope, *in.ft_inputs, *in.ft_targets);
  }
  quant::BlockTaskResult result;
  result.layer = layer;
  result.weights.input_norm = float_weights.input_norm.clone();
  result.weights.post_norm = float_weights.post_norm.clone();
  calib::HessianMeans means(in.hessians);  // consumes the accumulators kind by kind
  for (model::LinearKind kind : model::kAllLinears) {
    const at::Tensor h = means.For(kind);
    QCAL_ASSIGN_OR_RETURN(quant::QuantizedLinear q,
                          QuantizeLinear(layer, kind, float_weights.linear(kind).DenseWeight(), h));
    result.weights.linears[static_cast<int>(kind)] = std::move(q.layer);
    result.linears.push_back(q.metrics);
    // The float linear is done with: at a 70B shape the others' fp32 weights (2.5 GB) would
    // otherwise sit beside down_proj's Hessian and GPTQ's work matrices.
    float_weights.linears[static_cast<int>(kind)].reset();
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

ScalarGridMethod::ScalarGridMethod(Recipe recipe, LlamaConfig config,
                                   quant::ScalarQuantizeOptions options)
    : PerLinearMethod(std::move(recipe), std::move(config)), options_(std::move(options)) {}

StatusOr<quant::QuantizedLinear> ScalarGridMethod::QuantizeLinear(int64_t layer,
                                                                  model::LinearKind kind,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& hessian) const {
  return quant::RoundLinear(layer, kind, weight, hessian, recipe().method.c_str(),
                            /*needs_hessian=*/options_.gptq,
                            [&](const double* w, int64_t out, int64_t in, double* h) {
                              return quant::QuantizeScalarLinear(options_, w, out, in, h);
                            });
}

}  // namespace qcal::methods
