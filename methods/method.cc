#include "methods/method.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/model/tensor_io.h"

namespace qcal::methods {
namespace {

class IdentityTransform final : public ModelTransform {
 public:
  Status PrepareBlock(int64_t, model::BlockWeights*) const override { return Status(); }
  StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const override {
    return rows;
  }
  at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const override { return final_norm; }
  StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows, const at::Tensor&) const override {
    return rows;
  }
};

class PlainInference final : public Inference {
 public:
  Status Install(model::DecoderBlock*, int64_t) const override { return Status(); }
  StatusOr<ServedForward> Served() const override { return ServedForward(); }
};

}  // namespace

Status CheckBlockInputs(const BlockInputs& in, const MethodNeeds& needs) {
  std::string missing;
  auto need = [&](bool wanted, bool present, const char* what) {
    if (wanted && !present) absl::StrAppend(&missing, missing.empty() ? "" : ", ", what);
  };
  need(true, in.rope != nullptr, "RoPE tables");
  need(needs.float_hessians, in.hessians != nullptr, "the float model's Hessians");
  need(needs.float_activations, in.ft_inputs != nullptr && in.ft_targets != nullptr,
       "the float block's inputs and outputs");
  need(needs.sequential, in.x != nullptr, "the calibration inputs");
  need(needs.sequential_float, in.x_float != nullptr, "the float model's inputs");
  if (missing.empty()) return Status();
  return absl::InvalidArgumentError(
      absl::StrCat("block ", in.layer, ": the block task has no ", missing));
}

StatusOr<at::Tensor> SequentialForward::PropagateFloatBlock(model::BlockWeights, int64_t layer,
                                                            const at::Tensor&,
                                                            const model::Rope&, int64_t) const {
  return absl::UnimplementedError(
      absl::StrCat("this method does not propagate float blocks (block ", layer, ")"));
}

StatusOr<StaticInputParams> Inference::StaticLinearInputParams(const model::BlockWeights&,
                                                              int64_t layer,
                                                              model::LinearKind kind) const {
  return absl::UnimplementedError(absl::StrCat("block ", layer, " ", model::LinearName(kind),
                                               ": this method has no static input quantizers"));
}

StatusOr<StaticKvScales> Inference::KvCacheScales(const model::BlockWeights&,
                                                  int64_t layer) const {
  return absl::UnimplementedError(
      absl::StrCat("block ", layer, ": this method has no static KV-cache scales"));
}

Status BlockFormat::AppendExpertTensors(int64_t layer, const model::MoeWeights&, int64_t,
                                        int64_t, SafetensorsWriter*) const {
  return absl::UnimplementedError(
      absl::StrCat("block ", layer, ": this block format cannot store a group of experts alone"));
}

Status BlockFormat::AppendBlockTensorsFromParts(int64_t layer, const model::BlockWeights&,
                                                const std::vector<StoredExperts>&,
                                                SafetensorsWriter*) const {
  return absl::UnimplementedError(
      absl::StrCat("block ", layer, ": this block format cannot assemble a block from parts"));
}

StandardBlockFormat::StandardBlockFormat(LlamaConfig config,
                                         std::shared_ptr<const LayerFormats> formats,
                                         std::string quantized)
    : config_(std::move(config)), formats_(std::move(formats)), quantized_(std::move(quantized)) {}

Status StandardBlockFormat::AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                                               SafetensorsWriter* writer) const {
  QCAL_RETURN_IF_ERROR(AppendBlockHead(layer, weights, writer));
  if (weights.moe == nullptr) return Status();
  return AppendExpertTensors(layer, *weights.moe, 0,
                             static_cast<int64_t>(weights.moe->experts.size()), writer);
}

Status StandardBlockFormat::AppendBlockHead(int64_t layer, const model::BlockWeights& weights,
                                            SafetensorsWriter* writer) const {
  const std::string p = config_.TensorName(absl::StrCat("model.layers.", layer, "."));
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "input_layernorm.weight",
                                           weights.input_norm));
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(writer, p + "post_attention_layernorm.weight",
                                           weights.post_norm));
  for (model::LinearKind k : model::kAllLinears) {
    if (!weights.has(k)) continue;  // a Mixtral MoE block's (absent) dense MLP
    QCAL_RETURN_IF_ERROR(
        formats_->Append(weights.linear(k), model::LinearTensorName(config_, layer, k), writer));
  }
  if (weights.moe == nullptr) return Status();
  return model::AddF32Tensor(writer, config_.RouterModule(layer) + ".weight", weights.moe->router);
}

namespace {

Status CheckExpertRange(const model::MoeWeights& moe, int64_t layer, int64_t begin,
                        int64_t end) {
  if (begin < 0 || begin > end || end > static_cast<int64_t>(moe.experts.size())) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": experts [", begin, ", ",
                                                   end, ") out of range [0, ",
                                                   moe.experts.size(), ")"));
  }
  return Status();
}

}  // namespace

Status StandardBlockFormat::AppendExpertTensors(int64_t layer, const model::MoeWeights& moe,
                                                int64_t begin, int64_t end,
                                                SafetensorsWriter* writer) const {
  QCAL_RETURN_IF_ERROR(CheckExpertRange(moe, layer, begin, end));
  for (int64_t e = begin; e < end; ++e) {
    for (model::ExpertLinear k : model::kExpertLinears) {
      if (moe.experts[e].linears[static_cast<int>(k)] == nullptr) {
        return absl::InternalError(absl::StrCat("block ", layer, " expert ", e,
                                                ": no quantized ", model::ExpertLinearName(e, k)));
      }
      QCAL_RETURN_IF_ERROR(formats_->Append(moe.experts[e].linear(k),
                                            model::ExpertTensorName(config_, layer, e, k), writer));
    }
  }
  return Status();
}

Status StandardBlockFormat::AppendBlockTensorsFromParts(int64_t layer,
                                                        const model::BlockWeights& weights,
                                                        const std::vector<StoredExperts>& groups,
                                                        SafetensorsWriter* writer) const {
  if (weights.moe == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " has no routed experts to assemble"));
  }
  QCAL_RETURN_IF_ERROR(AppendBlockHead(layer, weights, writer));
  int64_t next = 0;
  for (const StoredExperts& g : groups) {
    if (g.file == nullptr || g.begin != next || g.end <= g.begin ||
        g.end > static_cast<int64_t>(weights.moe->experts.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", layer, ": expert groups out of order at expert ", next));
    }
    // Every tensor of the part file, in the order its task wrote them (AppendExpertTensors:
    // expert by expert, gate, up, down), each under one of the group's expert linears, and each
    // of those with at least one.
    size_t t = 0;
    const std::vector<TensorInfo>& stored = g.file->tensors();
    for (int64_t e = g.begin; e < g.end; ++e) {
      for (model::ExpertLinear k : model::kExpertLinears) {
        const std::string prefix = model::ExpertTensorName(config_, layer, e, k) + ".";
        const size_t first = t;
        while (t < stored.size() && stored[t].name.rfind(prefix, 0) == 0) {
          QCAL_RETURN_IF_ERROR(AddCopiedTensor(writer, stored[t].name, *g.file, stored[t]));
          ++t;
        }
        if (t == first) {
          return absl::InvalidArgumentError(absl::StrCat(
              g.file->path(), ": no tensor of ", prefix, "* where expert ", e, "'s comes"));
        }
      }
    }
    if (t != stored.size()) {
      return absl::InvalidArgumentError(absl::StrCat(g.file->path(), ": tensor '", stored[t].name,
                                                     "' is none of experts [", g.begin, ", ",
                                                     g.end, ") of block ", layer));
    }
    next = g.end;
  }
  if (next != static_cast<int64_t>(weights.moe->experts.size())) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": the expert groups end at ",
                                                   next, " of ", weights.moe->experts.size()));
  }
  return Status();
}

namespace {

// Reads linear `name` and checks its [out, in] against `shape` (from config.json).
StatusOr<std::unique_ptr<model::Linear>> LoadLinearChecked(const LayerFormats& formats,
                                                           CheckpointReader& ckpt,
                                                           const std::string& name,
                                                           const std::string& quantized,
                                                           const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::Linear> l, formats.Load(ckpt, name, quantized));
  if (l->out_features() != shape[0] || l->in_features() != shape[1]) {
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": ", name, " is ", l->out_features(), "x", l->in_features(), ", expected ",
        shape[0], "x", shape[1], " from config.json"));
  }
  return l;
}

}  // namespace

StatusOr<model::BlockWeights> StandardBlockFormat::LoadBlock(CheckpointReader& ckpt,
                                                             int64_t layer) const {
  const std::string p = config_.TensorName(absl::StrCat("model.layers.", layer, "."));
  model::BlockWeights w;
  w.layer = layer;
  QCAL_ASSIGN_OR_RETURN(w.input_norm, model::LoadTensorF32(ckpt, p + "input_layernorm.weight",
                                                           {config_.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.post_norm,
                        model::LoadTensorF32(ckpt, p + "post_attention_layernorm.weight",
                                             {config_.hidden_size}));
  for (model::LinearKind k : model::kAllLinears) {
    if (!model::BlockHasLinear(config_, layer, k)) continue;  // Mixtral MoE: no dense MLP
    QCAL_ASSIGN_OR_RETURN(w.linears[static_cast<int>(k)],
                          LoadLinearChecked(*formats_, ckpt,
                                            model::LinearTensorName(config_, layer, k), quantized_,
                                            model::LinearShape(config_, k, layer)));
  }
  if (!config_.IsMoeLayer(layer)) return w;
  w.moe = std::make_unique<model::MoeWeights>();
  QCAL_ASSIGN_OR_RETURN(w.moe->router,
                        model::LoadTensorF32(ckpt, config_.RouterModule(layer) + ".weight",
                                             {config_.num_experts, config_.hidden_size}));
  w.moe->experts.resize(config_.num_experts);
  for (int64_t e = 0; e < config_.num_experts; ++e) {
    for (model::ExpertLinear k : model::kExpertLinears) {
      QCAL_ASSIGN_OR_RETURN(
          w.moe->experts[e].linears[static_cast<int>(k)],
          LoadLinearChecked(*formats_, ckpt, model::ExpertTensorName(config_, layer, e, k),
                            quantized_, model::LinearShape(config_, model::ExpertLinearKind(k))));
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------

namespace {

// The recipe's method fields of quantization_config.
nlohmann::json QuantizationFieldsOf(const Recipe& recipe) {
  nlohmann::json q = nlohmann::json::object();
  if (recipe.config) recipe.config->AddToQuantizationConfig(&q);
  return q;
}

}  // namespace

std::string QuantizedLayerFormat(const Recipe& recipe) {
  return QuantizationFieldsOf(recipe).value("format", "");
}

Method::Method(Recipe recipe, LlamaConfig config, Parts parts)
    : recipe_(std::move(recipe)), config_(std::move(config)), parts_(std::move(parts)) {}

StatusOr<std::unique_ptr<Method>> Method::Create(Recipe recipe, LlamaConfig config, Parts parts) {
  const MethodNeeds needs = recipe.needs();
  const std::string where = absl::StrCat("method ", recipe.method, " (recipe '", recipe.name, "')");
  if (parts.quantizer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no block quantizer"));
  }
  if (needs.sequential && parts.sequential == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": a sequential method without its sequential forward"));
  }
  for (const std::string& phase : needs.global_phases) {
    if (parts.phases.count(phase) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no part runs phase ", phase));
    }
  }
  if (parts.transform == nullptr) parts.transform = std::make_shared<IdentityTransform>();
  if (parts.layer_formats == nullptr) parts.layer_formats = std::make_shared<LayerFormats>();
  if (parts.block_format == nullptr) {
    parts.block_format = std::make_shared<StandardBlockFormat>(config, parts.layer_formats,
                                                               QuantizedLayerFormat(recipe));
  }
  if (parts.inference == nullptr) parts.inference = std::make_shared<PlainInference>();
  return std::unique_ptr<Method>(
      new Method(std::move(recipe), std::move(config), std::move(parts)));
}

nlohmann::json Method::QuantizationFields() const { return QuantizationFieldsOf(recipe_); }

StatusOr<const GlobalPhase*> Method::phase(const std::string& name) const {
  auto it = parts_.phases.find(name);
  if (it == parts_.phases.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("method ", recipe_.method, " has no global phase '", name, "'"));
  }
  return it->second.get();
}

quant::FinetuneOptions Method::FinetuneOptionsFor(const FinetuneStage& stage) const {
  quant::FinetuneOptions o;
  o.stage = stage;
  o.seed = recipe_.seed;
  o.sign_lr_multiplier = parts_.tunable_lr_multiplier;
  return o;
}

}  // namespace qcal::methods
