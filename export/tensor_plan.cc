#include "export/tensor_plan.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/tensor_io.h"

namespace qcal::exporter {

LinearRef DenseLinearRef(const LlamaConfig& config, int64_t layer, model::LinearKind k) {
  LinearRef r;
  r.layer = layer;
  r.kind = k;
  r.prefix = model::LinearTensorName(config, layer, k);
  return r;
}

LinearRef ExpertLinearRef(const LlamaConfig& config, int64_t layer, int64_t expert,
                          model::ExpertLinear k) {
  LinearRef r;
  r.layer = layer;
  r.kind = model::ExpertLinearKind(k);
  r.expert = expert;
  r.expert_linear = k;
  r.prefix = model::ExpertTensorName(config, layer, expert, k);
  return r;
}

std::vector<int64_t> LinearRefShape(const LlamaConfig& config, const LinearRef& ref) {
  return model::LinearShape(config, ref.kind, ref.layer);
}

std::vector<LinearRef> BlockLinears(const LlamaConfig& config, int64_t layer) {
  std::vector<LinearRef> refs;
  for (model::LinearKind k : model::kAllLinears) {
    if (model::BlockHasLinear(config, layer, k)) refs.push_back(DenseLinearRef(config, layer, k));
  }
  if (config.IsMoeLayer(layer)) {
    for (int64_t e = 0; e < config.num_experts; ++e) {
      for (model::ExpertLinear k : model::kExpertLinears) {
        refs.push_back(ExpertLinearRef(config, layer, e, k));
      }
    }
  }
  return refs;
}

bool FloatInPackedExport(const LlamaConfig& config, const LinearRef& ref) {
  return config.family == ModelFamily::kLlama4 && ref.expert < 0 &&
         (ref.kind == model::LinearKind::kQ || ref.kind == model::LinearKind::kK ||
          ref.kind == model::LinearKind::kV);
}

const model::Linear& LoadedBlock::linear(const LinearRef& ref) const {
  if (ref.expert < 0) return weights.linear(ref.kind);
  return weights.moe->experts.at(ref.expert).linear(ref.expert_linear);
}

Status SinkAs(DType dtype, const float* data, size_t n, const Sink& sink) {
  if (dtype == DType::kF32) return sink(data, n * sizeof(float));
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<uint8_t> buf(std::min(n, kPiece) * DTypeSize(dtype));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t m = std::min(kPiece, n - at);
    ConvertFromF32(dtype, data + at, m, buf.data());
    QCAL_RETURN_IF_ERROR(sink(buf.data(), m * DTypeSize(dtype)));
  }
  return absl::OkStatus();
}

Status CheckServed(const Source& source, const std::string& format, bool linear_inputs_allowed,
                   bool kv_cache_allowed) {
  std::vector<std::string> refused;
  for (const methods::ServedForward::Step& step : source.served.online) {
    if (linear_inputs_allowed && step.on_linear_inputs) continue;
    if (kv_cache_allowed && step.on_kv_cache) continue;
    refused.push_back(step.what);
  }
  if (refused.empty()) return absl::OkStatus();
  const Recipe& recipe = source.method->recipe();
  return absl::FailedPreconditionError(absl::StrCat(
      source.dir, ": cannot export to ", format, ": recipe '", recipe.name, "' (method ",
      recipe.method, ") computes ", absl::StrJoin(refused, ", "),
      " at inference time, which a plain Llama forward pass",
      linear_inputs_allowed ? " with quantized linear inputs" : "",
      kv_cache_allowed ? " and an FP8 KV cache" : "",
      " (and so this format) cannot express"));
}

namespace {

Status NotOnAGrid(const Source& source, const std::string& prefix) {
  return absl::FailedPreconditionError(absl::StrCat(
      source.dir, ": ", prefix, " is stored in method ", source.method->recipe().method,
      "'s own layer format, not on a scalar integer grid: the GPTQ and compressed-tensors "
      "formats hold integer codes with per-group scales and zero points, and cannot express "
      "lattice or trellis codebook codes or incoherence transforms (try --format dense)"));
}

}  // namespace

StatusOr<GridShape> ReadGridShape(const Source& source, const std::string& prefix) {
  StatusOr<quant::ScalarLinearData> grid = quant::ScalarQuantLinear::ReadGrid(*source.ckpt, prefix);
  if (!grid.ok()) {
    if (absl::IsNotFound(grid.status())) return NotOnAGrid(source, prefix);
    return grid.status();
  }
  GridShape g;
  g.bits = grid->bits;
  g.in = grid->in_features;
  g.out = grid->out_features;
  g.group_size = grid->group_size;
  g.symmetric = grid->symmetric;
  g.groups = g.group_size == -1 ? 1 : (g.in + g.group_size - 1) / g.group_size;
  return g;
}

StatusOr<std::vector<float>> ReadGridScales(const Source& source, const std::string& prefix,
                                            const GridShape& g) {
  return model::ReadF32Checked(*source.ckpt, prefix + ".scales", {g.out, g.groups});
}

Status UniformGrid::Add(const Source& source, const std::string& format, const std::string& prefix,
                        const GridShape& g) {
  if (!grid_) {
    grid_ = g;
    return absl::OkStatus();
  }
  if (grid_->bits == g.bits && grid_->group_size == g.group_size &&
      grid_->symmetric == g.symmetric) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      source.dir, ": ", prefix, " has ", g.bits, " bits, group size ", g.group_size,
      g.symmetric ? ", symmetric" : ", asymmetric", "; the first linear has ", grid_->bits,
      " bits, group size ", grid_->group_size, grid_->symmetric ? ", symmetric" : ", asymmetric",
      ": one ", format, " quantization_config cannot describe both"));
}

class TensorPlan::BlockCache {
 public:
  BlockCache(const Source* source, bool read_grids) : source_(source), read_grids_(read_grids) {}

  StatusOr<const LoadedBlock*> Get(int64_t layer) {
    if (layer == layer_) return &block_;
    layer_ = -1;
    block_ = LoadedBlock();
    QCAL_ASSIGN_OR_RETURN(block_.weights,
                          source_->method->block_format().LoadBlock(*source_->ckpt, layer));
    if (read_grids_) {
      for (const LinearRef& ref : BlockLinears(source_->config, layer)) {
        if (FloatInPackedExport(source_->config, ref)) continue;
        StatusOr<quant::ScalarLinearData> grid =
            quant::ReadScalarLinear(*source_->ckpt, ref.prefix);
        if (!grid.ok()) {
          if (absl::IsNotFound(grid.status())) return NotOnAGrid(*source_, ref.prefix);
          return grid.status();
        }
        block_.grids[ref.prefix] = *std::move(grid);
      }
    }
    if (block_.weights.moe == nullptr && source_->config.IsMoeLayer(layer)) {
      return absl::DataLossError(absl::StrCat(source_->dir, ": block ", layer,
                                              " loaded without its routed experts"));
    }
    layer_ = layer;
    return &block_;
  }

 private:
  const Source* source_;
  const bool read_grids_;
  int64_t layer_ = -1;
  LoadedBlock block_;
};

TensorPlan::TensorPlan(const Source* source, bool read_grids)
    : source_(source), cache_(std::make_unique<BlockCache>(source, read_grids)) {}

TensorPlan::~TensorPlan() = default;

Status TensorPlan::AddTable(const std::string& name, DType dtype) {
  QCAL_ASSIGN_OR_RETURN(auto found, source_->ckpt->Find(name));
  const SafetensorsFile* file = found.first;
  const TensorInfo* info = found.second;
  if (!IsFloatingDType(info->dtype) || info->shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(file->path(), ": tensor '", name, "' is not a 2-D floating table"));
  }
  PlannedTensor p{name, dtype, info->shape, 0, nullptr};
  p.bytes = static_cast<uint64_t>(info->numel()) * DTypeSize(dtype);
  p.produce = [file, info, dtype](const Sink& sink) -> Status {
    if (info->dtype == dtype) return SinkStoredBytes(*file, *info, sink);
    const int64_t rows = info->shape[0], cols = info->shape[1];
    const int64_t step = model::TableChunkRows(cols);
    const size_t row_bytes = static_cast<size_t>(cols) * DTypeSize(info->dtype);
    std::vector<float> chunk;
    for (int64_t r = 0; r < rows; r += step) {
      const int64_t n = std::min(step, rows - r);
      chunk.resize(static_cast<size_t>(n * cols));
      ConvertToF32(info->dtype, file->Data(*info) + r * row_bytes, chunk.size(), chunk.data());
      QCAL_RETURN_IF_ERROR(SinkAs(dtype, chunk.data(), chunk.size(), sink));
      file->ReleasePages(*info, r * row_bytes, (r + n) * row_bytes);
    }
    return absl::OkStatus();
  };
  tensors_.push_back(std::move(p));
  return absl::OkStatus();
}

Status TensorPlan::AddSmall(const std::string& name, DType dtype) {
  QCAL_ASSIGN_OR_RETURN(auto found, source_->ckpt->Find(name));
  const TensorInfo* info = found.second;
  CheckpointReader* ckpt = source_->ckpt.get();
  PlannedTensor p{name, dtype, info->shape,
                  static_cast<uint64_t>(info->numel()) * DTypeSize(dtype), nullptr};
  p.produce = [ckpt, name, dtype](const Sink& sink) -> Status {
    QCAL_ASSIGN_OR_RETURN(std::vector<float> v, ckpt->ReadF32(name));
    return SinkAs(dtype, v.data(), v.size(), sink);
  };
  tensors_.push_back(std::move(p));
  return absl::OkStatus();
}

Status TensorPlan::AddStored(const std::string& name) {
  QCAL_ASSIGN_OR_RETURN(auto found, source_->ckpt->Find(name));
  const SafetensorsFile* file = found.first;
  const TensorInfo* info = found.second;
  PlannedTensor p{name, info->dtype, info->shape,
                  static_cast<uint64_t>(info->numel()) * DTypeSize(info->dtype), nullptr};
  p.produce = [file, info](const Sink& sink) { return SinkStoredBytes(*file, *info, sink); };
  tensors_.push_back(std::move(p));
  return absl::OkStatus();
}

void TensorPlan::AddDenseWeight(const LinearRef& ref, DType dtype) {
  AddBlockTensor(ref.prefix + ".weight", dtype, LinearRefShape(source_->config, ref), ref.layer,
                 [ref, dtype](const LoadedBlock& b, const Sink& sink) -> Status {
                   const at::Tensor w = b.linear(ref).DenseWeight().to(at::kFloat).contiguous();
                   return SinkAs(dtype, w.data_ptr<float>(), w.numel(), sink);
                 });
}

void TensorPlan::AddBlockTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                                int64_t layer,
                                std::function<Status(const LoadedBlock&, const Sink&)> make) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  BlockCache* cache = cache_.get();
  tensors_.push_back({std::move(name), dtype, std::move(shape), n,
                      [cache, layer, make = std::move(make)](const Sink& sink) -> Status {
                        QCAL_ASSIGN_OR_RETURN(const LoadedBlock* b, cache->Get(layer));
                        return make(*b, sink);
                      }});
}

}  // namespace qcal::exporter
