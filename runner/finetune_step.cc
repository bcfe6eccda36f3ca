// FinetuneE2EStep: end-to-end fine-tuning of every quantized block against the float model's
// outputs (runner/job_steps.h).
#include "runner/job_steps.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_layout.h"
#include "common/phase_trace.h"
#include "common/safe_fs.h"
#include "engine/model/block_walk.h"
#include "engine/quant/finetune.h"
#include "runner/budgets.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/shard_writers.h"
#include "runner/step_util.h"

namespace qcal::job {
namespace {

// The student: the quantized blocks as committed (every block must have a finished shard), the
// non-block weights the float model's.
StatusOr<quant::TunableModel> LoadStudent(JobContext* ctx,
                                          const std::vector<v1::BlockResult>& blocks_done) {
  const int64_t blocks = ctx->config.num_hidden_layers;
  std::map<int64_t, nlohmann::json> entries;
  for (const v1::BlockResult& b : blocks_done) entries[b.layer()] = BlockDoneEntry(b);
  std::vector<std::string> shards;
  for (int64_t l = 0; l < blocks; ++l) {
    if (entries.count(l) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "end-to-end fine-tuning: block ", l, " has no finished shard in ", ctx->spec.out_dir()));
    }
    shards.push_back(ShardName(l + 1, blocks));
  }
  std::vector<model::BlockWeights> qblocks;
  QCAL_ASSIGN_OR_RETURN(auto qckpt, CheckpointReader::OpenShards(ctx->spec.out_dir(), shards));
  for (int64_t l = 0; l < blocks; ++l) {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, ctx->method->block_format().LoadBlock(*qckpt, l));
    qblocks.push_back(std::move(w));
  }
  QCAL_ASSIGN_OR_RETURN(model::NonBlockWeights non_block, ctx->source->LoadNonBlock());
  return quant::AssembleTunableModel(ctx->config, non_block, std::move(qblocks));
}

// The teacher's final hidden states, one float block in memory at a time, in chunks of `batch`
// sequences (the chunks a whole-model forward would run), and its head. The caller releases the
// head (ModelSource::ReleaseHead) when done.
StatusOr<quant::TeacherOutputs> TeacherOutputsOf(JobContext* ctx, int64_t batch) {
  quant::TeacherOutputs teacher;
  {
    at::NoGradGuard no_grad;
    const int64_t n = ctx->tokens.size(0);
    std::vector<at::Tensor> ids;
    for (int64_t b = 0; b < n; b += batch) {
      ids.push_back(ctx->tokens.narrow(0, b, std::min(n, b + batch) - b));
    }
    const JobPaths paths(ctx->spec.job_dir());
    QCAL_RETURN_IF_ERROR(MakeDirs(paths.spill));
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::BlockWalk> walk,
                          model::BlockWalk::Embed(*ctx->source, ids, ActivationBudget(*ctx),
                                                  paths.spill + "/teacher.f32"));
    for (int64_t l = 0; l < ctx->config.num_hidden_layers; ++l) {
      QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::DecoderBlock> block,
                            ctx->source->LoadBlock(l));
      QCAL_RETURN_IF_ERROR(walk->Forward(*block, ctx->source->rope()));
    }
    std::vector<at::Tensor> chunks;
    for (int64_t c = 0; c < walk->chunks(); ++c) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor x, walk->store().Get(c));
      chunks.push_back(x);
    }
    teacher.hidden = at::cat(chunks, 0);
  }
  QCAL_ASSIGN_OR_RETURN(const model::ModelSource::LoadedHead head, ctx->source->Head());
  teacher.final_norm = head.final_norm;
  teacher.head = head.head;
  return teacher;
}

}  // namespace

StatusOr<v1::FinetuneResult> FinetuneE2EStep(JobContext* ctx,
                                             const std::vector<v1::BlockResult>& blocks_done,
                                             const std::string& attempt,
                                             const JobEventFn& on_event) {
  const auto t0 = step::Clock::now();
  QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
  step::Emit(on_event, "finetune", 0, 1);
  const FinetuneStage& stage = ctx->recipe.finetune.end_to_end;
  PhaseTrace trace;
  trace.Begin("read blocks");
  QCAL_ASSIGN_OR_RETURN(quant::TunableModel tuned, LoadStudent(ctx, blocks_done));
  trace.Begin("teacher forward");
  QCAL_ASSIGN_OR_RETURN(const quant::TeacherOutputs teacher,
                        TeacherOutputsOf(ctx, std::max<int64_t>(1, stage.batch)));
  trace.Begin("fine-tune");
  StatusOr<quant::EndToEndResult> e2e = quant::FinetuneEndToEnd(
      ctx->method->FinetuneOptionsFor(stage), &tuned, teacher, ctx->tokens);
  ctx->source->ReleaseHead();
  QCAL_RETURN_IF_ERROR(e2e.status());

  trace.Begin("write");
  v1::FinetuneResult result;
  for (int64_t l = 0; l < ctx->config.num_hidden_layers; ++l) {
    QCAL_ASSIGN_OR_RETURN(*result.add_shards(),
                          WriteBlockShardStaged(ctx, l, tuned.model->block(l).weights(), attempt));
  }
  QCAL_ASSIGN_OR_RETURN(*result.add_shards(),
                        WriteTunedNonBlockShardStaged(ctx, tuned.final_norm, tuned.head,
                                                      tuned.head_tied, attempt));
  result.set_kl_before(e2e->heldout_kl_before);
  result.set_kl_after(e2e->heldout_kl_after);
  result.set_best_epoch(e2e->best_epoch);
  result.set_head_tuned(e2e->head_tuned);
  trace.End();
  trace.AppendTo(result.mutable_phases());
  result.set_seconds(step::Seconds(t0));
  step::Emit(on_event, "finetune", 1, 1);
  return result;
}

}  // namespace qcal::job
