#include "worker/model/model_source.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::model {

CheckpointSource::CheckpointSource(LlamaConfig config, std::unique_ptr<CheckpointReader> ckpt)
    : config_(std::move(config)),
      ckpt_(std::move(ckpt)),
      rope_(config_) {}

StatusOr<at::Tensor> CheckpointSource::Embed(const at::Tensor& ids_in) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  std::vector<int64_t> rows(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  const std::string name = "model.embed_tokens.weight";
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

StatusOr<std::unique_ptr<DecoderBlock>> CheckpointSource::LoadBlock(int64_t layer) {
  QCAL_ASSIGN_OR_RETURN(BlockWeights w, LoadBlockWeights(layer));
  auto block = std::make_unique<DecoderBlock>(config_, std::move(w));
  QCAL_RETURN_IF_ERROR(InstallOnBlock(block.get(), layer));
  return block;
}

StatusOr<NonBlockWeights> CheckpointSource::LoadNonBlock() {
  NonBlockWeights w;
  QCAL_ASSIGN_OR_RETURN(w.embed, LoadTensorF32(*ckpt_, "model.embed_tokens.weight",
                                               {config_.vocab_size, config_.hidden_size}));
  QCAL_ASSIGN_OR_RETURN(w.final_norm,
                        LoadTensorF32(*ckpt_, "model.norm.weight", {config_.hidden_size}));
  // As LlamaModel::Load chooses: lm_head when the config unties it or the checkpoint has one.
  if (!config_.tie_word_embeddings || ckpt_->Has("lm_head.weight")) {
    QCAL_ASSIGN_OR_RETURN(w.head, LoadTensorF32(*ckpt_, "lm_head.weight",
                                                {config_.vocab_size, config_.hidden_size}));
    w.head_tied = false;
  } else {
    w.head = w.embed;
    w.head_tied = true;
  }
  return w;
}

StatusOr<at::Tensor> CheckpointSource::Logits(const at::Tensor& hidden) {
  if (!head_) {
    QCAL_ASSIGN_OR_RETURN(final_norm_,
                          LoadTensorF32(*ckpt_, "model.norm.weight", {config_.hidden_size}));
    const char* name = (!config_.tie_word_embeddings || ckpt_->Has("lm_head.weight"))
                           ? "lm_head.weight"
                           : "model.embed_tokens.weight";
    QCAL_ASSIGN_OR_RETURN(at::Tensor head,
                          LoadTensorF32(*ckpt_, name, {config_.vocab_size, config_.hidden_size}));
    head_ = std::make_unique<DenseLinear>(std::move(head));
  }
  return head_->Forward(RmsNorm(hidden, final_norm_, config_.rms_norm_eps));
}

void CheckpointSource::ReleaseHead() {
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
