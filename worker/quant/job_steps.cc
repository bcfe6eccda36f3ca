#include "worker/quant/job_steps.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/job_layout.h"
#include "common/log.h"
#include "common/tokenizer.h"
#include "worker/calib/calibration.h"
#include "worker/quant/finetune.h"
#include "worker/quant/quantized_checkpoint.h"
#include "worker/quarot/checkpoint.h"
#include "worker/quarot/quarot_model.h"
#include "worker/quarot/rotate.h"

namespace qcal::quant {
namespace {

nlohmann::json FiniteOrNull(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

// The block_done journal entry of a block whose shard was just written to `path`.
StatusOr<nlohmann::json> BlockDoneEntry(int64_t layer, const std::string& shard,
                                        const std::string& path, const BlockTaskResult& task) {
  QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  return nlohmann::json{{"event", "block_done"},
                        {"layer", layer},
                        {"shard", shard},
                        {"bytes", bytes.size()},
                        {"checksum", Fnv1aHex(bytes)},
                        {"seconds", task.seconds},
                        {"mse_before_ft", FiniteOrNull(task.mse_before_ft)},
                        {"mse_after_ft", FiniteOrNull(task.mse_after_ft)},
                        {"metrics", MetricsToJson(task.linears)}};
}

void Emit(const JobEventFn& on_event, const std::string& phase, int64_t done, int64_t total,
          std::string message = "") {
  if (on_event) on_event(JobEvent{phase, done, total, std::move(message)});
}

// Shard 0 with the tuned final norm (and untied head); embeddings copied from the float model.
Status WriteTunedNonBlockShard(const std::string& path, CheckpointReader& float_ckpt,
                               const TunableModel& tuned) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  const std::string embed_name = "model.embed_tokens.weight";
  QCAL_ASSIGN_OR_RETURN(auto found, float_ckpt.Find(embed_name));
  QCAL_ASSIGN_OR_RETURN(std::vector<float> embed, found.first->ReadF32(embed_name));
  QCAL_RETURN_IF_ERROR(writer.AddF32(embed_name, found.second->shape, embed.data()));
  auto add = [&](const std::string& name, const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kFloat).contiguous();
    return writer.AddF32(name, c.sizes().vec(), c.data_ptr<float>());
  };
  QCAL_RETURN_IF_ERROR(add("model.norm.weight", tuned.final_norm));
  if (!tuned.head_tied) QCAL_RETURN_IF_ERROR(add("lm_head.weight", tuned.head));
  return writer.Write(path);
}

}  // namespace

nlohmann::json MetricsToJson(const std::vector<LinearMetrics>& linears) {
  nlohmann::json arr = nlohmann::json::array();
  for (const LinearMetrics& m : linears) {
    arr.push_back({{"name", m.name},
                   {"proxy_loss", FiniteOrNull(m.proxy_loss)},
                   {"relative", FiniteOrNull(m.relative)},
                   {"code_bits", m.code_bits},
                   {"stored_bits", m.stored_bits},
                   {"seconds", m.seconds}});
  }
  return arr;
}

std::vector<LinearMetrics> MetricsFromJson(const nlohmann::json& arr) {
  std::vector<LinearMetrics> out;
  if (!arr.is_array()) return out;
  for (const auto& j : arr) {
    LinearMetrics m;
    m.name = j.value("name", "");
    m.proxy_loss = j.contains("proxy_loss") && j["proxy_loss"].is_number()
                       ? j["proxy_loss"].get<double>()
                       : std::nan("");
    m.relative = j.contains("relative") && j["relative"].is_number() ? j["relative"].get<double>()
                                                                     : std::nan("");
    m.code_bits = j.value("code_bits", 0.0);
    m.stored_bits = j.value("stored_bits", 0.0);
    m.seconds = j.value("seconds", 0.0);
    out.push_back(m);
  }
  return out;
}

StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe,
                                              const QuantizeJobOptions& options) {
  auto ctx = std::make_unique<JobContext>();
  ctx->recipe = recipe;
  ctx->options = options;
  if (ctx->options.job_dir.empty()) ctx->options.job_dir = ctx->options.out_dir + ".job";
  if (ctx->options.data_root.empty()) ctx->options.data_root = "../shared";
  if (ctx->options.calib_batch < 1) ctx->options.calib_batch = 8;
  QCAL_ASSIGN_OR_RETURN(ctx->config, LoadLlamaConfig(options.model_dir));
  QCAL_ASSIGN_OR_RETURN(ctx->model, model::LlamaModel::Load(options.model_dir));
  model::SetComputeThreads(options.threads > 0 ? options.threads
                                               : model::AutoComputeThreads(ctx->config));
  QCAL_ASSIGN_OR_RETURN(ctx->float_ckpt, CheckpointReader::Open(options.model_dir));
  ctx->seq_len = std::min(recipe.calibration.seq_len, ctx->config.max_position_embeddings);
  ctx->calib_key = calib::CalibrationKey(options.model_dir, ctx->config, recipe.calibration,
                                         ctx->options.data_root, ctx->seq_len);
  return ctx;
}

Status EnsureCalibrationTokens(JobContext* ctx) {
  if (ctx->tokens.defined()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(ctx->options.model_dir));
  QCAL_ASSIGN_OR_RETURN(
      ctx->tokens,
      calib::SampleCalibrationTokens(*tokenizer, ctx->recipe.calibration, ctx->options.data_root,
                                     ctx->seq_len, tokenizer->bos_id()));
  return absl::OkStatus();
}

CalibrateNeeds NeedsFor(const Recipe& recipe, bool all_blocks_finished) {
  CalibrateNeeds needs;
  if (recipe.calibrated_by_block_tasks()) {
    needs.hessians = needs.activations = needs.keep_hessians = false;
    return needs;
  }
  needs.hessians = recipe.needs_hessians() && !all_blocks_finished;
  needs.activations = recipe.finetune.enabled && !all_blocks_finished;
  return needs;
}

nlohmann::json CalibrateStepResult::ToJson() const {
  return {{"tokens", tokens},
          {"seconds", seconds},
          {"hessians_from_cache", hessians_from_cache},
          {"activations_from_cache", activations_from_cache}};
}

StatusOr<CalibrateStepResult> CalibrateStep(runtime::Comm& comm, JobContext* ctx,
                                            const CalibrateNeeds& needs,
                                            const JobEventFn& on_event) {
  // Every rank takes rank 0's decision, so all walk the same collectives.
  int64_t flags[3] = {needs.hessians, needs.activations, needs.keep_hessians};
  QCAL_RETURN_IF_ERROR(comm.Broadcast(flags, sizeof(flags), 0));
  // Sampling reads the data files: a failure on one rank (a file missing on its host) must not
  // leave the others waiting in a collective.
  const Status sampled = EnsureCalibrationTokens(ctx);
  int64_t failed = sampled.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!sampled.ok()) return sampled;
  if (failed > 0) {
    return absl::AbortedError("calibration: another rank could not sample the calibration data");
  }
  CalibrateStepResult result;
  result.tokens = ctx->tokens.numel();
  if (!flags[0] && !flags[1]) return result;
  calib::CalibrationOptions options;
  options.batch = ctx->options.calib_batch;
  options.hessians = flags[0];
  options.activations = flags[1];
  options.keep_hessians = flags[0] && flags[2];
  const int64_t blocks = ctx->config.num_hidden_layers;
  // One walk produces both products; its progress is reported as "calibrate" (Hessians), and
  // the activations as their own phase ("activations"), as the single-process job always did.
  const std::string walk_phase = options.hessians ? "calibrate" : "activations";
  Emit(on_event, walk_phase, 0, blocks);
  QCAL_ASSIGN_OR_RETURN(
      calib::CalibrationResult calib,
      calib::Calibrate(comm, *ctx->model, ctx->tokens, ctx->options.job_dir, ctx->calib_key,
                       options, [&](int64_t d, int64_t t) { Emit(on_event, walk_phase, d, t); }));
  if (options.hessians && options.activations) {
    Emit(on_event, "activations", blocks, blocks,
         calib.activations_from_cache ? "cached" : "saved in the calibration pass");
  }
  if (options.keep_hessians) ctx->hessians = std::move(calib.hessians);
  result.tokens = calib.tokens;
  result.seconds = calib.seconds;
  result.hessians_from_cache = calib.from_cache;
  result.activations_from_cache = calib.activations_from_cache;
  return result;
}

std::string QuarotInputsPath(const std::string& job_dir, int64_t layer) {
  return absl::StrCat(job_dir, "/quarot/inputs-", layer, ".safetensors");
}

namespace {

// QuantizeBlockStep for method quarot (see job_steps.h).
StatusOr<nlohmann::json> QuarotBlockStep(JobContext* ctx, int64_t layer) {
  const auto t0 = std::chrono::steady_clock::now();
  const Recipe& recipe = ctx->recipe;
  const int64_t blocks = ctx->config.num_hidden_layers;
  model::LlamaModel& model = *ctx->model;
  if (!ctx->rotated) {
    QCAL_ASSIGN_OR_RETURN(quarot::RotationPlan plan,
                          quarot::PlanRotations(recipe.rotation, ctx->config));
    QCAL_RETURN_IF_ERROR(quarot::PrepareModel(model, recipe, plan));
    ctx->rotation_plan = std::move(plan);
    ctx->rotated = true;
  }
  const quarot::RotationPlan& plan = ctx->rotation_plan;
  const std::string& job_dir = ctx->options.job_dir;
  const bool sequential = recipe.sequential_calibration();
  const std::vector<int64_t> shape = {recipe.calibration.num_sequences, ctx->seq_len,
                                      ctx->config.hidden_size};
  at::Tensor x;
  if (sequential) {
    if (layer == 0) {
      QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
      QCAL_ASSIGN_OR_RETURN(x, quarot::EmbedCalibrationTokens(model, recipe, ctx->tokens));
    } else {
      const std::string path = QuarotInputsPath(job_dir, layer);
      auto loaded = calib::LoadActivation(path, ctx->calib_key, shape);
      if (loaded.ok()) {
        x = std::move(*loaded);
      } else if (absl::IsNotFound(loaded.status())) {
        // Gone (removed after block `layer` was done once, which is now being redone): rebuild
        // from the embedding through the quantized blocks before it, as written in out_dir.
        QCAL_LOG_WARN("block {}: {} is missing; recomputing it through blocks 0..{} read back "
                      "from {}",
                      layer, path, layer - 1, ctx->options.out_dir);
        QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
        QCAL_ASSIGN_OR_RETURN(x, quarot::EmbedCalibrationTokens(model, recipe, ctx->tokens));
        std::vector<std::string> shards;
        for (int64_t l = 0; l < layer; ++l) shards.push_back(ShardName(l + 1, blocks));
        auto ckpt = CheckpointReader::OpenShards(ctx->options.out_dir, shards);
        if (!ckpt.ok()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "block ", layer, ": no calibration inputs (", path,
              ") and the earlier blocks cannot be read back: ", ckpt.status().message()));
        }
        for (int64_t l = 0; l < layer; ++l) {
          QCAL_ASSIGN_OR_RETURN(model::BlockWeights w,
                                quarot::LoadQuarotBlockWeights(**ckpt, ctx->config, l));
          model.mutable_block(l).mutable_weights() = std::move(w);
          QCAL_ASSIGN_OR_RETURN(x, quarot::PropagateFinishedBlock(model, plan, l, x,
                                                                  ctx->options.calib_batch));
        }
      } else {
        return absl::FailedPreconditionError(absl::StrCat(
            "block ", layer, ": unusable calibration inputs: ", loaded.status().message()));
      }
    }
  }
  const bool propagate = sequential && layer + 1 < blocks;
  QCAL_ASSIGN_OR_RETURN(
      BlockTaskResult task,
      quarot::QuantizeRotatedBlock(model, recipe, plan, layer, sequential ? &x : nullptr,
                                   ctx->options.calib_batch, propagate));
  if (propagate) {
    QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/quarot"));
    QCAL_RETURN_IF_ERROR(
        calib::SaveActivation(QuarotInputsPath(job_dir, layer + 1), x, ctx->calib_key));
  }
  if (sequential && layer > 0) {
    // Block l-1 is journaled (blocks are handed out in order): its inputs are no longer needed.
    std::remove(QuarotInputsPath(job_dir, layer - 1).c_str());
  }
  const std::string& out_dir = ctx->options.out_dir;
  QCAL_RETURN_IF_ERROR(MakeDirs(out_dir));
  nlohmann::json also = nlohmann::json::object();
  if (layer == 0) {
    const std::string shard0 = ShardName(0, blocks);
    QCAL_RETURN_IF_ERROR(
        quarot::WriteQuarotNonBlockShard(out_dir + "/" + shard0, model).status());
    QCAL_ASSIGN_OR_RETURN(std::string sum, FileChecksum(out_dir + "/" + shard0));
    also[shard0] = sum;
  }
  const std::string shard = ShardName(layer + 1, blocks);
  const std::string path = out_dir + "/" + shard;
  QCAL_RETURN_IF_ERROR(
      quarot::WriteQuarotBlockShard(path, layer, model.block(layer).weights()).status());
  task.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  QCAL_ASSIGN_OR_RETURN(nlohmann::json entry, BlockDoneEntry(layer, shard, path, task));
  if (!also.empty()) entry["also_wrote"] = also;
  return entry;
}

}  // namespace

StatusOr<nlohmann::json> QuantizeBlockStep(JobContext* ctx, int64_t layer) {
  const Recipe& recipe = ctx->recipe;
  const LlamaConfig& config = ctx->config;
  const int64_t blocks = config.num_hidden_layers;
  if (layer < 0 || layer >= blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " does not exist (the model has ", blocks, ")"));
  }
  if (recipe.method == QuantMethod::kQuarot) return QuarotBlockStep(ctx, layer);
  const std::string& job_dir = ctx->options.job_dir;
  // Hessians: kept in memory by this process's calibration, else from the job directory.
  calib::BlockHessians loaded;
  const calib::BlockHessians* hessians = nullptr;
  if (recipe.needs_hessians()) {
    if (static_cast<int64_t>(ctx->hessians.size()) == blocks) {
      hessians = &ctx->hessians[layer];
    } else {
      const std::string path = calib::HessianPath(job_dir, layer);
      auto h = calib::LoadBlockHessians(path, ctx->calib_key);
      if (!h.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("block ", layer,
                         ": no usable Hessians (run calibration first): ", h.status().message()));
      }
      loaded = std::move(*h);
      hessians = &loaded;
    }
  }
  model::LlamaModel& model = *ctx->model;
  BlockTaskResult task;
  if (recipe.finetune.enabled) {
    const std::vector<int64_t> shape = {recipe.calibration.num_sequences, ctx->seq_len,
                                        config.hidden_size};
    auto inputs =
        calib::LoadActivation(calib::ActivationPath(job_dir, layer), ctx->calib_key, shape);
    auto targets = inputs.ok() ? calib::LoadActivation(calib::ActivationPath(job_dir, layer + 1),
                                                       ctx->calib_key, shape)
                               : inputs;
    if (!inputs.ok() || !targets.ok()) {
      const Status& s = inputs.ok() ? targets.status() : inputs.status();
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no usable activations (run calibration first): ", s.message()));
    }
    QCAL_ASSIGN_OR_RETURN(
        task, QuantizeBlockWithFinetune(recipe, config, layer, model.block(layer).weights(),
                                        hessians, model.rope(), *inputs, *targets));
  } else {
    QCAL_ASSIGN_OR_RETURN(
        task, QuantizeBlock(recipe, config, layer, model.block(layer).weights(), hessians));
  }
  const std::string shard = ShardName(layer + 1, blocks);
  const std::string path = ctx->options.out_dir + "/" + shard;
  QCAL_RETURN_IF_ERROR(MakeDirs(ctx->options.out_dir));
  QCAL_RETURN_IF_ERROR(WriteBlockShard(path, layer, task.weights).status());
  return BlockDoneEntry(layer, shard, path, task);
}

StatusOr<nlohmann::json> FinetuneE2EStep(JobContext* ctx,
                                         const std::map<int64_t, nlohmann::json>& block_done,
                                         const JobEventFn& on_event) {
  const LlamaConfig& config = ctx->config;
  const int64_t blocks = config.num_hidden_layers;
  const std::string& out_dir = ctx->options.out_dir;
  QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
  Emit(on_event, "finetune", 0, 1);
  const BitsPerWeight bits = AggregateBits(config, block_done);
  const nlohmann::json quant_config =
      MakeQuantizationConfig(ctx->recipe, bits.code_bits, bits.stored_bits);
  const std::string shard0 = out_dir + "/" + ShardName(0, blocks);
  // Shard 0 and the index make out_dir readable as a checkpoint (config.json comes last).
  QCAL_RETURN_IF_ERROR(WriteNonBlockShard(shard0, *ctx->float_ckpt, config).status());
  QCAL_RETURN_IF_ERROR(WriteShardIndex(out_dir, blocks));
  std::vector<model::BlockWeights> qblocks;
  {
    LlamaConfig qconfig = config;
    qconfig.raw["quantization_config"] = quant_config;
    QCAL_ASSIGN_OR_RETURN(auto qckpt, CheckpointReader::Open(out_dir));
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadAnyBlockWeights(*qckpt, qconfig, l));
      qblocks.push_back(std::move(w));
    }
  }
  QCAL_ASSIGN_OR_RETURN(TunableModel tuned,
                        AssembleTunableModel(config, *ctx->float_ckpt, std::move(qblocks)));
  QCAL_ASSIGN_OR_RETURN(EndToEndResult e2e,
                        FinetuneEndToEnd(ctx->recipe, &tuned, *ctx->model, ctx->tokens));
  nlohmann::json checksums = nlohmann::json::object();
  for (int64_t l = 0; l < blocks; ++l) {
    const std::string name = ShardName(l + 1, blocks);
    QCAL_RETURN_IF_ERROR(
        WriteBlockShard(out_dir + "/" + name, l, tuned.model->block(l).weights()).status());
    QCAL_ASSIGN_OR_RETURN(checksums[name], FileChecksum(out_dir + "/" + name));
  }
  QCAL_RETURN_IF_ERROR(WriteTunedNonBlockShard(shard0, *ctx->float_ckpt, tuned));
  QCAL_ASSIGN_OR_RETURN(checksums[ShardName(0, blocks)], FileChecksum(shard0));
  Emit(on_event, "finetune", 1, 1);
  return nlohmann::json{{"event", "e2e_done"},
                        {"checksums", checksums},
                        {"kl_before", FiniteOrNull(e2e.heldout_kl_before)},
                        {"kl_after", FiniteOrNull(e2e.heldout_kl_after)},
                        {"best_epoch", e2e.best_epoch},
                        {"head_tuned", e2e.head_tuned},
                        {"seconds", e2e.seconds}};
}

}  // namespace qcal::quant
