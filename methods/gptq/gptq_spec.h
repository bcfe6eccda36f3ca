// GPTQ (method gptq): the recipe keys, needs and quantization_config of the method (torch-free;
// the worker side is methods/gptq/gptq_method.h).
//
//   method: gptq
//   bits: 4                # 2..8
//   scalar: {group_size: -1, symmetric: true, act_order: false, clip_search: false,
//            per_tensor: false}
//   damp: 0.01             # H + damp·mean(diag H)·I
//   refine_sweeps: 0       # refinement sweeps after GPTQ (kernels::RefineRounding)
//
// GPTQ (Frantar et al.) on the float model's Hessians, optionally in activation order.
#pragma once

#include "common/quant_specs.h"
#include "common/recipe.h"

namespace qcal::methods::gptq {

struct GptqConfig final : MethodConfig {
  int bits = 2;
  ScalarGridSpec scalar;
  double damp = 0.01;
  int refine_sweeps = kDefaultRefineSweeps;
  static constexpr int kDefaultRefineSweeps = 0;

  const char* method() const override { return "gptq"; }
  MethodNeeds needs() const override;
  int weight_bits() const override { return bits; }
  void AddToJson(nlohmann::json* recipe) const override;
  void AddToQuantizationConfig(nlohmann::json* q) const override;
};

const MethodSpec& Spec();

}  // namespace qcal::methods::gptq
