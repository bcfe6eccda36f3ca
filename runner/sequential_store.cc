#include "runner/sequential_store.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/checkpoint_layout.h"
#include "common/log.h"
#include "common/safe_fs.h"
#include "engine/calib/cache.h"
#include "runner/job_dir.h"

namespace qcal::job {
namespace {

// The leading positions of every calibration sequence a sequential method's block tasks drop.
int64_t DroppedPositions(const JobContext& ctx) {
  return ctx.method->needs().sequential ? ctx.method->sequential().DroppedCalibrationPositions()
                                        : 0;
}

// Block 0's calibration inputs of a sequential method: the embedded tokens (less the positions
// the method drops), prepared by the method.
StatusOr<at::Tensor> EmbeddedCalibrationInputs(JobContext* ctx) {
  QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
  at::NoGradGuard no_grad;
  const int64_t dropped = DroppedPositions(*ctx);
  QCAL_ASSIGN_OR_RETURN(
      at::Tensor rows,
      ctx->source->Embed(ctx->tokens.narrow(1, dropped, ctx->tokens.size(1) - dropped)));
  return ctx->method->transform().PrepareEmbeddingRows(rows);
}

// A sequential inputs file of block `layer` ([seqs, seq_len less the dropped positions,
// hidden]); nullopt when it is gone (removed once its block was done), FailedPrecondition when
// unusable.
StatusOr<std::optional<at::Tensor>> LoadSequentialFile(JobContext* ctx, const std::string& path,
                                                       int64_t layer, const char* what) {
  const std::vector<int64_t> shape = {ctx->recipe.calibration.num_sequences,
                                      ctx->seq_len - DroppedPositions(*ctx),
                                      ctx->config.hidden_size};
  auto loaded = calib::LoadActivation(path, ctx->calib_key, shape);
  if (loaded.ok()) return std::optional<at::Tensor>(std::move(*loaded));
  if (!absl::IsNotFound(loaded.status())) {
    return absl::FailedPreconditionError(absl::StrCat("block ", layer, ": unusable ", what, ": ",
                                                      loaded.status().message()));
  }
  return std::optional<at::Tensor>();
}

}  // namespace

// The float model's inputs to block `layer` (MethodNeeds::sequential_float): saved by block
// layer-1's task, or rebuilt through the float blocks before it.
StatusOr<at::Tensor> SequentialFloatInputs(JobContext* ctx, int64_t layer) {
  if (layer == 0) return EmbeddedCalibrationInputs(ctx);
  const std::string path = JobPaths(ctx->spec.job_dir()).SequentialFloatInputs(layer);
  QCAL_ASSIGN_OR_RETURN(std::optional<at::Tensor> loaded,
                        LoadSequentialFile(ctx, path, layer, "float inputs"));
  if (loaded) return std::move(*loaded);
  QCAL_LOG_WARN("block {}: {} is missing; recomputing it through float blocks 0..{}", layer,
                path, layer - 1);
  QCAL_ASSIGN_OR_RETURN(at::Tensor x, EmbeddedCalibrationInputs(ctx));
  for (int64_t l = 0; l < layer; ++l) {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, ctx->source->LoadBlockWeights(l));
    QCAL_RETURN_IF_ERROR(ctx->method->transform().PrepareBlock(l, &w));
    QCAL_ASSIGN_OR_RETURN(x, ctx->method->sequential().PropagateFloatBlock(
                                 std::move(w), l, x, ctx->source->rope(),
                                 ctx->spec.calib_batch()));
  }
  return x;
}

// The calibration inputs of block `layer` of a sequential method (see QuantizeBlockStep).
StatusOr<at::Tensor> SequentialInputs(JobContext* ctx, int64_t layer) {
  const int64_t blocks = ctx->config.num_hidden_layers;
  auto embedded = [&]() { return EmbeddedCalibrationInputs(ctx); };
  if (layer == 0) return embedded();
  const std::string path = JobPaths(ctx->spec.job_dir()).SequentialInputs(layer);
  QCAL_ASSIGN_OR_RETURN(std::optional<at::Tensor> loaded,
                        LoadSequentialFile(ctx, path, layer, "calibration inputs"));
  if (loaded) return std::move(*loaded);
  // Gone (removed after block `layer` was done once, which is now being redone): rebuild from the
  // embedding through the quantized blocks before it, as committed in out_dir.
  QCAL_LOG_WARN("block {}: {} is missing; recomputing it through blocks 0..{} read back from {}",
                layer, path, layer - 1, ctx->spec.out_dir());
  QCAL_ASSIGN_OR_RETURN(at::Tensor x, embedded());
  std::vector<std::string> shards;
  for (int64_t l = 0; l < layer; ++l) shards.push_back(ShardName(l + 1, blocks));
  auto ckpt = CheckpointReader::OpenShards(ctx->spec.out_dir(), shards);
  if (!ckpt.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, ": no calibration inputs (", path,
        ") and the earlier blocks cannot be read back: ", ckpt.status().message()));
  }
  for (int64_t l = 0; l < layer; ++l) {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w,
                          ctx->method->block_format().LoadBlock(**ckpt, l));
    QCAL_ASSIGN_OR_RETURN(x, ctx->method->sequential().PropagateFinishedBlock(
                                 std::move(w), l, x, ctx->source->rope(),
                                 ctx->spec.calib_batch()));
  }
  return x;
}

Status SaveSequentialInputs(JobContext* ctx, int64_t layer, const at::Tensor& x,
                            const at::Tensor* x_float) {
  const JobPaths paths(ctx->spec.job_dir());
  QCAL_RETURN_IF_ERROR(MakeDirs(paths.sequential));
  QCAL_RETURN_IF_ERROR(
      calib::SaveActivation(paths.SequentialInputs(layer + 1), x, ctx->calib_key));
  if (x_float != nullptr) {
    QCAL_RETURN_IF_ERROR(calib::SaveActivation(paths.SequentialFloatInputs(layer + 1), *x_float,
                                               ctx->calib_key));
  }
  return absl::OkStatus();
}

void DropSequentialInputs(JobContext* ctx, int64_t layer) {
  const JobPaths paths(ctx->spec.job_dir());
  std::remove(paths.SequentialInputs(layer - 1).c_str());
  std::remove(paths.SequentialFloatInputs(layer - 1).c_str());
}

}  // namespace qcal::job
