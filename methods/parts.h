// The parts a quantization method is made of (methods/method.h), one contract each:
//
//   ModelTransform     function-preserving transforms of the float model as it streams in
//                      (QuaRot's norm fusion and rotations, learned rotations, K-sort)
//   GlobalPhase        a collective step after calibration, before the block tasks (rotation
//                      training, PrefixQuant's prefix search); its products are saved in the job
//                      directory and given to the method at construction (MakeMethod)
//   BlockQuantizer     one block task: a prepared float block and what MethodNeeds asked for in,
//                      the quantized block and its metrics out
//   SequentialForward  sequential methods: the calibration inputs carried from block to block,
//                      and how to rebuild them after a resume
//   BlockFormat        a quantized block in its shard and read back (LayerFormats for linears)
//   Inference          what inference computes with beyond the stored weights (online
//                      Hadamards, activation and KV-cache quantizers)
//
// A method has the parts its MethodNeeds declare; Method::Create checks that it does.
// Thread-safety: parts are immutable; their const functions may run concurrently on different
// blocks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/quant_specs.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/comm/comm.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "engine/quant/block_task.h"
#include "kernels/gpu_backend.h"
#include "methods/layer_format.h"

namespace qcal::methods {

// A global phase's products: named tensors, saved in the job directory
// (runner/job_dir.h JobPaths::PhaseProducts). All of a job's, by phase name.
using PhaseProducts = std::map<std::string, at::Tensor>;
using PhaseProductsByName = std::map<std::string, PhaseProducts>;

class ModelTransform {
 public:
  virtual ~ModelTransform() = default;
  // Float block `layer`, transformed in place.
  virtual Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const = 0;
  // The non-block weights, each row on its own (a 128k-row table is never whole in memory; a
  // method that changes them says so with MethodNeeds::transforms_non_block):
  // rows of the float embedding table ([..., hidden]) as the prepared table holds them;
  virtual StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const = 0;
  // the prepared final norm's weights [hidden], given the float ones;
  virtual at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const = 0;
  // rows [n, hidden] of the float head as the prepared (untied) head holds them, given the
  // float final norm's weights.
  virtual StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                               const at::Tensor& final_norm) const = 0;
};

// What a global phase gets. Collective: every rank of `comm` runs the phase with the same
// inputs and must return the same products.
struct GlobalPhaseInputs {
  comm::Comm* comm = nullptr;
  model::ModelSource* source = nullptr;  // the float model, streamed (not prepared)
  const at::Tensor* tokens = nullptr;    // the calibration tokens [N, S] int64, BOS first
  int64_t batch = 8;                     // sequences per forward pass (the canonical chunks)
  int32_t bos_id = 1;
  int64_t max_memory = 0;  // the rank's memory budget in bytes (0: no limit given)
  // Where a long phase keeps resumable state (a directory the runner gives: JOB/phases), and the
  // key its state must carry to be reused (the calibration key: other tokens or another model
  // make it stale).
  std::string state_dir;
  std::string state_key;
};

// A phase that trains says how it went, in a form that names no method: the training loss of
// each step and the held-out scores (after which step, which loss). The runner journals it
// (phase_done) and the job report plots it under the phase's name. Empty: the phase trains
// nothing.
struct TrainingCurve {
  std::vector<double> losses;
  std::vector<std::pair<int64_t, double>> validation;
  bool empty() const { return losses.empty() && validation.empty(); }
};

// What a global phase returns: the products the block tasks are made with, and its curve.
struct PhaseResult {
  PhaseProducts products;
  TrainingCurve curve;
};

class GlobalPhase {
 public:
  virtual ~GlobalPhase() = default;
  virtual StatusOr<PhaseResult> Run(const GlobalPhaseInputs& inputs) const = 0;
};

// What a block task hands BlockQuantizer::QuantizeBlock besides the float block: exactly what
// the method's MethodNeeds ask for (CheckBlockInputs, which the runner calls, holds that; a
// part does not check again). Pointers are owned by the caller and valid during the call.
// Progress inside a block task: `done` of `total` steps of the quantizer finished, the last one
// named by `step` ("self_attn.q_proj", "fine-tune after (gate, up)"). Called on the task's thread.
using BlockProgressFn =
    std::function<void(int64_t done, int64_t total, const std::string& step)>;

struct BlockInputs {
  int64_t layer = 0;
  const model::Rope* rope = nullptr;  // always set
  int64_t batch = 8;                  // sequences per forward pass
  kernels::GpuBackend* gpu = nullptr;  // the rank's GPU backend (null: the CPU)
  // Where the block's LibTorch work (fine-tuning) runs: the rank's GPU when this build's
  // LibTorch has CUDA and the rank has a GPU, else the CPU (runner/job_steps.cc OpenJob).
  at::Device device = at::kCPU;
  // needs().float_hessians: the block's Hessians on the float model. The quantizer may consume
  // them (calib::HessianMeans releases each kind's sums once its mean exists).
  calib::BlockHessians* hessians = nullptr;
  // needs().float_activations (within-block fine-tuning): the float model's inputs to this block
  // and the float block's outputs, [N, S, hidden].
  const at::Tensor* ft_inputs = nullptr;
  const at::Tensor* ft_targets = nullptr;
  // needs().sequential: this block's calibration inputs [N, S, hidden] (the outputs of the
  // quantized blocks before it); with `propagate` the quantizer replaces them by the quantized
  // block's outputs.
  at::Tensor* x = nullptr;
  bool propagate = false;
  // needs().sequential_float: the float model's inputs to this block [N, S, hidden] (the float
  // blocks before it, as SequentialForward::PropagateFloatBlock runs them); with `propagate`
  // replaced by the float block's outputs.
  at::Tensor* x_float = nullptr;
  // Optional: where the quantizer is inside the block (the job's progress shows it, so a block
  // that takes minutes is not silent). Quantizers call it through ReportBlockStep.
  BlockProgressFn progress;
  // A part of a MoE block split over tasks (MethodNeeds::expert_parts; runner/task_plan.h):
  // the float block holds only what the part quantizes, and so does the result. `dense`: the
  // block's weights besides its routed experts (norms, attention, dense MLP or shared expert,
  // router); the routed experts [expert_begin, expert_end) (the result's MoeWeights keeps every
  // expert's slot, the others null). The defaults are the whole block.
  bool dense = true;
  int64_t expert_begin = 0;
  int64_t expert_end = -1;  // -1: every expert
};

// inputs.progress(done, total, step) when set.
inline void ReportBlockStep(const BlockInputs& inputs, int64_t done, int64_t total,
                            const std::string& step) {
  if (inputs.progress) inputs.progress(done, total, step);
}

// OK when `inputs` holds what `needs` asks for; InvalidArgument naming the block and what is
// missing otherwise.
Status CheckBlockInputs(const BlockInputs& inputs, const MethodNeeds& needs);

class BlockQuantizer {
 public:
  virtual ~BlockQuantizer() = default;
  // Quantizes prepared float block inputs.layer.
  virtual StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                         const BlockInputs& inputs) const = 0;
};

class SequentialForward {
 public:
  virtual ~SequentialForward() = default;
  // How many leading positions of every calibration sequence the block tasks drop (a prefix
  // that ends with BOS replaces the sequence's own BOS).
  virtual int64_t DroppedCalibrationPositions() const { return 0; }
  // The outputs of finished block `layer` (as BlockFormat::LoadBlock reads it) on its
  // calibration inputs x, as QuantizeBlock propagates them: rebuilds inputs a resumed job lost.
  virtual StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                                      const at::Tensor& x,
                                                      const model::Rope& rope,
                                                      int64_t batch) const = 0;
  // needs().sequential_float: float block `layer` (prepared by the ModelTransform) applied to
  // the float inputs x, as QuantizeBlock propagates x_float. Unimplemented by default.
  virtual StatusOr<at::Tensor> PropagateFloatBlock(model::BlockWeights prepared, int64_t layer,
                                                   const at::Tensor& x, const model::Rope& rope,
                                                   int64_t batch) const;
};

class BlockFormat {
 public:
  virtual ~BlockFormat() = default;
  // The tensors of quantized block `layer` in its shard.
  virtual Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                                    SafetensorsWriter* writer) const = 0;
  // Block `layer` read back from a checkpoint written with AppendBlockTensors, as stored.
  virtual StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt,
                                                  int64_t layer) const = 0;
  // A MoE block split over tasks (MethodNeeds::expert_parts). AppendExpertTensors: the routed
  // experts [begin, end) of moe as AppendBlockTensors stores them (an expert group's part
  // file). AppendBlockTensorsFromParts: what AppendBlockTensors writes for `weights` (whose
  // routed experts' slots are null), each expert's tensors copied as stored from the part file
  // of its group (`groups`: in expert order, covering every expert), streamed: the bytes of one
  // task, without the block's experts in memory. InvalidArgument naming the file when a part
  // file holds other tensors or misses an expert's. Unimplemented by default.
  struct StoredExperts {
    const SafetensorsFile* file = nullptr;
    int64_t begin = 0, end = 0;
  };
  virtual Status AppendExpertTensors(int64_t layer, const model::MoeWeights& moe, int64_t begin,
                                     int64_t end, SafetensorsWriter* writer) const;
  virtual Status AppendBlockTensorsFromParts(int64_t layer, const model::BlockWeights& weights,
                                             const std::vector<StoredExperts>& groups,
                                             SafetensorsWriter* writer) const;
};

// A static input quantizer's parameters: value = (code - zero) · scale.
struct StaticInputParams {
  float scale = 1.0f;
  int32_t zero = 0;
};

// What a checkpoint computes at inference beyond a plain Llama forward over its stored weights
// (float activations and KV cache, no online transforms), as data: export/ reads it and decides
// per format what it can express; no method names a format.
struct ServedForward {
  // One online step of inference, named for messages ("the online Hadamard R3 on queries and
  // keys", "4-bit activation quantization").
  struct Step {
    std::string what;
    // The step acts on decoder linears' inputs only and is described whole by `linear_inputs`
    // or `input_hadamards` (a format that carries input quantizers and input transforms can
    // express it).
    bool on_linear_inputs = false;
    // The step is the KV-cache quantization `kv_cache` describes whole (FP8 E4M3 with static
    // per-tensor scales: a format with a kv_cache_scheme can express it).
    bool on_kv_cache = false;
  };
  std::vector<Step> online;  // empty: a plain Llama forward computes the checkpoint
  // The quantizer of every decoder linear's input; nullopt: float inputs. Static: each block's
  // scale and zero point from Inference::StaticLinearInputParams.
  std::optional<ActivationQuantSpec> linear_inputs;
  // Block-diagonal Hadamards on linear inputs, online at inference, their inverse already fused
  // into the stored weight (QuaRot's R4 in blocks).
  struct InputHadamard {
    model::LinearKind linear = model::LinearKind::kDown;
    int64_t block = 0;  // the block-diagonal Sylvester H_block / √block
  };
  std::vector<InputHadamard> input_hadamards;
  // The KV cache's FP8 quantizer (format fp8); nullopt: a float cache, or one no format holds.
  // Each block's scales from Inference::StaticKvScales.
  std::optional<KvCacheSpec> kv_cache;
};

// The static per-tensor scales of one block's FP8 KV cache: cache = e4m3(x / scale).
struct StaticKvScales {
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

class Inference {
 public:
  virtual ~Inference() = default;
  // What inference computes with, installed on a block BlockFormat::LoadBlock read.
  virtual Status Install(model::DecoderBlock* block, int64_t layer) const = 0;
  // The same, as data (for exports).
  virtual StatusOr<ServedForward> Served() const = 0;
  // A static input quantizer's scale and zero point (on qcal's code grid: ScalarCodeMin..Max)
  // for the input of linear `kind` of block `layer`, from the block as BlockFormat::LoadBlock
  // read it: the block's static ranges, when Served().linear_inputs is static.
  virtual StatusOr<StaticInputParams> StaticLinearInputParams(const model::BlockWeights& weights,
                                                             int64_t layer,
                                                             model::LinearKind kind) const;
  // The FP8 KV cache's scales of block `layer` (block as BlockFormat::LoadBlock read it), when
  // Served().kv_cache is set.
  virtual StatusOr<StaticKvScales> KvCacheScales(const model::BlockWeights& weights,
                                                 int64_t layer) const;
};

// The block format every method without extra per-block tensors uses: both RMSNorm weights
// (F32) and each linear in its layer format (LayerFormats), the linears' shapes checked against
// the config on reading. Methods with extras build on it. Names are the model's own
// (model::LinearTensorName: Llama 4's "feed_forward.*", a multimodal checkpoint's
// "language_model." prefix); a MoE block adds its router (F32, not quantized) and each routed
// expert's three linears under model::ExpertTensorName (docs/formats.md).
class StandardBlockFormat : public BlockFormat {
 public:
  // `quantized`: the format name quantized linears are read with (quantization_config "format").
  StandardBlockFormat(LlamaConfig config, std::shared_ptr<const LayerFormats> formats,
                      std::string quantized);
  Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                            SafetensorsWriter* writer) const override;
  StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const override;
  Status AppendExpertTensors(int64_t layer, const model::MoeWeights& moe, int64_t begin,
                             int64_t end, SafetensorsWriter* writer) const override;
  Status AppendBlockTensorsFromParts(int64_t layer, const model::BlockWeights& weights,
                                     const std::vector<StoredExperts>& groups,
                                     SafetensorsWriter* writer) const override;

 private:
  // Norms, dense linears and a MoE block's router: AppendBlockTensors before the experts.
  Status AppendBlockHead(int64_t layer, const model::BlockWeights& weights,
                         SafetensorsWriter* writer) const;
  const LlamaConfig config_;
  const std::shared_ptr<const LayerFormats> formats_;
  const std::string quantized_;
};

}  // namespace qcal::methods
