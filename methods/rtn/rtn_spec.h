// RTN (method rtn): the recipe keys, needs and quantization_config of the method (torch-free;
// the worker side is methods/rtn/rtn_method.h).
//
//   method: rtn
//   bits: 4                # 2..8
//   scalar: {group_size: -1, symmetric: true, act_order: false, clip_search: false,
//            per_tensor: false}
//
// Round to nearest on the scalar grid: no Hessian, no calibration (unless fine-tuning).
#pragma once

#include "common/quant_specs.h"
#include "common/recipe.h"

namespace qcal::methods::rtn {

struct RtnConfig final : MethodConfig {
  int bits = 2;
  ScalarGridSpec scalar;

  const char* method() const override { return "rtn"; }
  MethodNeeds needs() const override;
  int weight_bits() const override { return bits; }
  void AddToJson(nlohmann::json* recipe) const override;
  void AddToQuantizationConfig(nlohmann::json* q) const override;
};

const MethodSpec& Spec();

}  // namespace qcal::methods::rtn
