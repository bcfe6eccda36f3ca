#include "runner/shard_writers.h"

#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_layout.h"
#include "common/safetensors.h"
#include "engine/model/tensor_io.h"
#include "runner/job_dir.h"

namespace qcal::job {
namespace {

// Adds the [rows, hidden] float32 table `name` to `writer`, its row chunks
// (model::TableChunkRows) made by `make(begin, count)` while the writer writes: the table is
// never whole in memory.
Status AddTableStreamed(SafetensorsWriter* writer, const std::string& name, int64_t rows,
                        int64_t hidden,
                        std::function<StatusOr<at::Tensor>(int64_t, int64_t)> make) {
  return writer->AddStreamed(
      name, DType::kF32, {rows, hidden},
      [name, rows, hidden, make = std::move(make)](const SafetensorsWriter::ByteSink& sink)
          -> Status {
        at::NoGradGuard no_grad;
        const int64_t step = model::TableChunkRows(hidden);
        for (int64_t begin = 0; begin < rows; begin += step) {
          const int64_t n = std::min(step, rows - begin);
          QCAL_ASSIGN_OR_RETURN(at::Tensor chunk, make(begin, n));
          chunk = chunk.to(at::kFloat).contiguous();
          if (chunk.dim() != 2 || chunk.size(0) != n || chunk.size(1) != hidden) {
            return absl::InternalError(absl::StrCat("rows [", begin, ", ", begin + n, ") of '",
                                                    name, "' came back with shape ",
                                                    model::ShapeStr(chunk.sizes().vec())));
          }
          QCAL_RETURN_IF_ERROR(sink(chunk.data_ptr<float>(),
                                    static_cast<size_t>(chunk.numel()) * sizeof(float)));
        }
        return absl::OkStatus();
      });
}

}  // namespace

// Shard 0 of a method that transforms the non-block weights, as the attempt's staged file:
// the embedding table and the (untied) head streamed from the float model in row chunks
// through the method's row functions, stored F32 (transformed values); the prepared final
// norm, F32.
StatusOr<v1::WrittenFile> WritePreparedNonBlockShardStaged(JobContext* ctx,
                                                           const std::string& attempt) {
  model::ModelSource* source = ctx->source.get();
  const methods::Method* method = ctx->method.get();
  const int64_t vocab = ctx->config.vocab_size, hidden = ctx->config.hidden_size;
  QCAL_ASSIGN_OR_RETURN(const at::Tensor norm, source->FinalNorm());
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  QCAL_RETURN_IF_ERROR(AddTableStreamed(
      &writer, "model.embed_tokens.weight", vocab, hidden,
      [source, method](int64_t begin, int64_t n) -> StatusOr<at::Tensor> {
        QCAL_ASSIGN_OR_RETURN(at::Tensor rows, source->Embed(at::arange(begin, begin + n,
                                                                        at::kLong)));
        return method->transform().PrepareEmbeddingRows(rows);
      }));
  QCAL_RETURN_IF_ERROR(
      model::AddF32Tensor(&writer, "model.norm.weight", method->transform().PrepareFinalNorm(norm)));
  QCAL_RETURN_IF_ERROR(AddTableStreamed(
      &writer, "lm_head.weight", vocab, hidden,
      [source, method, norm](int64_t begin, int64_t n) -> StatusOr<at::Tensor> {
        QCAL_ASSIGN_OR_RETURN(at::Tensor rows, source->HeadRows(begin, n));
        return method->transform().PrepareHeadRows(rows, norm);
      }));
  return WriteStagedFile(ctx->spec.out_dir(), ShardName(0, ctx->config.num_hidden_layers),
                         attempt, writer);
}

// Shard 0 after end-to-end fine-tuning, as the attempt's staged file: the embedding table as
// the float model stores it (not tuned; streamed), the tuned final norm and, when untied, the
// tuned head (F32), under the model's prefix; a multimodal model's tensors outside the text
// model (vision tower, projector) copied as stored, as finalize's shard 0 holds them.
StatusOr<v1::WrittenFile> WriteTunedNonBlockShardStaged(JobContext* ctx,
                                                        const at::Tensor& final_norm,
                                                        const at::Tensor& head, bool head_tied,
                                                        const std::string& attempt) {
  const LlamaConfig& c = ctx->config;
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  QCAL_RETURN_IF_ERROR(
      ctx->source->AddStoredTensor(&writer, c.TensorName("model.embed_tokens.weight")));
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(&writer, c.TensorName("model.norm.weight"), final_norm));
  if (!head_tied) {
    QCAL_RETURN_IF_ERROR(model::AddF32Tensor(&writer, c.TensorName("lm_head.weight"), head));
  }
  if (!c.tensor_prefix.empty()) {
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> model,
                          CheckpointReader::Open(ctx->spec.model_dir()));
    for (const std::string& name : model->TensorNames()) {
      if (name.compare(0, c.tensor_prefix.size(), c.tensor_prefix) == 0) continue;
      QCAL_RETURN_IF_ERROR(ctx->source->AddStoredTensor(&writer, name));
    }
  }
  return WriteStagedFile(ctx->spec.out_dir(), ShardName(0, ctx->config.num_hidden_layers),
                         attempt, writer);
}

namespace {

// Block `layer`'s shard with the tensors `append` adds, as the attempt's staged file.
StatusOr<v1::WrittenFile> WriteBlockShard(
    JobContext* ctx, int64_t layer, const std::string& attempt,
    const std::function<Status(SafetensorsWriter*)>& append) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal_block", std::to_string(layer));
  QCAL_RETURN_IF_ERROR(append(&writer));
  return WriteStagedFile(ctx->spec.out_dir(),
                         ShardName(layer + 1, ctx->config.num_hidden_layers), attempt, writer);
}

}  // namespace

// Block `layer`'s shard, as the attempt's staged file.
StatusOr<v1::WrittenFile> WriteBlockShardStaged(JobContext* ctx, int64_t layer,
                                                const model::BlockWeights& weights,
                                                const std::string& attempt) {
  return WriteBlockShard(ctx, layer, attempt, [&](SafetensorsWriter* writer) {
    return ctx->method->block_format().AppendBlockTensors(layer, weights, writer);
  });
}

StatusOr<v1::WrittenFile> WriteAssembledBlockShardStaged(
    JobContext* ctx, int64_t layer, const model::BlockWeights& weights,
    const std::vector<methods::BlockFormat::StoredExperts>& groups, const std::string& attempt) {
  return WriteBlockShard(ctx, layer, attempt, [&](SafetensorsWriter* writer) {
    return ctx->method->block_format().AppendBlockTensorsFromParts(layer, weights, groups,
                                                                   writer);
  });
}

}  // namespace qcal::job
