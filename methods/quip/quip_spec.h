// QuIP# (method quip): the recipe keys, needs and quantization_config of the method (torch-free;
// the worker side is methods/quip/quip_method.h).
//
//   method: quip
//   bits: 2            # 2 (e8p, halfint2), 3 (rvq3_e8p_e8), 4 (rvq4_e8p_e8p); follows codebook;
//                      # for a trellis codebook, k: 2, 3 or 4
//   codebook: e8p      # e8p | rvq3_e8p_e8 | rvq4_e8p_e8p | halfint2 | halfint3 | halfint4
//                      # | qtip_1mad | qtip_3inst | qtip_hyb (QTIP trellis, kernels/trellis.h)
//   trellis_l: 16      # trellis state bits L (trellis codebooks only)
//   incoherence: true  # randomized Hadamard (RFFT fallback) on W and H
//   scale: row         # row: one scale per row of the rotated W (RMS(row)/ρ) | matrix: RMS(W)/ρ
//                      # | auto: both, keep the lower proxy loss per linear
//   damp: 0.01         # H + damp·mean(diag H)·I
//   refine_sweeps: 1   # refinement sweeps after BlockLDLQ (kernels::RefineRounding); 0: none
#pragma once

#include <string>

#include "common/recipe.h"

namespace qcal::methods::quip {

struct QuipConfig final : MethodConfig {
  int bits = 2;
  std::string codebook = "e8p";
  bool incoherence = true;
  std::string scale_mode = "row";
  double damp = 0.01;
  int refine_sweeps = kDefaultRefineSweeps;
  int trellis_l = 16;
  static constexpr int kDefaultRefineSweeps = 1;

  bool trellis() const;
  // The kernels::MakeCodebook name: `codebook`, or "qtip_<code>_l<L>_k<bits>" for a trellis.
  std::string kernel_codebook() const;

  const char* method() const override { return "quip"; }
  MethodNeeds needs() const override;
  int weight_bits() const override { return bits; }
  void AddToJson(nlohmann::json* recipe) const override;
  void AddToQuantizationConfig(nlohmann::json* q) const override;
};

const MethodSpec& Spec();

}  // namespace qcal::methods::quip
