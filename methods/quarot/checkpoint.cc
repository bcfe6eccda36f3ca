#include "methods/quarot/checkpoint.h"

#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "methods/layer_format.h"
#include "methods/parts.h"
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

// A QuaRot block holds scalar-quantized or dense (float) linears, under the model's own tensor
// names (a MoE block's router and routed experts too): the standard block layout, plus the
// rotation methods' extras.
StandardBlockFormat BlockLayout(const LlamaConfig& config) {
  static const auto formats = std::make_shared<const LayerFormats>();
  return StandardBlockFormat(config, formats, "scalar");
}

}  // namespace

StatusOr<std::vector<std::string>> WriteQuarotBlockShard(const std::string& path,
                                                         const LlamaConfig& config, int64_t layer,
                                                         const model::BlockWeights& weights) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal_block", std::to_string(layer));
  QCAL_RETURN_IF_ERROR(AppendQuarotBlockTensors(config, layer, weights, &writer));
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  std::vector<std::string> names;
  for (const TensorInfo& t : file->tensors()) names.push_back(t.name);
  return names;
}

Status AppendQuarotBlockTensors(const LlamaConfig& config, int64_t layer,
                                const model::BlockWeights& weights, SafetensorsWriter* out) {
  SafetensorsWriter& writer = *out;
  const std::string p = config.TensorName(BlockPrefix(layer));
  QCAL_RETURN_IF_ERROR(BlockLayout(config).AppendBlockTensors(layer, weights, &writer));
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
  const std::string p = config.TensorName(BlockPrefix(layer));
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, BlockLayout(config).LoadBlock(ckpt, layer));
  QCAL_RETURN_IF_ERROR(LoadQuarotBlockExtras(ckpt, config, layer, &w));
  if (w.rope_perm.defined() &&
      (w.rope_perm.size(0) != config.num_key_value_heads || w.rope_perm.size(1) != config.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": ", p, kRopePermKey, " is [", w.rope_perm.size(0), ", ", w.rope_perm.size(1),
        "], expected [", config.num_key_value_heads, ", ", config.head_dim, "] from config.json"));
  }
  return w;
}

Status LoadQuarotBlockExtras(CheckpointReader& ckpt, const LlamaConfig& config, int64_t layer,
                             model::BlockWeights* weights) {
  const std::string p = config.TensorName(BlockPrefix(layer));
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
