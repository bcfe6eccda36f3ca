#include "engine/model/model_source.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace qcal::model {

CheckpointSource::CheckpointSource(LlamaConfig config, std::unique_ptr<CheckpointReader> ckpt)
    : config_(std::move(config)),
      ckpt_(std::move(ckpt)),
      rope_(config_) {}

StatusOr<at::Tensor> CheckpointSource::Embed(const at::Tensor& ids_in) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  std::vector<int64_t> rows(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  const std::string name = config_.TensorName("model.embed_tokens.weight");
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(name));
  const TensorInfo& info = *found.second;
  if (info.shape != std::vector<int64_t>{config_.vocab_size, config_.hidden_size}) {
    return absl::InvalidArgumentError(absl::StrCat(
        found.first->path(), ": tensor '", name, "' is not [", config_.vocab_size, ", ",
        config_.hidden_size, "] as config.json says"));
  }
  QCAL_ASSIGN_OR_RETURN(std::vector<float> data, found.first->ReadRowsF32(name, rows));
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(config_.hidden_size);
  return at::from_blob(data.data(), shape, at::kFloat).clone();
}

StatusOr<std::unique_ptr<DecoderBlock>> ModelSource::LoadBlockPart(int64_t layer,
                                                                  const BlockSelection& select) {
  if (!select.dense) {
    return absl::UnimplementedError("this model source loads a block's routed experts with its "
                                    "other weights only");
  }
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<DecoderBlock> block, LoadBlock(layer));
  if (block->weights().moe != nullptr) {
    std::vector<ExpertWeights>& experts = block->mutable_weights().moe->experts;
    const int64_t n = static_cast<int64_t>(experts.size());
    const int64_t end = select.expert_end < 0 ? n : select.expert_end;
    if (select.expert_begin < 0 || select.expert_begin > end || end > n) {
      return absl::OutOfRangeError(absl::StrCat("block ", layer, ": experts [",
                                                select.expert_begin, ", ", end,
                                                ") of ", n));
    }
    for (int64_t e = 0; e < n; ++e) {
      if (e >= select.expert_begin && e < end) continue;
      for (auto& linear : experts[e].linears) linear.reset();
    }
  }
  return block;
}

StatusOr<std::unique_ptr<DecoderBlock>> CheckpointSource::LoadBlock(int64_t layer) {
  QCAL_ASSIGN_OR_RETURN(BlockWeights w, LoadBlockWeights(layer));
  auto block = std::make_unique<DecoderBlock>(config_, std::move(w));
  QCAL_RETURN_IF_ERROR(InstallOnBlock(block.get(), layer));
  return block;
}

StatusOr<NonBlockWeights> CheckpointSource::LoadNonBlock() {
  NonBlockWeights w;
  QCAL_ASSIGN_OR_RETURN(w.embed, LoadTensorF32(*ckpt_, config_.TensorName("model.embed_tokens.weight"),
                                               {config_.vocab_size, config_.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.final_norm,
                        LoadTensorF32(*ckpt_, config_.TensorName("model.norm.weight"),
                                      {config_.hidden_size}));
  if (!HeadTied()) {
    QCAL_ASSIGN_OR_RETURN(w.head, LoadTensorF32(*ckpt_, config_.TensorName("lm_head.weight"),
                                                {config_.vocab_size, config_.hidden_size}));
    w.head_tied = false;
  } else {
    w.head = w.embed;
    w.head_tied = true;
  }
  return w;
}

bool CheckpointSource::HeadTied() const {
  // As LlamaModel::Load chooses: lm_head when the config unties it or the checkpoint has one.
  return config_.tie_word_embeddings && !ckpt_->Has(config_.TensorName("lm_head.weight"));
}

StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> CheckpointSource::HeadTable() {
  const std::string name =
      config_.TensorName(HeadTied() ? "model.embed_tokens.weight" : "lm_head.weight");
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(name));
  const std::vector<int64_t> shape = {config_.vocab_size, config_.hidden_size};
  if (found.second->shape != shape || !IsFloatingDType(found.second->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        found.first->path(), ": tensor '", name, "' is ",
        std::string(DTypeName(found.second->dtype)), " [",
        absl::StrJoin(found.second->shape, ", "), "], expected a floating [", config_.vocab_size,
        ", ", config_.hidden_size, "] table as config.json says"));
  }
  return found;
}

StatusOr<at::Tensor> CheckpointSource::HeadRows(int64_t begin, int64_t count) {
  QCAL_ASSIGN_OR_RETURN(auto table, HeadTable());
  if (begin < 0 || count < 0 || begin + count > config_.vocab_size) {
    return absl::OutOfRangeError(absl::StrCat(table.first->path(), ": head rows [", begin, ", ",
                                              begin + count, ") outside its ",
                                              config_.vocab_size, " rows"));
  }
  at::Tensor rows = at::empty({count, config_.hidden_size}, at::kFloat);
  const size_t row_bytes = static_cast<size_t>(config_.hidden_size) * DTypeSize(table.second->dtype);
  ConvertToF32(table.second->dtype, table.first->Data(*table.second) + begin * row_bytes,
               static_cast<size_t>(rows.numel()), rows.data_ptr<float>());
  table.first->ReleasePages(*table.second, begin * row_bytes, (begin + count) * row_bytes);
  return rows;
}

StatusOr<at::Tensor> CheckpointSource::FinalNorm() {
  return LoadTensorF32(*ckpt_, config_.TensorName("model.norm.weight"), {config_.hidden_size});
}

Status CheckpointSource::AddStoredTensor(SafetensorsWriter* writer, const std::string& name) {
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(name));
  return AddCopiedTensor(writer, name, *found.first, *found.second);
}

namespace {
std::atomic<int64_t> table_chunk_elements{int64_t{1} << 24};
}  // namespace

int64_t TableChunkElements() { return table_chunk_elements.load(); }
void SetTableChunkElements(int64_t elements) {
  table_chunk_elements.store(std::max<int64_t>(1, elements));
}
int64_t TableChunkRows(int64_t cols) {
  return std::max<int64_t>(1, TableChunkElements() / std::max<int64_t>(1, cols));
}

namespace {

// A 16-bit head as stored, multiplied in row chunks converted to float32 on each call: the
// logits of a bf16 128k-vocabulary head without a float32 copy of the table (which would be
// 2.1 GB at Llama-3-8B's, 4.2 GB at 70B's shape). Each chunk is one LinearRows product
// (deterministic whatever the thread count, like every dense linear).
class StoredHeadLinear final : public Linear {
 public:
  StoredHeadLinear(const SafetensorsFile* file, const TensorInfo* info)
      : file_(file), info_(info), rows_(info->shape[0]), cols_(info->shape[1]) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = rows_;
    at::Tensor out = at::empty(sizes, x.options());
    const size_t row_bytes = static_cast<size_t>(cols_) * DTypeSize(info_->dtype);
    const int64_t step = TableChunkRows(cols_);
    at::Tensor w = at::empty({std::min(step, rows_), cols_}, at::kFloat);
    for (int64_t r0 = 0; r0 < rows_; r0 += step) {
      const int64_t n = std::min(step, rows_ - r0);
      at::Tensor chunk = w.narrow(0, 0, n);
      ConvertToF32(info_->dtype, file_->Data(*info_) + r0 * row_bytes,
                   static_cast<size_t>(n * cols_), chunk.data_ptr<float>());
      out.narrow(-1, r0, n).copy_(LinearRows(x, chunk));
    }
    return out;
  }
  int64_t in_features() const override { return cols_; }
  int64_t out_features() const override { return rows_; }
  at::Tensor DenseWeight() const override {
    at::Tensor w = at::empty({rows_, cols_}, at::kFloat);
    ConvertToF32(info_->dtype, file_->Data(*info_), static_cast<size_t>(w.numel()),
                 w.data_ptr<float>());
    return w;
  }

 private:
  const SafetensorsFile* file_;
  const TensorInfo* info_;
  int64_t rows_, cols_;
};

}  // namespace

StatusOr<ModelSource::LoadedHead> CheckpointSource::Head() {
  if (!head_) {
    QCAL_ASSIGN_OR_RETURN(final_norm_, FinalNorm());
    QCAL_ASSIGN_OR_RETURN(auto table, HeadTable());
    if (table.second->dtype == DType::kF16 || table.second->dtype == DType::kBF16) {
      head_ = std::make_unique<StoredHeadLinear>(table.first, table.second);
    } else {
      QCAL_ASSIGN_OR_RETURN(at::Tensor head, LoadTensorF32(*ckpt_, table.second->name,
                                                           {config_.vocab_size,
                                                            config_.hidden_size}));
      head_ = std::make_unique<DenseLinear>(std::move(head));
    }
  }
  return LoadedHead{final_norm_, head_.get()};
}

StatusOr<at::Tensor> CheckpointSource::Logits(const at::Tensor& hidden) {
  QCAL_RETURN_IF_ERROR(Head().status());
  return head_->Forward(RmsNorm(hidden, final_norm_, config_.rms_norm_eps));
}

void CheckpointSource::ReleaseHead() {
  if (head_ != nullptr) {
    if (auto table = HeadTable(); table.ok()) table->first->ReleasePages(*table->second);
  }
  head_.reset();
  final_norm_ = at::Tensor();
}

namespace {

class FloatCheckpointSource final : public CheckpointSource {
 public:
  using CheckpointSource::CheckpointSource;
  StatusOr<BlockWeights> LoadBlockWeights(int64_t layer) override {
    return model::LoadBlockWeights(reader(), config(), layer);
  }
  // Only the selected part is read (Llama 4's fused experts one slab at a time).
  StatusOr<std::unique_ptr<DecoderBlock>> LoadBlockPart(int64_t layer,
                                                        const BlockSelection& select) override {
    QCAL_ASSIGN_OR_RETURN(BlockWeights w,
                          model::LoadBlockWeightsPart(reader(), config(), layer, select));
    return std::make_unique<DecoderBlock>(config(), std::move(w));
  }
};

}  // namespace

StatusOr<std::unique_ptr<ModelSource>> OpenFloatCheckpoint(const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(dir));
  if (config.raw.contains("quantization_config")) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: a quantized checkpoint, not a float model"));
  }
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(dir));
  return std::unique_ptr<ModelSource>(
      std::make_unique<FloatCheckpointSource>(std::move(config), std::move(ckpt)));
}

}  // namespace qcal::model
