// Outlier-planted, function-preserving variants of a float Llama model (`qcal tool
// plant-outliers`).
//
// Our real models (stories260K, aidreams260K) have almost no activation outliers (max/median
// channel ratios 2–7 where Llama-2 shows hundreds), so the methods that exist to handle outliers
// (QuaRot's R2/R3/R4 rotations, K-sort for BFP keys) need a harder test. This makes one by
// rescaling pairs of weights whose product the model computes linearly, so the float function is
// unchanged (up to float rounding) while chosen activation channels grow by a factor:
//
//   * down_proj input (R4's target): up_proj row j × α, down_proj column j ÷ α. The MLP computes
//     down(silu(gate x) ⊙ (up x)); channel j of the product is linear in up's row j.
//   * o_proj input (R2's target): v_proj row (g, c) × α (KV head g, channel c), and o_proj
//     column (h, c) ÷ α for every query head h that reads KV head g (h / (heads / kv_heads) ==
//     g). The attention output of head h, channel c is a convex combination of v[g][c].
//   * K cache (R3's and K-sort's target): the RoPE pair (i, i + d/2) of KV head g in W_k × β, and
//     the same pair of W_q ÷ β in every query head of KV head g. RoPE rotates within the pair,
//     which commutes with scaling both members by one factor, so every qᵀk is unchanged.
//
// RMSNorm-channel planting (norm weight × α, next linears' columns ÷ α) is deliberately not
// offered: norm fusion (QuaRot's first step) folds the norm into the linears and undoes it.
//
// Channels are drawn per layer from a seeded std::mt19937_64 (distinct within a layer, uniform);
// the plan is a pure function of (config, options), and is written beside the model as
// planted_outliers.json.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"

namespace qcal::tools {

struct PlantOutliersOptions {
  double alpha = 50.0;        // factor on down_proj-input and o_proj-input channels (> 0)
  double beta = 50.0;         // factor on K-cache RoPE pairs (> 0)
  int64_t down_channels = 2;  // per layer, of intermediate_size
  int64_t v_channels = 2;     // per layer, of num_key_value_heads * head_dim
  int64_t k_pairs = 1;        // per KV head, of head_dim / 2 RoPE pairs
  uint64_t seed = 0;
};

// The channels planted in one decoder layer.
struct LayerOutlierPlan {
  std::vector<int64_t> down;     // up_proj rows = down_proj columns, in [0, intermediate)
  std::vector<int64_t> v;        // v_proj rows g * head_dim + c, in [0, kv_dim)
  std::vector<int64_t> k_pairs;  // g * (head_dim / 2) + i: pair (i, i + head_dim/2) of KV head g
};

// InvalidArgument for factors that are not finite and positive, negative counts, or counts above
// what the layer has (naming the option and the limit).
Status ValidatePlantOutliersOptions(const LlamaConfig& config, const PlantOutliersOptions& o);

// The seeded plan, one entry per layer. Sorted channel lists.
StatusOr<std::vector<LayerOutlierPlan>> PlanOutliers(const LlamaConfig& config,
                                                     const PlantOutliersOptions& options);

// Applies `plan` for layer `layer` to that layer's weights in place (float32 [out, in] tensors,
// Hugging Face shapes). InvalidArgument on a shape that disagrees with `config`.
Status PlantOutliersInLayer(const LlamaConfig& config, const LayerOutlierPlan& plan,
                            const PlantOutliersOptions& options, at::Tensor& q_proj,
                            at::Tensor& k_proj, at::Tensor& v_proj, at::Tensor& o_proj,
                            at::Tensor& up_proj, at::Tensor& down_proj);

// planted_outliers.json: options and the plan.
nlohmann::json PlanToJson(const PlantOutliersOptions& options,
                          const std::vector<LayerOutlierPlan>& plan);

struct PlantOutliersResult {
  std::string out_dir;
  LlamaConfig config;
  std::vector<LayerOutlierPlan> plan;
  int64_t tensors = 0;
};

// Reads the float model in `model_dir` (config.json + safetensors, single or sharded), plants
// outliers, and writes `out_dir` (created if missing): model.safetensors (every tensor float32),
// config.json (torch_dtype float32), planted_outliers.json, and a copy of every other regular
// file of model_dir (tokenizer.model, tokenizer_config.json, ...). Errors: a quantized model
// (config has quantization_config), out_dir equal to model_dir, bad options, unreadable tensors.
StatusOr<PlantOutliersResult> PlantOutliers(const std::string& model_dir,
                                            const std::string& out_dir,
                                            const PlantOutliersOptions& options);

}  // namespace qcal::tools
