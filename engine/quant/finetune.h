// Fine-tuning during quantization (QuIP# §5, Algorithm 5, appendix F.6).
//
// Within a block (BlockTuner): the seven linears are quantized in four groups, in the order data
// flows through the block — (q, k, v) → (o) → (gate, up) → (down). After each group is rounded
// (by the method, with the block's float-model Hessians), the block is tuned with Adam to reproduce the float block's outputs:
//   minimise MSE(block(X_train), Y_train)
// over the block's still-float linear weights (so they compensate for the rounding error before
// they are rounded themselves), the already-quantized linears' tunable vectors
// (model::Linear::TunableVectors: QuIP#'s sign vectors su/sv as real numbers), and both RMSNorm
// weights. Codes and scales of quantized layers never change. After
// every epoch the held-out loss is measured, and the parameters of the best epoch (the untuned
// starting point counts as epoch 0) are restored at the end of the group's pass.
//
// End to end (FinetuneEndToEnd): after every block is quantized, the remaining real-valued
// parameters — every quantized linear's tunable vectors, every block's two norms, the final norm, and lm_head
// when the model has an untied one — are tuned to minimise KL(p_float || p_quantized) of the
// next-token distributions on the calibration sequences (the same gradient as QuIP#'s
// cross-entropy against the float model's soft labels; reported as KL so that 0 means equal).
// A tied head is the embedding matrix, which the quantized model shares unchanged with the
// float model, so it is left alone.
//
// Settings (FinetuneOptions: common/recipe.h FinetuneStage): epochs, lr, batch (sequences per
// Adam step), holdout (fraction of the sequences held out for keep-best). The tunable vectors use
// sign_lr_multiplier × lr (the method sets it: QuIP# F.6 gives 10× for 2-bit recipes, methods/quip); everything else
// lr.
//
// Determinism: no LibTorch RNG is used. The train/held-out split and the per-epoch shuffles
// come from std::mt19937_64 seeded from options.seed (SplitSequences; the same split for every
// block and for the end-to-end stage, so held-out sequences are never trained on), so a rerun
// with the same inputs and thread count gives bit-identical parameters.
//
// Mixture-of-experts blocks: every routed expert's linears are rounded and tuned as the dense
// MLP's are (in its group, by expert index); the router is not tuned (it stays the float
// model's, as qcal never quantizes it), and a token's routing follows the block's current
// weights, as in the quantized model.
//
// Thread-safety: both functions mutate the layers they tune; nothing else may run Forward on
// those layers concurrently. LibTorch's intra-op threads are used as configured by the caller.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "engine/calib/hessian.h"
#include "engine/model/llama.h"
#include "engine/quant/block_task.h"

namespace qcal::quant {

struct FinetuneOptions {
  FinetuneStage stage;              // the recipe's finetune.block or finetune.end_to_end
  uint64_t seed = 0;                // the recipe's seed: split and shuffles
  double sign_lr_multiplier = 1.0;  // learning rate of tunable vectors ÷ stage.lr
  // Where BlockTuner keeps the block, its data and its trainables and runs the forward, the
  // backward and Adam: the rank's LibTorch device (runner/job_steps.cc OpenJob: the rank's GPU
  // when the build's LibTorch has CUDA, else the CPU). The tuned block comes back to the CPU.
  // On the CPU the arithmetic is the same as before this option existed; on a GPU it is the
  // device's (results within a tolerance of the CPU's, not equal: docs/algorithms.md).
  at::Device device = at::kCPU;
};

// A deterministic split of n sequences into training and held-out indices (each sorted):
// round(holdout · n) sequences, at least 1 and at most n − 1, are held out when holdout > 0 and
// n >= 2; none otherwise (keep-best then uses the training loss). Chosen by a Fisher–Yates
// permutation with std::mt19937_64(seed).
struct SequenceSplit {
  std::vector<int64_t> train;
  std::vector<int64_t> holdout;
};
SequenceSplit SplitSequences(int64_t n, double holdout, uint64_t seed);

// QuIP# Algorithm 5 within one block, driven by the method that rounds the linears (there is
// no callback: the method holds the loop and this class the block and its training):
//   QCAL_ASSIGN_OR_RETURN(auto tuner, BlockTuner::Start(options, config, layer, float_weights,
//                                                       rope, inputs, targets));
//   for (size_t g = 0; g < BlockTuner::Groups().size(); ++g) {
//     for (TunedLinear l : tuner->GroupLinears(g)) tuner->Install(l, round(l, tuner->Weight(l)));
//     if (g == 0) tuner->MeasureBaseline(every other linear rounded from the float weights);
//     tuner->TuneGroup(g);
//   }
//   QCAL_ASSIGN_OR_RETURN(BlockTaskResult result, tuner->Finish());
// Weight(k) is on options.device (copy it to the host for a CPU rounding); installed layers and
// the baseline's are moved there (Linear::MoveTo: every stored format can move).
// Every group is rounded with the block's float-model Hessians, including groups whose weights
// were tuned first (as in QuIP#).
//   float_weights: the float block (read only; copied).
//   inputs [N, S, hidden] float32: the float model's inputs to this block on the calibration
//     sequences; targets [N, S, hidden]: the float block's outputs on them (QuIP#'s setup: each
//     block learns to map float inputs to float outputs, so blocks are independent tasks).
// Settings: options.stage (the recipe's finetune.block; epochs 0 = quantize in groups without
// tuning).
// The result's mse_before_ft is the held-out output MSE of the block quantized WITHOUT any
// fine-tuning (all seven linears rounded from the float weights, exactly what the block task
// returns without fine-tuning; q/k/v are shared with the tuned path since they are rounded
// before any tuning); mse_after_ft is the held-out MSE of the returned block. With holdout 0
// both are over all sequences. linears[i].proxy_loss is measured against the (tuned) weight
// that was rounded.
// One linear a BlockTuner holds: the block's dense linear `kind` (expert -1), or routed expert
// `expert`'s linear of role `kind` (kGate, kUp, kDown) in a mixture-of-experts block.
struct TunedLinear {
  model::LinearKind kind = model::LinearKind::kQ;
  int64_t expert = -1;
  bool operator==(const TunedLinear& o) const { return kind == o.kind && expert == o.expert; }
};

class BlockTuner {
 public:
  // The groups QuIP# rounds in, in the order data flows through the block:
  // (q, k, v) → (o) → (gate, up) → (down). In a mixture-of-experts block the (gate, up) group
  // holds the shared expert's or dense MLP's gate and up (when the block has them) and every
  // routed expert's, the (down) group every down_proj (GroupLinears).
  static const std::vector<std::vector<model::LinearKind>>& Groups();
  // Errors: inputs and targets not [N >= 1, S <= rope positions, hidden] alike, a bad stage.
  static StatusOr<std::unique_ptr<BlockTuner>> Start(const FinetuneOptions& options,
                                                     const LlamaConfig& config, int64_t layer,
                                                     const model::BlockWeights& float_weights,
                                                     const model::Rope& rope,
                                                     const at::Tensor& inputs,
                                                     const at::Tensor& targets);
  ~BlockTuner();
  BlockTuner(const BlockTuner&) = delete;
  BlockTuner& operator=(const BlockTuner&) = delete;

  // The linears of group g this block has, in rounding order: its dense ones, then each routed
  // expert's (by expert index, gate before up).
  std::vector<TunedLinear> GroupLinears(size_t g) const;
  // The weight `linear` is to be rounded from: [out, in] float32, tuned by the groups before its
  // own. Precondition: not installed yet.
  const at::Tensor& Weight(const TunedLinear& linear) const;
  // Puts the linear's rounded layer into the block (its metrics join the result's, in install
  // order), on options.device. Errors: the block has no such linear; the layer cannot move there.
  Status Install(const TunedLinear& linear, QuantizedLinear rounded);
  // After the first group is installed: measures the no-FT baseline with every other linear
  // rounded from the float weights (`others`: each linear of the later groups with its layer).
  // The router (kept in float) is the float block's.
  Status MeasureBaseline(
      std::vector<std::pair<TunedLinear, std::unique_ptr<model::Linear>>> others);
  // Tunes the block after group g's linears are installed: Adam on the still-float weights, the
  // installed layers' tunable vectors and both norms, keeping the best epoch.
  Status TuneGroup(size_t g);
  // The tuned block (on the CPU) and its metrics.
  StatusOr<BlockTaskResult> Finish();

 private:
  struct State;
  explicit BlockTuner(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

// A LlamaModel assembled from tensors the caller keeps handles to. LlamaModel keeps its final
// norm and head private; its constructor shares the tensors' storage, so tuning final_norm/head
// in place (as FinetuneEndToEnd does) changes what model->Forward computes.
struct TunableModel {
  std::unique_ptr<model::LlamaModel> model;
  at::Tensor final_norm;  // [hidden] float32, shared with *model
  at::Tensor head;        // [vocab, hidden] float32, shared with *model (the embeddings if tied)
  bool head_tied = true;  // true: head is the embedding matrix (not tuned)
};

// The float model's embeddings, final norm and head (`non_block`, as the float checkpoint holds
// them) + the given blocks. Errors: a block count other than config.num_hidden_layers.
StatusOr<TunableModel> AssembleTunableModel(const LlamaConfig& config,
                                            model::NonBlockWeights non_block,
                                            std::vector<model::BlockWeights> blocks);

// The teacher of end-to-end fine-tuning: the float model's final hidden states (before the final
// norm) on the calibration tokens, [N, S, hidden], and its final norm and head (logits =
// head->Forward(RmsNorm(hidden, final_norm, rms_norm_eps)): model::ModelSource::Head, or a
// LlamaModel's final_norm() and head()). Plain data and a layer: nothing in it can fail.
struct TeacherOutputs {
  at::Tensor hidden;
  at::Tensor final_norm;                // [hidden]
  const model::Linear* head = nullptr;  // the caller keeps it alive
};

struct EndToEndResult {
  double heldout_kl_before = std::numeric_limits<double>::quiet_NaN();  // nats per token
  double heldout_kl_after = std::numeric_limits<double>::quiet_NaN();
  int64_t best_epoch = 0;  // 0: no epoch improved on the starting point
  int64_t train_sequences = 0, holdout_sequences = 0;
  int64_t tuned_tensors = 0, tuned_values = 0;
  bool head_tuned = false;
  double seconds = 0;
};

// QuIP# Algorithm 5's last step with options.stage (the recipe's finetune.end_to_end). `tokens`
// [N, S] int64 (the calibration sequences); the teacher's logits are computed per batch from its
// hidden states. Tunes quantized->model's blocks, final_norm and (untied) head in place and
// leaves the best epoch's values there. Held-out KL is measured on the split
// SplitSequences(N, holdout, options.seed) (all sequences when nothing is held out).
// Errors: tokens not [N, S] int64 with S <= max positions, teacher states of another shape.
StatusOr<EndToEndResult> FinetuneEndToEnd(const FinetuneOptions& options,
                                          TunableModel* quantized, const TeacherOutputs& teacher,
                                          const at::Tensor& tokens);

}  // namespace qcal::quant
