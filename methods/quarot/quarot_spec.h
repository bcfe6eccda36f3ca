// QuaRot (method quarot): the recipe keys, needs and quantization_config of the method
// (torch-free; the worker side is methods/quarot/quarot_method.h). Rotations fused into the
// weights and applied online, simulated activation and KV-cache quantization, weights by RTN or
// GPTQ (jobs/README.md "method quarot"):
//
//   method: quarot
//   weights: gptq           # rtn | gptq | none (float weights)
//   bits: 4                 # weight bits 2..8 (not with weights: none)
//   damp: 0.01              # weights: gptq only
//   refine_sweeps: 0        # weights: gptq only (kernels::RefineRounding)
//   scalar: {group_size: -1, symmetric: true, act_order: false, clip_search: true}
//   rotation: {enabled: true, r1: true, r2: true, r3: true, r4: true, seed: 0}
//   activations: {bits: 4, clip: 0.9, granularity: per_token, static: false}
//   kv_cache: {bits: 4, format: int, granularity: per_group, group: 0, clip: 0.95,
//              symmetric: false, static: false}
//   kv_cache: {bits: 4, format: bfp, group: 4, key_point: pre_rope, k_sort: true}
//
// Needs: block l's GPTQ Hessians and static ranges are collected on the outputs of the quantized
// blocks before it (sequential blocks); the rotated embedding, final norm and head are the
// method's own (block 0's task writes shard 0, the head untied). No QuIP# fine-tuning.
#pragma once

#include <string>
#include <vector>

#include "common/quant_specs.h"
#include "common/recipe.h"

namespace qcal::methods::quarot {

struct QuarotConfig : MethodConfig {
  std::string weights = "gptq";  // rtn | gptq | none
  int bits = 2;                  // 16 with weights: none
  double damp = 0.01;
  int refine_sweeps = 0;  // gptq weights only: kernels::RefineRounding after GPTQ
  ScalarGridSpec scalar;
  RotationSpec rotation;
  ActivationQuantSpec activations;
  KvCacheSpec kv_cache;

  bool quantizes_weights() const { return weights != "none"; }
  bool gptq() const { return weights == "gptq"; }
  bool static_activations() const { return activations.enabled() && activations.is_static; }
  bool static_kv() const { return kv_cache.enabled() && kv_cache.is_static; }
  // Block l needs the outputs of the quantized blocks before it (GPTQ Hessians, static ranges).
  bool sequential() const { return gptq() || static_activations() || static_kv(); }

  const char* method() const override { return "quarot"; }
  MethodNeeds needs() const override;
  int weight_bits() const override { return bits; }
  void AddToJson(nlohmann::json* recipe) const override;
  void AddToQuantizationConfig(nlohmann::json* q) const override;
};

const MethodSpec& Spec();

// QuaRot's recipe keys and their parsing, shared with methods built on QuaRot (spinquant).
std::vector<std::string> QuarotKeys();
Status ParseQuarotKeys(const RecipeSection& top, QuarotConfig* c);

}  // namespace qcal::methods::quarot
