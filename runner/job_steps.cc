#include "runner/job_steps.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "runner/input_fingerprint.h"
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "runner/job_inputs.h"
#include "runner/journal.h"
#include "common/log.h"
#include "common/phase_trace.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "kernels/gpu_backend.h"
#include "methods/method_factory.h"
#include "engine/calib/calibration.h"
#include "engine/eval/perplexity.h"
#include "engine/model/activation_store.h"
#include "engine/model/block_walk.h"
#include "engine/model/tensor_io.h"
#include "engine/quant/finetune.h"
#include "runner/budgets.h"
#include "runner/phase_products.h"
#include "runner/sequential_store.h"
#include "runner/shard_writers.h"

namespace qcal::job {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Emit(const JobEventFn& on_event, const std::string& phase, int64_t done, int64_t total,
          std::string message = "") {
  if (on_event) on_event(JobEvent{phase, done, total, std::move(message)});
}

std::string Resolve(const std::string& root, const std::string& path) {
  return !path.empty() && path[0] == '/' ? path : root + "/" + path;
}

}  // namespace

void AddMetrics(const std::vector<quant::LinearMetrics>& linears, v1::BlockResult* out) {
  for (const quant::LinearMetrics& m : linears) {
    v1::LinearMetrics* p = out->add_metrics();
    p->set_name(m.name);
    p->set_proxy_loss(m.proxy_loss);
    p->set_relative(m.relative);
    p->set_code_bits(m.code_bits);
    p->set_stored_bits(m.stored_bits);
    p->set_seconds(m.seconds);
  }
}

QuantizeJobOptions OptionsForSpec(const v1::JobSpec& spec) {
  QuantizeJobOptions o;
  o.model_dir = spec.model_dir();
  o.out_dir = spec.out_dir();
  o.job_dir = spec.job_dir();
  o.data_root = spec.data_root();
  o.recipe_source = spec.recipe_path().empty() ? "job spec recipe" : spec.recipe_path();
  o.calib_batch = spec.calib_batch();
  o.threads = spec.threads_per_worker();
  o.max_memory = spec.max_memory_bytes();
  ResolveDefaults(&o);
  return o;
}

v1::JobSpec SpecForOptions(const QuantizeJobOptions& options) {
  v1::JobSpec spec;
  spec.set_recipe_path(options.recipe_source);
  spec.set_model_dir(options.model_dir);
  spec.set_out_dir(options.out_dir);
  spec.set_job_dir(options.job_dir);
  spec.set_data_root(options.data_root);
  spec.set_workers(1);
  return spec;
}

void ResolveDefaults(QuantizeJobOptions* options) {
  options->job_dir = JobDirFor(options->job_dir, options->out_dir);
  options->data_root = DataRootOr(options->data_root);
  if (options->calib_batch < 1) options->calib_batch = 8;
  if (options->max_memory <= 0) options->max_memory = model::DefaultMaxMemory();
}

StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe,
                                              const QuantizeJobOptions& options) {
  auto ctx = std::make_unique<JobContext>();
  ctx->recipe = recipe;
  ctx->options = options;
  ResolveDefaults(&ctx->options);
  QCAL_ASSIGN_OR_RETURN(ctx->source, model::OpenFloatCheckpoint(options.model_dir));
  ctx->config = ctx->source->config();
  QCAL_ASSIGN_OR_RETURN(ctx->method, methods::MakeMethod(recipe, ctx->config));
  ctx->gpu = kernels::ActiveGpuBackend();
  // Every phase of the job records the device's peak memory beside the host's (-1 on a CPU
  // rank). The probe asks the process's backend when it runs, so a backend a test swaps later
  // is never called after it is gone.
  // LibTorch's work (fine-tuning) goes where the rank's GPU is when this build's LibTorch can
  // reach it (a CUDA LibTorch: scripts/device-build.sh); Debian's LibTorch has no CUDA, so there
  // a GPU rank fine-tunes on the host as before.
  ctx->torch_device = at::Device(at::kCPU);
  if (ctx->gpu != nullptr && ctx->gpu->cuda_device() >= 0 && at::hasCUDA()) {
    ctx->torch_device =
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(ctx->gpu->cuda_device()));
  }
  if (ctx->gpu != nullptr) {
    QCAL_LOG_INFO("LibTorch work (fine-tuning) on {}", ctx->torch_device.str());
    SetDevicePeakProbe([] {
      kernels::GpuBackend* gpu = kernels::ActiveGpuBackend();
      return gpu != nullptr ? gpu->TakePeakDeviceBytes() : int64_t{-1};
    });
  } else {
    SetDevicePeakProbe(nullptr);
  }
  if (ctx->gpu == nullptr && recipe.calibration.precision != "fp32") {
    return absl::FailedPreconditionError(absl::StrCat(
        options.recipe_source, ": calibration.precision ", recipe.calibration.precision,
        " is the arithmetic of the GPU's calibration forward, and this rank has no GPU (the CPU "
        "computes in fp32: use --device cuda, or precision fp32)"));
  }
  model::SetComputeThreads(options.threads > 0 ? options.threads
                                               : model::AutoComputeThreads(ctx->config));
  std::string capped;
  ctx->seq_len = CalibrationSeqLen(recipe, ctx->config, &capped);
  if (!capped.empty()) QCAL_LOG_WARN("{}", capped);
  if (ctx->options.inputs_key.empty()) {
    QCAL_ASSIGN_OR_RETURN(InputsFingerprint inputs,
                          FingerprintInputs(recipe, options.model_dir, ctx->options.data_root,
                                            JobPaths(ctx->options.job_dir).inputs));
    ctx->options.inputs_key = inputs.key;
  }
  ctx->calib_key = calib::CalibrationKey(ctx->options.inputs_key, ctx->config,
                                         recipe.calibration, ctx->seq_len);
  return ctx;
}

int64_t CalibrationSeqLen(const Recipe& recipe, const LlamaConfig& config, std::string* note) {
  const int64_t asked = recipe.calibration.seq_len;
  const int64_t context = config.max_position_embeddings;
  if (asked <= context) return asked;
  if (note) {
    *note = absl::StrCat("calibration.seq_len ", asked, " is longer than the model's context (",
                         "max_position_embeddings ", context, "): calibrating on sequences of ",
                         context, " tokens");
  }
  return context;
}

Status EnsureCalibrationTokens(JobContext* ctx) {
  if (ctx->tokens.defined()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(ctx->options.model_dir));
  QCAL_ASSIGN_OR_RETURN(
      ctx->tokens,
      calib::SampleCalibrationTokens(*tokenizer, ctx->recipe.calibration, ctx->options.data_root,
                                     ctx->seq_len, tokenizer->bos_id()));
  ctx->bos_id = tokenizer->bos_id();
  return absl::OkStatus();
}

calib::CalibrationDirs CalibrationDirsOf(const std::string& job_dir) {
  const JobPaths paths(job_dir);
  return {paths.hessians, paths.activations, paths.spill};
}


namespace {

// One global phase (see CalibrateStep). Collective.
Status GlobalPhaseStep(comm::Comm& comm, JobContext* ctx, const std::string& phase,
                       const JobEventFn& on_event) {
  const std::string path = JobPaths(ctx->options.job_dir).PhaseProducts(phase);
  int64_t reuse = 0;
  if (comm.rank() == 0) {
    auto cached = LoadPhaseProducts(path, phase, ctx->calib_key);
    reuse = cached.ok() ? 1 : 0;
    if (!cached.ok() && !absl::IsNotFound(cached.status())) {
      QCAL_LOG_WARN("phase {}: {}; running it again", phase,
                    std::string(cached.status().message()));
    }
  }
  QCAL_RETURN_IF_ERROR(comm.Broadcast(&reuse, sizeof(reuse), 0));
  if (reuse) {
    Emit(on_event, "phase", 1, 1, absl::StrCat(phase, " (cached)"));
    return Status();
  }
  Emit(on_event, "phase", 0, 1, phase);
  methods::GlobalPhaseInputs in;
  in.comm = &comm;
  in.source = ctx->source.get();
  in.tokens = &ctx->tokens;
  in.batch = ctx->options.calib_batch;
  in.bos_id = ctx->bos_id;
  in.max_memory = ctx->options.max_memory;
  in.state_dir = JobPaths(ctx->options.job_dir).phases;
  in.state_key = ctx->calib_key;
  StatusOr<methods::PhaseProducts> products = [&]() -> StatusOr<methods::PhaseProducts> {
    QCAL_ASSIGN_OR_RETURN(const methods::GlobalPhase* part, ctx->method->phase(phase));
    return part->Run(in);
  }();
  Status saved = products.status();
  if (saved.ok() && comm.rank() == 0) {
    saved = MakeDirs(JobPaths(ctx->options.job_dir).phases);
    if (saved.ok()) saved = SavePhaseProducts(path, *products, phase, ctx->calib_key);
  }
  int64_t failed = saved.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!saved.ok()) return Annotate(saved, absl::StrCat("phase ", phase));
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat("phase ", phase, " failed on another rank"));
  }
  Emit(on_event, "phase", 1, 1, phase);
  return Status();
}

}  // namespace

namespace {
// The Hessian / activation walk of CalibrateStep (below); `parts`: where its time went.
Status CalibrationWalk(comm::Comm& comm, JobContext* ctx, bool hessians, bool activations,
                       const JobEventFn& on_event, v1::CalibrateResult* out,
                       std::vector<std::pair<std::string, double>>* parts);
}  // namespace

StatusOr<v1::CalibrateResult> CalibrateStep(comm::Comm& comm, JobContext* ctx,
                                            const v1::CalibrateParams& params,
                                            const JobEventFn& on_event) {
  // Every rank takes rank 0's decision, so all walk the same collectives.
  int64_t flags[3] = {params.hessians(), params.activations(), params.phases()};
  QCAL_RETURN_IF_ERROR(comm.Broadcast(flags, sizeof(flags), 0));
  PhaseTrace trace;
  // Sampling reads the data files: a failure on one rank (a file missing on its host) must not
  // leave the others waiting in a collective.
  trace.Begin("tokens");
  const Status sampled = EnsureCalibrationTokens(ctx);
  int64_t failed = sampled.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!sampled.ok()) return sampled;
  if (failed > 0) {
    return absl::AbortedError("another rank could not sample the calibration data");
  }
  v1::CalibrateResult result;
  result.set_tokens(ctx->tokens.numel());
  result.set_rank(comm.rank());
  result.set_ranks(comm.size());
  const std::string walk = flags[0] ? "hessians" : "activations";
  std::vector<std::pair<std::string, double>> walk_parts;
  if (flags[0] || flags[1]) {
    // The walk: forward passes, Hessian sums and their reduction, cache files.
    trace.Begin(walk);
    QCAL_RETURN_IF_ERROR(CalibrationWalk(comm, ctx, flags[0] != 0, flags[1] != 0, on_event,
                                         &result, &walk_parts));
  }
  if (flags[2]) {
    for (const std::string& phase : ctx->recipe.needs().global_phases) {
      trace.Begin(absl::StrCat("phase ", phase));
      QCAL_RETURN_IF_ERROR(GlobalPhaseStep(comm, ctx, phase, on_event));
    }
  }
  trace.End();
  trace.AppendTo(result.mutable_phases());
  for (const auto& [part, seconds] : walk_parts) {
    AppendPhasePart(result.mutable_phases(), walk, part, seconds);
  }
  return result;
}

namespace {

Status CalibrationWalk(comm::Comm& comm, JobContext* ctx, bool hessians, bool activations,
                       const JobEventFn& on_event, v1::CalibrateResult* out,
                       std::vector<std::pair<std::string, double>>* parts) {
  v1::CalibrateResult& result = *out;
  const int64_t flags[2] = {hessians, activations};
  calib::CalibrationOptions options;
  options.batch = ctx->options.calib_batch;
  options.hessians = flags[0];
  options.activations = flags[1];
  options.keep_hessians = false;  // block tasks read them from the job directory
  options.memory_budget_bytes = ActivationBudget(*ctx);
  options.device_sum = ctx->options.device_sum;
  options.gpu = ctx->gpu;
  options.precision = calib::ForwardPrecision(ctx->recipe.calibration);
  if (options.hessians) {
    QCAL_ASSIGN_OR_RETURN(options.shard_hessians, ShardHessians(comm, *ctx));
  }
  const int64_t blocks = ctx->config.num_hidden_layers;
  // One walk produces both products; its progress is reported as "calibrate" (Hessians), and
  // the activations as their own phase ("activations"), as the single-process job always did.
  const std::string walk_phase = options.hessians ? "calibrate" : "activations";
  Emit(on_event, walk_phase, 0, blocks,
       options.shard_hessians
           ? absl::StrCat("Hessian sums sharded over ", comm.size(),
                          " ranks (a block's working set exceeds the memory budget)")
           : "");
  QCAL_ASSIGN_OR_RETURN(
      calib::CalibrationResult calib,
      calib::Calibrate(comm, *ctx->source, ctx->tokens, CalibrationDirsOf(ctx->options.job_dir),
                       ctx->calib_key, options,
                       [&](int64_t d, int64_t t) { Emit(on_event, walk_phase, d, t); }));
  if (options.hessians && options.activations) {
    Emit(on_event, "activations", blocks, blocks,
         calib.activations_from_cache ? "cached" : "saved in the calibration pass");
  }
  result.set_tokens(calib.tokens);
  result.set_seconds(calib.seconds);
  result.set_hessians_from_cache(calib.from_cache);
  result.set_activations_from_cache(calib.activations_from_cache);
  *parts = {{"read weights", calib.read_seconds},
            {"forward", calib.forward_seconds},
            {"reduce", calib.reduce_seconds},
            {"save", calib.save_seconds}};
  return Status();
}

}  // namespace


StatusOr<v1::BlockResult> QuantizeBlockStep(JobContext* ctx, int64_t layer,
                                            const std::string& attempt,
                                            const JobEventFn& on_event) {
  const auto t0 = Clock::now();
  const LlamaConfig& config = ctx->config;
  const int64_t blocks = config.num_hidden_layers;
  if (layer < 0 || layer >= blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " does not exist (the model has ", blocks, ")"));
  }
  const MethodNeeds needs = ctx->recipe.needs();
  const JobPaths paths(ctx->options.job_dir);
  PhaseTrace trace;

  // The method with its global phases' products, before anything is prepared.
  if (!needs.global_phases.empty()) trace.Begin("load phase products");
  QCAL_RETURN_IF_ERROR(BindPhaseProducts(ctx, layer));

  // The float block, streamed in and prepared by the method.
  trace.Begin("read weights");
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights weights, ctx->source->LoadBlockWeights(layer));
  trace.Begin("transform");
  QCAL_RETURN_IF_ERROR(ctx->method->transform().PrepareBlock(layer, &weights));
  trace.Begin("load calibration");

  methods::BlockInputs in;
  in.layer = layer;
  in.rope = &ctx->source->rope();
  in.batch = ctx->options.calib_batch;
  in.gpu = ctx->gpu;
  in.device = ctx->torch_device;
  if (on_event) {
    in.progress = [&on_event, layer](int64_t done, int64_t total, const std::string& step) {
      Emit(on_event, "block", done, total, absl::StrCat("block ", layer, ": ", step));
    };
  }
  calib::BlockHessians hessians;
  if (needs.float_hessians) {
    // Mapped: each kind's mean is made from the file when its first linear asks for it.
    auto h = calib::LoadBlockHessians(calib::HessianPath(paths.hessians, layer), ctx->calib_key,
                                      /*mapped=*/true);
    if (!h.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no usable Hessians (run calibration first): ", h.status().message()));
    }
    hessians = std::move(*h);
    in.hessians = &hessians;
  }
  at::Tensor ft_inputs, ft_targets;
  if (needs.float_activations) {
    const std::vector<int64_t> shape = {ctx->recipe.calibration.num_sequences, ctx->seq_len,
                                        config.hidden_size};
    auto inputs = calib::LoadActivation(calib::ActivationPath(paths.activations, layer),
                                        ctx->calib_key, shape);
    auto targets = inputs.ok()
                       ? calib::LoadActivation(calib::ActivationPath(paths.activations, layer + 1),
                                               ctx->calib_key, shape)
                       : inputs;
    if (!inputs.ok() || !targets.ok()) {
      const Status& s = inputs.ok() ? targets.status() : inputs.status();
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": no usable activations (run calibration first): ", s.message()));
    }
    ft_inputs = std::move(*inputs);
    ft_targets = std::move(*targets);
    in.ft_inputs = &ft_inputs;
    in.ft_targets = &ft_targets;
  }
  at::Tensor x;
  if (needs.sequential) {
    QCAL_ASSIGN_OR_RETURN(x, SequentialInputs(ctx, layer));
    in.x = &x;
    in.propagate = layer + 1 < blocks;
  }
  at::Tensor x_float;
  if (needs.sequential && needs.sequential_float) {
    QCAL_ASSIGN_OR_RETURN(x_float, SequentialFloatInputs(ctx, layer));
    in.x_float = &x_float;
  }
  trace.Begin("quantize");
  QCAL_RETURN_IF_ERROR(methods::CheckBlockInputs(in, needs));
  StatusOr<quant::BlockTaskResult> quantized =
      ctx->method->quantizer().QuantizeBlock(std::move(weights), in);
  if (!quantized.ok() && needs.float_hessians) {
    // A Hessian that is not positive definite even after damping, say, names the file it came
    // from (so a damaged or stale cache can be found and removed).
    return Annotate(quantized.status(),
                    absl::StrCat("block ", layer, " (Hessians from ",
                                 calib::HessianPath(paths.hessians, layer), ")"));
  }
  QCAL_RETURN_IF_ERROR(quantized.status());
  quant::BlockTaskResult task = std::move(*quantized);
  trace.Begin("write");
  if (in.propagate) QCAL_RETURN_IF_ERROR(SaveSequentialInputs(ctx, layer, x, in.x_float));
  if (needs.sequential && layer > 0) DropSequentialInputs(ctx, layer);

  v1::BlockResult result;
  result.set_layer(layer);
  if (needs.transforms_non_block && layer == 0) {
    QCAL_ASSIGN_OR_RETURN(*result.add_also_wrote(),
                          WritePreparedNonBlockShardStaged(ctx, attempt));
  }
  QCAL_ASSIGN_OR_RETURN(*result.mutable_shard(),
                        WriteBlockShardStaged(ctx, layer, task.weights, attempt));
  trace.End();
  trace.AppendTo(result.mutable_phases());
  // Where "quantize" went: the linears' rounding steps, summed, and the block's fine-tuning.
  double transform = 0, factor = 0, round = 0, refine = 0, proxy = 0;
  for (const quant::LinearMetrics& m : task.linears) {
    transform += m.transform_seconds;
    factor += m.factor_seconds;
    round += m.round_seconds;
    refine += m.refine_seconds;
    proxy += m.proxy_seconds;
  }
  for (const auto& [part, seconds] : {std::pair<const char*, double>{"transform", transform},
                                      {"factor", factor},
                                      {"round", round},
                                      {"refine", refine},
                                      {"proxy loss", proxy},
                                      {"fine-tune", task.finetune_seconds}}) {
    AppendPhasePart(result.mutable_phases(), "quantize", part, seconds);
  }
  result.set_seconds(Seconds(t0));
  result.set_mse_before_ft(task.mse_before_ft);
  result.set_mse_after_ft(task.mse_after_ft);
  for (const quant::FinetuneCurve& c : task.ft_curves) {
    v1::FinetuneCurve* curve = result.add_ft_curves();
    curve->mutable_heldout()->Add(c.heldout.begin(), c.heldout.end());
    curve->mutable_train()->Add(c.train.begin(), c.train.end());
  }
  AddMetrics(task.linears, &result);
  return result;
}

StatusOr<v1::FinetuneResult> FinetuneE2EStep(JobContext* ctx,
                                             const std::vector<v1::BlockResult>& blocks_done,
                                             const std::string& attempt,
                                             const JobEventFn& on_event) {
  const auto t0 = Clock::now();
  const LlamaConfig& config = ctx->config;
  const int64_t blocks = config.num_hidden_layers;
  QCAL_RETURN_IF_ERROR(EnsureCalibrationTokens(ctx));
  Emit(on_event, "finetune", 0, 1);
  std::map<int64_t, nlohmann::json> entries;
  for (const v1::BlockResult& b : blocks_done) entries[b.layer()] = BlockDoneEntry(b);
  for (int64_t l = 0; l < blocks; ++l) {
    if (entries.count(l) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "end-to-end fine-tuning: block ", l, " has no finished shard in ", ctx->options.out_dir));
    }
  }
  const FinetuneStage& stage = ctx->recipe.finetune.end_to_end;
  PhaseTrace trace;

  // The quantized blocks as committed; the student's non-block weights are the float model's.
  trace.Begin("read blocks");
  std::vector<model::BlockWeights> qblocks;
  {
    std::vector<std::string> shards;
    for (int64_t l = 0; l < blocks; ++l) shards.push_back(ShardName(l + 1, blocks));
    QCAL_ASSIGN_OR_RETURN(auto qckpt, CheckpointReader::OpenShards(ctx->options.out_dir, shards));
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_ASSIGN_OR_RETURN(model::BlockWeights w,
                            ctx->method->block_format().LoadBlock(*qckpt, l));
      qblocks.push_back(std::move(w));
    }
  }
  QCAL_ASSIGN_OR_RETURN(model::NonBlockWeights non_block, ctx->source->LoadNonBlock());
  QCAL_ASSIGN_OR_RETURN(quant::TunableModel tuned,
                        quant::AssembleTunableModel(config, non_block, std::move(qblocks)));

  // The teacher's final hidden states, one float block in memory at a time, in chunks of the
  // stage's batch (the chunks a whole-model forward would run).
  trace.Begin("teacher forward");
  quant::TeacherOutputs teacher;
  {
    at::NoGradGuard no_grad;
    const int64_t n = ctx->tokens.size(0), batch = std::max<int64_t>(1, stage.batch);
    std::vector<at::Tensor> ids;
    for (int64_t b = 0; b < n; b += batch) {
      ids.push_back(ctx->tokens.narrow(0, b, std::min(n, b + batch) - b));
    }
    QCAL_RETURN_IF_ERROR(MakeDirs(JobPaths(ctx->options.job_dir).spill));
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::BlockWalk> walk,
                          model::BlockWalk::Embed(*ctx->source, ids, ActivationBudget(*ctx),
                                                  JobPaths(ctx->options.job_dir).spill +
                                                      "/teacher.f32"));
    for (int64_t l = 0; l < blocks; ++l) {
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
  trace.Begin("fine-tune");
  StatusOr<quant::EndToEndResult> e2e = quant::FinetuneEndToEnd(
      ctx->method->FinetuneOptionsFor(stage), &tuned, teacher, ctx->tokens);
  ctx->source->ReleaseHead();
  QCAL_RETURN_IF_ERROR(e2e.status());

  trace.Begin("write");
  v1::FinetuneResult result;
  for (int64_t l = 0; l < blocks; ++l) {
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
  result.set_seconds(Seconds(t0));
  Emit(on_event, "finetune", 1, 1);
  return result;
}

StatusOr<v1::EvalResult> EvaluateStep(JobContext* ctx, const v1::EvalParams& params,
                                      const JobEventFn& on_event) {
  const bool quantized = params.model() == "quantized";
  if (!quantized && params.model() != "float") {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: model '", params.model(), "' is neither float nor quantized"));
  }
  const std::string dir = quantized ? ctx->options.out_dir : ctx->options.model_dir;
  std::unique_ptr<model::ModelSource> source;
  if (quantized) {
    QCAL_ASSIGN_OR_RETURN(source, methods::OpenModel(dir));
  } else {
    QCAL_ASSIGN_OR_RETURN(source, model::OpenFloatCheckpoint(dir));
  }
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(dir));
  QCAL_ASSIGN_OR_RETURN(std::string text,
                        ReadTextFile(Resolve(ctx->options.data_root, params.path())));
  eval::PerplexityOptions opt;
  opt.ctx = params.ctx();
  opt.max_tokens = params.max_tokens();
  opt.bos_per_window = params.bos_per_window();
  opt.bos_id = tokenizer->bos_id();
  eval::StreamOptions stream;
  stream.memory_budget_bytes = ActivationBudget(*ctx);
  stream.device = ctx->torch_device;
  QCAL_RETURN_IF_ERROR(MakeDirs(JobPaths(ctx->options.job_dir).spill));
  stream.spill_path =
      absl::StrCat(JobPaths(ctx->options.job_dir).spill, "/eval-", params.model(), "-",
                   params.label(), ".f32");
  const std::string phase = absl::StrCat("eval ", params.label(), " ", params.model());
  stream.block_progress = [&](int64_t d, int64_t t) { Emit(on_event, phase, d, t); };
  QCAL_ASSIGN_OR_RETURN(eval::PerplexityResult r,
                        eval::EvaluatePerplexityStreamed(*source, tokenizer->Encode(text), opt,
                                                         stream));
  v1::EvalResult result;
  *result.mutable_params() = params;
  result.set_tokens(r.tokens_encoded);
  result.set_scored(r.tokens_scored);
  result.set_windows(r.windows);
  result.set_perplexity(r.perplexity);
  result.set_mean_nll(r.mean_nll);
  result.set_seconds(r.seconds);
  return result;
}

}  // namespace qcal::job
