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
#include "common/input_fingerprint.h"
#include "common/job_layout.h"
#include "common/log.h"
#include "common/phase_trace.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "kernels/gpu_backend.h"
#include "methods/method_factory.h"
#include "engine/calib/calibration.h"
#include "engine/eval/perplexity.h"
#include "engine/model/activation_store.h"
#include "engine/model/tensor_io.h"
#include "engine/quant/finetune.h"

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

// Bytes a block task holds besides activations: the block's fp32 weights twice (loaded and
// transformed or rounded) and the exact Hessian accumulators of its four inputs (16 bytes per
// entry of one triangle, plus the fp32 product and fp64 mean of the largest).
int64_t BlockParams(const LlamaConfig& c) {
  const int64_t h = c.hidden_size, ff = c.intermediate_size;
  return (c.q_dim() + 2 * c.kv_dim()) * h + h * c.q_dim() + 3 * h * ff;
}
int64_t HessianSumBytes(const LlamaConfig& c) {
  int64_t bytes = 0;
  for (int64_t n : {c.hidden_size, c.q_dim(), c.hidden_size, c.intermediate_size}) {
    bytes += n * (n + 1) / 2 * 16;
  }
  return bytes;
}
int64_t BlockWorkingBytes(const LlamaConfig& c) {
  const int64_t ff = c.intermediate_size;
  return 2 * BlockParams(c) * 4 + HessianSumBytes(c) + ff * ff * (4 + 8);
}

// Whether the ranks shard the Hessian sums (calib::CalibrationOptions::shard_hessians): when a
// rank would hold more than its max_memory calibrating one block with whole accumulators (the
// block's fp32 weights plus the exact sums of its four inputs: 11.6 GB at a 70B shape) and there
// are ranks to share them. A GPU rank sums on its device and never asks. The ranks agree (any
// rank asking makes all shard), since their budgets may differ by node. Collective.
StatusOr<bool> ShardHessians(comm::Comm& comm, const JobContext& ctx) {
  int64_t want = 0;
  const int64_t need = BlockParams(ctx.config) * 4 + HessianSumBytes(ctx.config);
  if (comm.size() > 1 && ctx.gpu == nullptr &&
      need > ctx.options.max_memory) {
    want = 1;
  }
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&want, 1));
  if (want > 0) {
    QCAL_LOG_INFO("calibration: a block's fp32 weights and exact Hessian sums ({:.2f} GiB) exceed "
                  "this rank's memory budget ({:.2f} GiB): the {} ranks shard the sums by row "
                  "bands ({:.2f} GiB each) and gather each other's linear inputs",
                  need / 1073741824.0, ctx.options.max_memory / 1073741824.0, comm.size(),
                  HessianSumBytes(ctx.config) / static_cast<double>(comm.size()) / 1073741824.0);
  }
  return want > 0;
}

// The activation budget of a rank: its max_memory less a block's working set.
int64_t ActivationBudget(const JobContext& ctx) {
  return std::max<int64_t>(0, ctx.options.max_memory - BlockWorkingBytes(ctx.config));
}

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
  return WriteStagedFile(ctx->options.out_dir, ShardName(0, ctx->config.num_hidden_layers),
                         attempt, writer);
}

// Shard 0 after end-to-end fine-tuning, as the attempt's staged file: the embedding table as
// the float model stores it (not tuned; streamed), the tuned final norm and, when untied, the
// tuned head (F32).
StatusOr<v1::WrittenFile> WriteTunedNonBlockShardStaged(JobContext* ctx,
                                                        const at::Tensor& final_norm,
                                                        const at::Tensor& head, bool head_tied,
                                                        const std::string& attempt) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  QCAL_RETURN_IF_ERROR(ctx->source->AddStoredTensor(&writer, "model.embed_tokens.weight"));
  QCAL_RETURN_IF_ERROR(model::AddF32Tensor(&writer, "model.norm.weight", final_norm));
  if (!head_tied) QCAL_RETURN_IF_ERROR(model::AddF32Tensor(&writer, "lm_head.weight", head));
  return WriteStagedFile(ctx->options.out_dir, ShardName(0, ctx->config.num_hidden_layers),
                         attempt, writer);
}

// Block `layer`'s shard, as the attempt's staged file.
StatusOr<v1::WrittenFile> WriteBlockShardStaged(JobContext* ctx, int64_t layer,
                                                const model::BlockWeights& weights,
                                                const std::string& attempt) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal_block", std::to_string(layer));
  QCAL_RETURN_IF_ERROR(ctx->method->block_format().AppendBlockTensors(layer, weights, &writer));
  return WriteStagedFile(ctx->options.out_dir,
                         ShardName(layer + 1, ctx->config.num_hidden_layers), attempt, writer);
}

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

// The float model's inputs to block `layer` (MethodNeeds::sequential_float): saved by block
// layer-1's task, or rebuilt through the float blocks before it.
StatusOr<at::Tensor> SequentialFloatInputs(JobContext* ctx, int64_t layer) {
  if (layer == 0) return EmbeddedCalibrationInputs(ctx);
  const std::string path = SequentialFloatInputsPath(ctx->options.job_dir, layer);
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
                                 ctx->options.calib_batch));
  }
  return x;
}

// The calibration inputs of block `layer` of a sequential method (see QuantizeBlockStep).
StatusOr<at::Tensor> SequentialInputs(JobContext* ctx, int64_t layer) {
  const int64_t blocks = ctx->config.num_hidden_layers;
  auto embedded = [&]() { return EmbeddedCalibrationInputs(ctx); };
  if (layer == 0) return embedded();
  const std::string path = SequentialInputsPath(ctx->options.job_dir, layer);
  QCAL_ASSIGN_OR_RETURN(std::optional<at::Tensor> loaded,
                        LoadSequentialFile(ctx, path, layer, "calibration inputs"));
  if (loaded) return std::move(*loaded);
  // Gone (removed after block `layer` was done once, which is now being redone): rebuild from the
  // embedding through the quantized blocks before it, as committed in out_dir.
  QCAL_LOG_WARN("block {}: {} is missing; recomputing it through blocks 0..{} read back from {}",
                layer, path, layer - 1, ctx->options.out_dir);
  QCAL_ASSIGN_OR_RETURN(at::Tensor x, embedded());
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
                          ctx->method->block_format().LoadBlock(**ckpt, l));
    QCAL_ASSIGN_OR_RETURN(x, ctx->method->sequential().PropagateFinishedBlock(
                                 std::move(w), l, x, ctx->source->rope(),
                                 ctx->options.calib_batch));
  }
  return x;
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

StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe,
                                              const QuantizeJobOptions& options) {
  auto ctx = std::make_unique<JobContext>();
  ctx->recipe = recipe;
  ctx->options = options;
  if (ctx->options.job_dir.empty()) ctx->options.job_dir = ctx->options.out_dir + ".job";
  if (ctx->options.data_root.empty()) ctx->options.data_root = "../shared";
  if (ctx->options.calib_batch < 1) ctx->options.calib_batch = 8;
  if (ctx->options.max_memory <= 0) ctx->options.max_memory = model::DefaultMaxMemory();
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
                                            ctx->options.job_dir + "/inputs.json"));
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

std::string PhaseProductsPath(const std::string& job_dir, const std::string& phase) {
  return absl::StrCat(job_dir, "/phases/", phase, ".safetensors");
}

Status SavePhaseProducts(const std::string& path, const methods::PhaseProducts& products,
                         const std::string& phase, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  writer.SetMetadata("phase", phase);
  for (const auto& [name, t] : products) {
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, name, t.detach().to(at::kDouble)));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return calib::WriteCacheChecksum(path);
}

StatusOr<methods::PhaseProducts> LoadPhaseProducts(const std::string& path,
                                                   const std::string& phase,
                                                   const std::string& key) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no products of phase '", phase, "'"));
  }
  const Status verified = calib::VerifyCacheChecksum(path);
  if (!verified.ok()) return absl::DataLossError(verified.message());
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const auto& meta = file->metadata();
  auto it = meta.find("calibration_key");
  auto ph = meta.find("phase");
  if (it == meta.end() || it->second != key || ph == meta.end() || ph->second != phase) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": made for another calibration or phase (stale): it is recomputed"));
  }
  methods::PhaseProducts out;
  for (const TensorInfo& info : file->tensors()) {
    if (info.dtype != DType::kF64) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", info.name, "' is not F64"));
    }
    at::Tensor t = at::empty(info.shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), file->Data(info), t.numel() * sizeof(double));
    out[info.name] = t;
  }
  return out;
}

namespace {

// One global phase (see CalibrateStep). Collective.
Status GlobalPhaseStep(comm::Comm& comm, JobContext* ctx, const std::string& phase,
                       const JobEventFn& on_event) {
  const std::string path = PhaseProductsPath(ctx->options.job_dir, phase);
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
  in.state_dir = ctx->options.job_dir + "/phases";
  in.state_key = ctx->calib_key;
  StatusOr<methods::PhaseProducts> products = [&]() -> StatusOr<methods::PhaseProducts> {
    QCAL_ASSIGN_OR_RETURN(const methods::GlobalPhase* part, ctx->method->phase(phase));
    return part->Run(in);
  }();
  Status saved = products.status();
  if (saved.ok() && comm.rank() == 0) {
    saved = MakeDirs(ctx->options.job_dir + "/phases");
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
      calib::Calibrate(comm, *ctx->source, ctx->tokens, ctx->options.job_dir, ctx->calib_key,
                       options, [&](int64_t d, int64_t t) { Emit(on_event, walk_phase, d, t); }));
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

std::string SequentialInputsPath(const std::string& job_dir, int64_t layer) {
  return absl::StrCat(job_dir, "/sequential/inputs-", layer, ".safetensors");
}

std::string SequentialFloatInputsPath(const std::string& job_dir, int64_t layer) {
  return absl::StrCat(job_dir, "/sequential/float-inputs-", layer, ".safetensors");
}

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
  const std::string& job_dir = ctx->options.job_dir;
  PhaseTrace trace;

  // The method's global phases' products; the method is made again with them (its parts that
  // depend on them, such as learned rotations or a prefix, get them at construction) before
  // anything is prepared.
  if (!needs.global_phases.empty()) trace.Begin("load phase products");
  methods::PhaseProductsByName phases;
  for (const std::string& phase : needs.global_phases) {
    auto products =
        LoadPhaseProducts(PhaseProductsPath(job_dir, phase), phase, ctx->calib_key);
    if (!products.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", layer, ": no usable products of phase ", phase,
                       " (run calibration first): ", products.status().message()));
    }
    phases[phase] = std::move(*products);
  }
  if (!phases.empty() && !ctx->method_bound) {
    QCAL_ASSIGN_OR_RETURN(ctx->method, methods::MakeMethod(ctx->recipe, config, phases));
    ctx->method_bound = true;
  }

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
    auto h = calib::LoadBlockHessians(calib::HessianPath(job_dir, layer), ctx->calib_key,
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
                                 calib::HessianPath(job_dir, layer), ")"));
  }
  QCAL_RETURN_IF_ERROR(quantized.status());
  quant::BlockTaskResult task = std::move(*quantized);
  trace.Begin("write");
  if (in.propagate) {
    QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/sequential"));
    QCAL_RETURN_IF_ERROR(
        calib::SaveActivation(SequentialInputsPath(job_dir, layer + 1), x, ctx->calib_key));
    if (in.x_float != nullptr) {
      QCAL_RETURN_IF_ERROR(calib::SaveActivation(SequentialFloatInputsPath(job_dir, layer + 1),
                                                 x_float, ctx->calib_key));
    }
  }
  if (needs.sequential && layer > 0) {
    // Block l-1 is journaled (blocks are handed out in order): its inputs are no longer needed.
    std::remove(SequentialInputsPath(job_dir, layer - 1).c_str());
    std::remove(SequentialFloatInputsPath(job_dir, layer - 1).c_str());
  }

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
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t b = 0; b < n; b += batch) {
      shapes.push_back({std::min(n, b + batch) - b, ctx->tokens.size(1), config.hidden_size});
    }
    QCAL_RETURN_IF_ERROR(MakeDirs(ctx->options.job_dir + "/spill"));
    QCAL_ASSIGN_OR_RETURN(auto store, model::ActivationStore::Create(
                                          shapes, ActivationBudget(*ctx),
                                          ctx->options.job_dir + "/spill/teacher.f32"));
    for (int64_t c = 0; c < store->chunks(); ++c) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor x,
                            ctx->source->Embed(ctx->tokens.narrow(0, c * batch, shapes[c][0])));
      QCAL_RETURN_IF_ERROR(store->Put(c, x));
    }
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::DecoderBlock> block,
                            ctx->source->LoadBlock(l));
      for (int64_t c = 0; c < store->chunks(); ++c) {
        QCAL_ASSIGN_OR_RETURN(at::Tensor x, store->Get(c));
        QCAL_RETURN_IF_ERROR(store->Put(c, block->Forward(x, ctx->source->rope())));
      }
    }
    std::vector<at::Tensor> chunks;
    for (int64_t c = 0; c < store->chunks(); ++c) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor x, store->Get(c));
      chunks.push_back(x);
    }
    teacher.hidden = at::cat(chunks, 0);
  }
  model::ModelSource* source = ctx->source.get();
  teacher.head = [source](const at::Tensor& h) {
    StatusOr<at::Tensor> logits = source->Logits(h);
    if (!logits.ok()) throw std::runtime_error(std::string(logits.status().message()));
    return *logits;
  };
  trace.Begin("fine-tune");
  StatusOr<quant::EndToEndResult> e2e = [&]() -> StatusOr<quant::EndToEndResult> {
    try {
      return quant::FinetuneEndToEnd(ctx->method->FinetuneOptionsFor(stage), &tuned, teacher,
                                     ctx->tokens);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("end-to-end fine-tuning: ", e.what()));
    }
  }();
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
  QCAL_RETURN_IF_ERROR(MakeDirs(ctx->options.job_dir + "/spill"));
  stream.spill_path = absl::StrCat(ctx->options.job_dir, "/spill/eval-", params.model(), "-",
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
