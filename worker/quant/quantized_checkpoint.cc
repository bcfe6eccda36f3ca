#include "worker/quant/quantized_checkpoint.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "worker/quant/quantized_linear.h"
#include "worker/quarot/checkpoint.h"

namespace qcal::quant {
namespace {

Status AddF32(SafetensorsWriter* w, const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kFloat).contiguous();
  return w->AddF32(name, c.sizes().vec(), c.data_ptr<float>());
}

}  // namespace

StatusOr<std::vector<std::string>> WriteBlockShard(const std::string& path, int64_t layer,
                                                   const model::BlockWeights& weights) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal_block", std::to_string(layer));
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  QCAL_RETURN_IF_ERROR(AddF32(&writer, p + "input_layernorm.weight", weights.input_norm));
  QCAL_RETURN_IF_ERROR(AddF32(&writer, p + "post_attention_layernorm.weight", weights.post_norm));
  std::vector<std::string> names = {p + "input_layernorm.weight",
                                    p + "post_attention_layernorm.weight"};
  for (model::LinearKind k : model::kAllLinears) {
    const std::string prefix = p + model::LinearName(k);
    const model::Linear& linear = weights.linear(k);
    if (auto* q = dynamic_cast<const QuipLinear*>(&linear)) {
      QCAL_RETURN_IF_ERROR(q->AppendTensors(prefix, &writer));
    } else if (auto* s = dynamic_cast<const ScalarQuantLinear*>(&linear)) {
      QCAL_RETURN_IF_ERROR(s->AppendTensors(prefix, &writer));
    } else {
      QCAL_RETURN_IF_ERROR(AddF32(&writer, prefix + ".weight", linear.DenseWeight()));
    }
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  names.clear();
  for (const TensorInfo& t : file->tensors()) names.push_back(t.name);
  return names;
}

StatusOr<model::BlockWeights> LoadAnyBlockWeights(CheckpointReader& ckpt,
                                                  const LlamaConfig& config, int64_t layer) {
  if (!config.raw.contains("quantization_config")) {
    return model::LoadBlockWeights(ckpt, config, layer);
  }
  if (quarot::IsQuarotCheckpoint(config)) {
    return quarot::LoadQuarotBlockWeights(ckpt, config, layer);
  }
  const nlohmann::json& q = config.raw["quantization_config"];
  if (!q.is_object() || q.value("quant_method", "") != "qcal") {
    return absl::InvalidArgumentError(
        absl::StrCat(ckpt.dir(), "/config.json: quantization_config is not a qcal one (",
                     q.is_object() ? q.value("quant_method", "?") : "not an object", ")"));
  }
  const std::string format = q.value("format", "");
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  model::BlockWeights w;
  QCAL_ASSIGN_OR_RETURN(w.input_norm, model::LoadTensorF32(ckpt, p + "input_layernorm.weight",
                                                           {config.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.post_norm,
                        model::LoadTensorF32(ckpt, p + "post_attention_layernorm.weight",
                                             {config.hidden_size}));
  for (model::LinearKind k : model::kAllLinears) {
    const std::string prefix = p + model::LinearName(k);
    std::unique_ptr<model::Linear> linear;
    if (ckpt.Has(prefix + ".weight")) {
      // A linear left in float (e.g. by a partial recipe).
      QCAL_ASSIGN_OR_RETURN(std::vector<float> data, ckpt.ReadF32(prefix + ".weight"));
      QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(prefix + ".weight"));
      linear = std::make_unique<model::DenseLinear>(
          at::from_blob(data.data(), found.second->shape, at::kFloat).clone());
    } else if (format == "quip") {
      QCAL_ASSIGN_OR_RETURN(linear, QuipLinear::Load(ckpt, prefix, q.value("codebook", ""),
                                                     q.value("incoherence", true)));
    } else if (format == "scalar") {
      QCAL_ASSIGN_OR_RETURN(linear, ScalarQuantLinear::Load(ckpt, prefix));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.dir(), "/config.json: unknown quantization_config.format '", format, "'"));
    }
    w.linears[static_cast<int>(k)] = std::move(linear);
  }
  return w;
}

StatusOr<std::unique_ptr<model::LlamaModel>> LoadAnyModel(const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(dir));
  // QuaRot checkpoints carry rotations and activation / KV quantizers to install (worker/quarot).
  if (quarot::IsQuarotCheckpoint(config)) return quarot::LoadQuarotModel(dir);
  if (!config.raw.contains("quantization_config")) return model::LlamaModel::Load(dir);
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(dir));
  QCAL_ASSIGN_OR_RETURN(at::Tensor embed,
                        model::LoadTensorF32(*ckpt, "model.embed_tokens.weight",
                                             {config.vocab_size, config.hidden_size}));
  std::vector<model::DecoderBlock> blocks;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadAnyBlockWeights(*ckpt, config, l));
    blocks.emplace_back(config, std::move(w));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor norm,
                        model::LoadTensorF32(*ckpt, "model.norm.weight", {config.hidden_size}));
  at::Tensor head = embed;
  if (ckpt->Has("lm_head.weight")) {
    QCAL_ASSIGN_OR_RETURN(head, model::LoadTensorF32(*ckpt, "lm_head.weight",
                                                     {config.vocab_size, config.hidden_size}));
  }
  return std::make_unique<model::LlamaModel>(std::move(config), std::move(embed),
                                             std::move(blocks), std::move(norm),
                                             std::make_unique<model::DenseLinear>(head));
}

}  // namespace qcal::quant
