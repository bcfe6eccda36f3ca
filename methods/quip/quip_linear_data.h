// QuipLinearData: everything needed to rebuild a quant::QuipLinear (quantized_linear.h), kept in
// a header of its own, free of LibTorch, so the rounding core (quip_rounding.h) and tools that
// only round (bench/quip_block_bench.cc) need not link LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/incoherence.h"

namespace qcal::methods::quip {

// Everything needed to rebuild a QuipLinear.
struct QuipLinearData {
  int64_t in_features = 0, out_features = 0;
  // in_pad >= in_features and a multiple of the codebook dimension; out_pad >= out_features (any
  // size with a transform: PlanHadamard(out_pad) not kNone when incoherence is on).
  int64_t in_pad = 0, out_pad = 0;
  std::string codebook;  // kernels::MakeCodebook name
  // [out_pad, in_pad / dim, code_words] (kernels::VectorRoundingResult::codes); each word < 2^16.
  std::vector<uint32_t> codes;
  // Ŵ = scale · decoded codebook points (VectorRoundingResult::scale). Positive and finite. The
  // layer computes with float(scale) (the checkpoint stores F32), so a reload is bit-identical.
  // Used only when row_scales is empty.
  double scale = 1.0;
  // Per-row scales [out_pad]: row r of Ŵ = row_scales[r] · decoded points. Each positive and
  // finite. Empty: the single `scale` above.
  std::vector<float> row_scales;
  // U and V of kernels::IncoherenceProcess (sizes out_pad, in_pad). Their signs (Hadamard sizes)
  // initialise su/sv; their phases (RFFT sizes) are part of the fixed T. Ignored (may be left
  // default) when incoherence is false.
  kernels::RandomizedTransform t_u;
  kernels::RandomizedTransform t_v;
  bool incoherence = true;           // false: T_u = T_v = identity, su = sv = 1
};

}  // namespace qcal::methods::quip
