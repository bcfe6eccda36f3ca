// The worker side of a quantization method (LibTorch): what the job's block tasks, the
// checkpoint readers and evaluation call, so that none of them names a method. Each method
// implements it in methods/<name>/<name>_method.h; methods/method_factory.h makes one from a
// recipe.
//
// A job runs a method like this (runner/job_steps.h):
//   * every float block, as it streams in from the source checkpoint, goes through
//     PrepareBlock (the method's function-preserving transforms: QuaRot's norm fusion and
//     rotations, K-sort); the non-block weights, in row chunks (a 128k-row table is never
//     whole in memory), through PrepareEmbeddingRows, PrepareFinalNorm and PrepareHeadRows;
//   * QuantizeBlock gets the prepared float block and what its MethodNeeds asked for (the float
//     model's Hessians and activations from the calibration phase, or the block's calibration
//     inputs for a sequential method) and returns the quantized block and its metrics;
//   * AppendBlockTensors writes the quantized block into its shard (the method's layer formats),
//     and LoadBlock / InstallInference read it back for evaluation, generation, resume and
//     end-to-end fine-tuning.
//
// Thread-safety: a Method is immutable after creation; its const functions may run
// concurrently on different blocks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/comm/comm.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "engine/quant/block_task.h"
#include "engine/quant/finetune.h"
#include "engine/quant/scalar_quantize.h"

namespace qcal::methods {

// A global phase's product (MethodNeeds::global_phases): named tensors, saved in the job
// directory (job_dir/phases/<phase>.safetensors) and handed to every block task.
using PhaseProducts = std::map<std::string, at::Tensor>;

// What a global phase gets. Collective: every rank of `comm` runs the phase with the same
// inputs and must return the same products.
struct GlobalPhaseInputs {
  comm::Comm* comm = nullptr;
  model::ModelSource* source = nullptr;  // the float model, streamed (not prepared)
  const at::Tensor* tokens = nullptr;    // the calibration tokens [N, S] int64, BOS first
  int64_t batch = 8;                     // sequences per forward pass (the canonical chunks)
  int32_t bos_id = 1;
  int64_t max_memory = 0;  // the rank's memory budget in bytes (0: no limit given)
  // Where a long phase keeps resumable state (job_dir/phases), and the key its state must carry
  // to be reused (the calibration key: other tokens or another model make it stale).
  std::string state_dir;
  std::string state_key;
};

// What a block task hands QuantizeBlock besides the float block. Pointers are owned by the
// caller and valid during the call.
struct BlockInputs {
  int64_t layer = 0;
  const model::Rope* rope = nullptr;
  int64_t batch = 8;  // sequences per forward pass
  // needs().float_hessians: the block's Hessians on the float model; else null. The method may
  // consume them (calib::HessianMeans releases each kind's sums once its mean exists).
  calib::BlockHessians* hessians = nullptr;
  // needs().float_activations (within-block fine-tuning): the float model's inputs to this block
  // and the float block's outputs, [N, S, hidden]; else null.
  const at::Tensor* ft_inputs = nullptr;
  const at::Tensor* ft_targets = nullptr;
  // needs().sequential: this block's calibration inputs [N, S, hidden] (the outputs of the
  // quantized blocks before it); with `propagate` the method replaces them by the quantized
  // block's outputs. Else null.
  at::Tensor* x = nullptr;
  bool propagate = false;
  // needs().sequential_float: the float model's inputs to this block [N, S, hidden] (the float
  // blocks before it, as the method runs them: PropagateFloatBlock); with `propagate` the method
  // replaces them by the float block's outputs. Else null.
  at::Tensor* x_float = nullptr;
  // The products of the method's global phases, by phase name; null when it has none.
  const std::map<std::string, PhaseProducts>* phases = nullptr;
};

class Method {
 public:
  Method(Recipe recipe, LlamaConfig config);
  virtual ~Method() = default;
  Method(const Method&) = delete;
  Method& operator=(const Method&) = delete;

  const Recipe& recipe() const { return recipe_; }
  const LlamaConfig& config() const { return config_; }
  MethodNeeds needs() const { return recipe_.needs(); }
  // The method's fields of quantization_config ("format", ...): MethodConfig's.
  nlohmann::json QuantizationFields() const;

  // --- the float model, as it streams in
  // Function-preserving transforms of float block `layer` (identity by default).
  virtual Status PrepareBlock(int64_t layer, model::BlockWeights* weights) const;
  // ... of the embedding table, final norm and head, each row on its own (identity by default;
  // a method that changes them says so with MethodNeeds::transforms_non_block):
  // rows of the float embedding table ([..., hidden]) as the prepared table holds them;
  virtual StatusOr<at::Tensor> PrepareEmbeddingRows(const at::Tensor& rows) const;
  // the prepared final norm's weights [hidden], given the float ones;
  virtual at::Tensor PrepareFinalNorm(const at::Tensor& final_norm) const;
  // rows [n, hidden] of the float head as the prepared (untied) head holds them, given the
  // float final norm's weights.
  virtual StatusOr<at::Tensor> PrepareHeadRows(const at::Tensor& rows,
                                               const at::Tensor& final_norm) const;

  // --- global phases (MethodNeeds::global_phases), after calibration, before the block tasks
  // Runs phase `phase` (collective over inputs.comm). Unimplemented by default.
  virtual StatusOr<PhaseProducts> RunGlobalPhase(const std::string& phase,
                                                 const GlobalPhaseInputs& inputs) const;
  // A method whose transforms depend on its global phases' products (learned rotations: the
  // rotations phase trains what PrepareBlock and the row functions apply) returns a copy of
  // itself bound to them; the job runs every block task, the non-block shard and the sequential
  // inputs through the bound copy. nullptr (the default): the method is unchanged.
  virtual StatusOr<std::unique_ptr<Method>> BindPhaseProducts(
      const std::map<std::string, PhaseProducts>& phases) const;
  // Sequential methods: how many leading positions of every calibration sequence the block tasks
  // drop (a prefix that ends with BOS replaces the sequence's own BOS). 0 by default.
  virtual int64_t DroppedCalibrationPositions() const { return 0; }

  // --- one block
  virtual StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                         const BlockInputs& inputs) const = 0;
  // QuIP#'s fine-tuning settings for a stage of the recipe (the tunable vectors' learning rate
  // multiplier: SignLrMultiplier()).
  quant::FinetuneOptions FinetuneOptionsFor(const FinetuneStage& stage) const;

  // --- the quantized checkpoint
  // The tensors of quantized block `layer` in its shard. Default: both RMSNorm weights (F32) and
  // each linear in its layer format (AppendLinear).
  virtual Status AppendBlockTensors(int64_t layer, const model::BlockWeights& weights,
                                    SafetensorsWriter* writer) const;
  // Block `layer` read back from a checkpoint written with AppendBlockTensors, as stored.
  virtual StatusOr<model::BlockWeights> LoadBlock(CheckpointReader& ckpt, int64_t layer) const;
  // What inference computes with, installed on a block LoadBlock read (online transforms,
  // activation and KV-cache quantizers). Nothing by default.
  virtual Status InstallInference(model::DecoderBlock* block, int64_t layer) const;
  // Whether a checkpoint of this recipe computes exactly what its stored linears compute in a
  // plain Llama forward pass (float activations and KV cache, no online transforms), so that its
  // weights can be exported to formats inference engines load (export). FailedPrecondition
  // saying what such a forward cannot express otherwise. OK by default.
  virtual Status CheckPlainForward() const;
  // Sequential methods: the outputs of finished block `layer` (as LoadBlock reads it) on its
  // calibration inputs x, as QuantizeBlock propagates them; used to rebuild inputs a resumed job
  // lost. Unimplemented by default.
  // needs().sequential_float: the float block `layer` (as the source stores it, prepared by
  // PrepareBlock) applied to the float inputs x, as QuantizeBlock propagates x_float; used to
  // rebuild float inputs a resumed job lost. Unimplemented by default.
  virtual StatusOr<at::Tensor> PropagateFloatBlock(
      model::BlockWeights prepared, int64_t layer, const at::Tensor& x, const model::Rope& rope,
      int64_t batch, const std::map<std::string, PhaseProducts>* phases) const;
  virtual StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights weights, int64_t layer,
                                                      const at::Tensor& x,
                                                      const model::Rope& rope,
                                                      int64_t batch) const;

 protected:
  virtual double SignLrMultiplier() const { return 1.0; }
  // A linear in the layer format that handles it: the method's own (OwnLinearFormat), the
  // scalar format (quant::ScalarQuantLinear) or dense float32 ("<prefix>.weight").
  Status AppendLinear(const model::Linear& linear, const std::string& prefix,
                      SafetensorsWriter* writer) const;
  // Reads "<prefix>" back: dense when "<prefix>.weight" exists, else with the method's format.
  StatusOr<std::unique_ptr<model::Linear>> LoadLinear(CheckpointReader& ckpt,
                                                      const std::string& prefix) const;
  // A method with a layer format of its own (QuIP#'s codebook layers) overrides these two.
  virtual StatusOr<bool> AppendOwnFormat(const model::Linear& linear, const std::string& prefix,
                                         SafetensorsWriter* writer) const;
  virtual StatusOr<std::unique_ptr<model::Linear>> LoadOwnFormat(CheckpointReader& ckpt,
                                                                 const std::string& prefix) const;

 private:
  Recipe recipe_;
  LlamaConfig config_;
};

// Methods that round every linear on its own from its float weights and the float model's
// Hessian (quip, rtn, gptq), with QuIP#'s within-block fine-tuning when the recipe enables it.
class PerLinearMethod : public Method {
 public:
  using Method::Method;
  // Rounds one linear of block `layer`: weight [out, in] float, hessian [in, in] fp64 mean
  // (undefined when the method needs none).
  virtual StatusOr<quant::QuantizedLinear> QuantizeLinear(int64_t layer, model::LinearKind kind,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& hessian) const = 0;
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights float_weights,
                                                 const BlockInputs& inputs) const override;
};

// Per-linear methods on a scalar grid (rtn, gptq): every linear rounded by
// quant::QuantizeScalarLinear with `options` (GPTQ with the float model's Hessian when
// options.gptq, else round-to-nearest), stored in the scalar layer format.
class ScalarGridMethod final : public PerLinearMethod {
 public:
  ScalarGridMethod(Recipe recipe, LlamaConfig config, quant::ScalarQuantizeOptions options);
  StatusOr<quant::QuantizedLinear> QuantizeLinear(int64_t layer, model::LinearKind kind,
                                                  const at::Tensor& weight,
                                                  const at::Tensor& hessian) const override;

 private:
  const quant::ScalarQuantizeOptions options_;
};

}  // namespace qcal::methods
