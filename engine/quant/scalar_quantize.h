// Rounding a linear onto the scalar grid of a recipe (ScalarGridSpec): round to nearest or GPTQ
// (kernels/rounding.h), as a ScalarQuantLinear with its metrics. Shared by methods rtn, gptq and
// quarot.
#pragma once

#include <cstdint>

#include "common/quant_specs.h"
#include "common/status.h"
#include "engine/quant/block_task.h"
#include "kernels/gpu_backend.h"

namespace qcal::quant {

struct ScalarQuantizeOptions {
  int bits = 4;
  ScalarGridSpec grid;
  bool gptq = false;       // GPTQ with the Hessian (else round to nearest, which needs none)
  double damp = 0.01;      // GPTQ only
  int refine_sweeps = 0;   // GPTQ only: kernels::RefineRounding after the pass
  bool pack_int4 = false;  // store codes two per byte (bits <= 4)
  // The rank's GPU backend (null: the CPU): GPTQ runs there (kernels::RunGptq).
  kernels::GpuBackend* gpu = nullptr;
};

// w [out, in] fp64 row-major; h [in, in] fp64 or null (then no proxy loss). GPTQ on the CPU
// works in h's own storage and restores it bit for bit (kernels::GptqInPlace: one n×n matrix
// at the peak, not two; 6.6 GB less at a 70B down_proj); h is as it was when this returns OK.
// Stored bits count the GPTQ layout (packed codes, fp16 scales and packed zeros per group) or,
// with pack_int4, the packed codes and F32 scales.
StatusOr<QuantizedLinear> QuantizeScalarLinear(const ScalarQuantizeOptions& options,
                                               const double* w, int64_t out, int64_t in,
                                               double* h);

// The recipe grid's round to nearest of w (fp64 [out, in] row-major), dequantized in place: the
// weights an RTN linear of these options computes with (QuantizeScalarLinear's result without
// GPTQ). Learned-rotation training uses it as its weight fake quantizer.
Status RoundToNearestInPlace(const ScalarQuantizeOptions& options, double* w, int64_t out,
                             int64_t in);

}  // namespace qcal::quant
