#include "methods/quarot/checkpoint.h"

#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "methods/layer_format.h"
#include "methods/quarot/quarot_model.h"
#include "engine/model/tensor_io.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/rotate.h"
#include "methods/rotated_block.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::methods::quarot {
namespace {

using model::AddF32Tensor;
using model::AddF64Tensor;
using namespace qcal::qsim;  // NOLINT

constexpr char kExtraPrefix[] = "quarot.";

std::string BlockPrefix(int64_t layer) { return absl::StrCat("model.layers.", layer, "."); }

// A QuaRot block holds scalar-quantized or dense (float) linears.
const LayerFormats& Formats() {
  static const LayerFormats formats;
  return formats;
}

}  // namespace

StatusOr<std::vector<std::string>> WriteQuarotBlockShard(const std::string& path, int64_t layer,
                                                         const model::BlockWeights& weights) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal_block", std::to_string(layer));
  QCAL_RETURN_IF_ERROR(AppendQuarotBlockTensors(layer, weights, &writer));
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  std::vector<std::string> names;
  for (const TensorInfo& t : file->tensors()) names.push_back(t.name);
  return names;
}

Status AppendQuarotBlockTensors(int64_t layer, const model::BlockWeights& weights,
                                SafetensorsWriter* out) {
  SafetensorsWriter& writer = *out;
  const std::string p = BlockPrefix(layer);
  QCAL_RETURN_IF_ERROR(AddF32Tensor(&writer, p + "input_layernorm.weight", weights.input_norm));
  QCAL_RETURN_IF_ERROR(AddF32Tensor(&writer, p + "post_attention_layernorm.weight", weights.post_norm));
  for (model::LinearKind k : model::kAllLinears) {
    const std::string prefix = p + model::LinearName(k);
    QCAL_RETURN_IF_ERROR(Formats().Append(weights.linear(k), prefix, &writer));
  }
  for (const auto& [key, tensor] : weights.extra) {
    if (key.rfind(kExtraPrefix, 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", layer, ": extra tensor '", key, "' is not a quarot.* tensor"));
    }
    QCAL_RETURN_IF_ERROR(AddF64Tensor(&writer, p + key, tensor));
  }
  if (weights.rope_perm.defined()) {
    QCAL_RETURN_IF_ERROR(AddF64Tensor(&writer, p + kRopePermKey, weights.rope_perm));
  }
  return Status();
}

StatusOr<model::BlockWeights> LoadQuarotBlockWeights(CheckpointReader& ckpt,
                                                     const LlamaConfig& config, int64_t layer) {
  const std::string p = BlockPrefix(layer);
  const std::vector<int64_t> shapes[7] = {
      {config.q_dim(), config.hidden_size},   {config.kv_dim(), config.hidden_size},
      {config.kv_dim(), config.hidden_size},  {config.hidden_size, config.q_dim()},
      {config.intermediate_size, config.hidden_size},
      {config.intermediate_size, config.hidden_size},
      {config.hidden_size, config.intermediate_size}};
  model::BlockWeights w;
  QCAL_ASSIGN_OR_RETURN(w.input_norm, model::LoadTensorF32(ckpt, p + "input_layernorm.weight",
                                                           {config.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.post_norm, model::LoadTensorF32(ckpt, p + "post_attention_layernorm.weight",
                                                          {config.hidden_size}));
  for (model::LinearKind k : model::kAllLinears) {
    const std::string prefix = p + model::LinearName(k);
    const std::vector<int64_t>& shape = shapes[static_cast<int>(k)];
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::Linear> linear,
                          Formats().Load(ckpt, prefix, "scalar"));
    if (linear->out_features() != shape[0] || linear->in_features() != shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.dir(), ": ", prefix, " is ", linear->out_features(), "x", linear->in_features(),
          ", expected ", shape[0], "x", shape[1], " from config.json"));
    }
    w.linears[static_cast<int>(k)] = std::move(linear);
  }
  QCAL_RETURN_IF_ERROR(LoadQuarotBlockExtras(ckpt, layer, &w));
  if (w.rope_perm.defined() &&
      (w.rope_perm.size(0) != config.num_key_value_heads || w.rope_perm.size(1) != config.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": ", p, kRopePermKey, " is [", w.rope_perm.size(0), ", ", w.rope_perm.size(1),
        "], expected [", config.num_key_value_heads, ", ", config.head_dim, "] from config.json"));
  }
  return w;
}

Status LoadQuarotBlockExtras(CheckpointReader& ckpt, int64_t layer, model::BlockWeights* weights) {
  const std::string p = BlockPrefix(layer);
  const std::pair<std::string, std::vector<int64_t>> known[] = {
      {kActRangesKey, {4, 2}}, {kKvRangesKey, {2, 2}}, {kRotationsKey, {4}}};
  for (const auto& [key, shape] : known) {
    if (!ckpt.Has(p + key)) continue;
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(p + key));
    const TensorInfo& info = *found.second;
    if (info.dtype != DType::kF64 || info.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(found.first->path(), ": tensor '", p, key,
                                                     "' must be F64 of ", shape.size(),
                                                     " dims [", shape[0], ", ...]"));
    }
    at::Tensor t = at::empty(shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), found.first->Data(info), t.numel() * sizeof(double));
    weights->extra[key] = t;
  }
  if (ckpt.Has(p + kRopePermKey)) {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(p + kRopePermKey));
    const TensorInfo& info = *found.second;
    const std::string where = absl::StrCat(found.first->path(), ": tensor '", p, kRopePermKey, "'");
    if (info.dtype != DType::kF64 || info.shape.size() != 2 || info.shape[1] < 2 ||
        info.shape[1] % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " must be F64 [kv_heads, head_dim] with an even head_dim"));
    }
    at::Tensor t = at::empty(info.shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), found.first->Data(info), t.numel() * sizeof(double));
    const at::Tensor whole = t.round();
    const at::Tensor sorted = std::get<0>(whole.sort(1));
    const at::Tensor expect = at::arange(info.shape[1], at::kDouble).expand_as(sorted);
    if (!at::equal(whole, t) || !at::equal(sorted, expect)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has a row that is not a permutation of [0, ", info.shape[1], ")"));
    }
    weights->rope_perm = t.to(at::kLong);
  }
  return Status();
}

Status CheckQuarotBlock(const std::string& where, int64_t layer, const model::BlockWeights& w,
                        const Recipe& recipe, const RotationPlan& plan) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  const bool planned[4] = {plan.r1, plan.r2, plan.r3, plan.r4};
  auto applied = w.extra.find(kRotationsKey);
  if (applied == w.extra.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": block ", layer, " has no ", kRotationsKey, " (not written by the QuaRot pipeline)"));
  }
  for (int i = 0; i < 4; ++i) {
    if ((applied->second[i].item<double>() != 0) != planned[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": block ", layer, " was quantized with other rotations than the recipe plans (",
          plan.Describe(), ")"));
    }
  }
  if (w.rope_perm.defined() != q->kv_cache.k_sort) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": block ", layer, q->kv_cache.k_sort ? " has no " : " has a ", kRopePermKey,
        " but the recipe's kv_cache.k_sort is ", q->kv_cache.k_sort ? "true" : "false"));
  }
  return Status();
}

}  // namespace qcal::methods::quarot
