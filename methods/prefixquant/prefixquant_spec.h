// PrefixQuant (method prefixquant; ../shared/papers/prefixquant.txt): the recipe keys, needs and
// quantization_config (torch-free; the worker side is methods/prefixquant/prefixquant_method.h).
// QuaRot's rotations (R1–R4), then static quantization everywhere: per-tensor static activation
// step sizes at every block-linear input, per-head static K and V step sizes, per-channel RTN
// weights, all symmetric and chosen by the reference's grid searches, with the detected outlier
// tokens prefixed in the KV cache (jobs/README.md "method prefixquant"):
//
//   method: prefixquant
//   bits: 4                       # weight bits 2..8, or 16 (float weights)
//   activations: {bits: 4}        # static per-tensor, 2..8 or 16 (float)
//   kv_cache: {bits: 4}           # static per-head, 2..8 or 16 (float)
//   rotation: {enabled: true, r1: true, r2: true, r3: true, r4: true, seed: 0}
//   prefix: {enabled: true, threshold: 64}   # outlier-token prefix (η of Eq. 3)
//   grid_search: true             # the MSE searches of every step size (else min/max init)
//   search_sequences: 16          # calibration sequences the searches run on
//   block_ft: {enabled: true, epochs: 20, batch: 4, lr_weights: 5e-6, lr_steps: 5e-5,
//              val_sequences: 16}  # block-wise fine-tuning (Block-AP) after the searches
//
// Needs: the global phase "prefix" (the outlier-token search and the prefix's K/V on the
// rotated float model) when prefix.enabled; sequential blocks (block l is calibrated on the
// outputs of the quantized blocks before it, with the prefix in the cache), with the float
// model's inputs carried beside them when block_ft is on (its targets); the rotated embedding,
// final norm and head are the method's own.
#pragma once

#include <string>

#include "common/quant_specs.h"
#include "common/recipe.h"

namespace qcal::methods::prefixquant {

// Block-wise fine-tuning (the reference's Block-AP): per block, the quantized block on the
// quantized inputs against the float block on the float inputs (MSE), training the weights and
// every step size with straight-through rounding; AdamW (weight decay 0), cosine decay per step to
// a tenth of each learning rate. The last val_sequences calibration sequences are held out and
// report the block MSE before and after.
struct BlockFtSpec {
  bool enabled = false;
  int64_t epochs = 20;
  int64_t batch = 4;
  double lr_weights = 5e-6;
  double lr_steps = 5e-5;
  int64_t val_sequences = 16;
};

struct PrefixquantConfig final : MethodConfig {
  int bits = 4;      // weights; 16: float
  int act_bits = 4;  // 16: float activations
  int kv_bits = 4;   // 16: float KV cache
  RotationSpec rotation;
  bool prefix = true;
  double threshold = 64.0;  // η
  bool grid_search = true;
  int64_t search_sequences = 16;
  BlockFtSpec block_ft;

  bool quantizes_weights() const { return bits < 16; }
  bool quantizes_activations() const { return act_bits < 16; }
  bool quantizes_kv() const { return kv_bits < 16; }

  const char* method() const override { return "prefixquant"; }
  MethodNeeds needs() const override;
  int weight_bits() const override { return bits; }
  void AddToJson(nlohmann::json* recipe) const override;
  void AddToQuantizationConfig(nlohmann::json* q) const override;
};

inline constexpr char kPrefixPhase[] = "prefix";

const MethodSpec& Spec();

}  // namespace qcal::methods::prefixquant
