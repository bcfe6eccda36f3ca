#include "runner/job_steps.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/phase_trace.h"
#include "common/tokenizer.h"
#include "engine/calib/cache.h"
#include "engine/calib/tokens.h"
#include "engine/model/activation_store.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "kernels/gpu_backend.h"
#include "methods/method_factory.h"
#include "runner/input_fingerprint.h"
#include "runner/job_dir.h"
#include "runner/job_inputs.h"

namespace qcal::job {

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

StatusOr<std::unique_ptr<JobContext>> OpenJob(const Recipe& recipe, const v1::JobSpec& spec,
                                              const RankOptions& rank) {
  auto ctx = std::make_unique<JobContext>();
  ctx->recipe = recipe;
  ctx->spec = spec;
  ResolveJobSpec(&ctx->spec);
  ctx->rank = rank;
  ctx->max_memory =
      spec.max_memory_bytes() > 0 ? spec.max_memory_bytes() : model::DefaultMaxMemory();
  QCAL_ASSIGN_OR_RETURN(ctx->source, model::OpenFloatCheckpoint(ctx->spec.model_dir()));
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
        ctx->spec.recipe_path(), ": calibration.precision ", recipe.calibration.precision,
        " is the arithmetic of the GPU's calibration forward, and this rank has no GPU (the CPU "
        "computes in fp32: use --device cuda, or precision fp32)"));
  }
  const int threads = rank.threads > 0 ? rank.threads : ctx->spec.threads_per_worker();
  model::SetComputeThreads(threads > 0 ? threads : model::AutoComputeThreads(ctx->config));
  std::string capped;
  ctx->seq_len = CalibrationSeqLen(recipe, ctx->config, &capped);
  if (!capped.empty()) QCAL_LOG_WARN("{}", capped);
  if (ctx->rank.inputs_key.empty()) {
    QCAL_ASSIGN_OR_RETURN(InputsFingerprint inputs,
                          FingerprintInputs(recipe, ctx->spec.model_dir(), ctx->spec.data_root(),
                                            JobPaths(ctx->spec.job_dir()).inputs));
    ctx->rank.inputs_key = inputs.key;
  }
  ctx->calib_key = calib::CalibrationKey(ctx->rank.inputs_key, ctx->config,
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
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(ctx->spec.model_dir()));
  QCAL_ASSIGN_OR_RETURN(
      ctx->tokens,
      calib::SampleCalibrationTokens(*tokenizer, ctx->recipe.calibration, ctx->spec.data_root(),
                                     ctx->seq_len, tokenizer->bos_id()));
  ctx->bos_id = tokenizer->bos_id();
  return absl::OkStatus();
}

}  // namespace qcal::job
