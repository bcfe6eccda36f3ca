#include "engine/quant/scalar_quantize.h"

#include <chrono>

#include "kernels/gpu_backend.h"
#include "kernels/rounding.h"
#include "kernels/scalar_quant.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::quant {
namespace {

kernels::ScalarQuantConfig ScalarConfig(const ScalarQuantizeOptions& o) {
  kernels::ScalarQuantConfig q;
  q.bits = o.bits;
  q.symmetric = o.grid.symmetric;
  q.clip_search = o.grid.clip_search;
  q.f16_scales = o.grid.scale_dtype == "f16";
  if (o.grid.per_tensor) {
    q.granularity = kernels::QuantGranularity::kPerTensor;
  } else if (o.grid.group_size > 0) {
    q.granularity = kernels::QuantGranularity::kPerGroup;
    q.group_size = o.grid.group_size;
  } else {
    q.granularity = kernels::QuantGranularity::kPerChannel;
  }
  return q;
}

}  // namespace

Status RoundToNearestInPlace(const ScalarQuantizeOptions& o, double* w, int64_t out,
                             int64_t in) {
  QCAL_ASSIGN_OR_RETURN(kernels::ScalarRoundingResult r,
                        kernels::RoundToNearest(w, out, in, ScalarConfig(o)));
  if (static_cast<int64_t>(r.w_hat.size()) != out * in) {
    return absl::InternalError("round to nearest: wrong result size");
  }
  std::copy(r.w_hat.begin(), r.w_hat.end(), w);
  return Status();
}

StatusOr<QuantizedLinear> QuantizeScalarLinear(const ScalarQuantizeOptions& o, const double* w,
                                               int64_t out, int64_t in, double* h) {
  kernels::ScalarRoundingResult rounded;
  if (o.gptq) {
    kernels::ScalarRoundingConfig sc;
    sc.quant = ScalarConfig(o);
    sc.damp = o.damp;
    sc.act_order = o.grid.act_order;
    sc.refine_sweeps = o.refine_sweeps;
    // On a GPU rank the sweep runs on the device (kernels/gptq_cuda.h, the same algorithm).
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::RunGptq(o.gpu, w, out, in, h, sc));
  } else {
    const auto t = std::chrono::steady_clock::now();
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::RoundToNearest(w, out, in, ScalarConfig(o)));
    rounded.times.round =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  QuantizedLinear result;
  result.metrics.factor_seconds = rounded.times.factor;
  result.metrics.round_seconds = rounded.times.round;
  result.metrics.refine_seconds = rounded.times.refine;
  if (h) {
    const auto t = std::chrono::steady_clock::now();
    result.metrics.proxy_loss = kernels::ProxyLoss(w, rounded.w_hat.data(), h, out, in);
    const double trace = kernels::QuadraticForm(w, h, out, in);
    result.metrics.relative = result.metrics.proxy_loss / trace;
    result.metrics.proxy_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  ScalarLinearData data;
  data.in_features = in;
  data.out_features = out;
  data.bits = o.bits;
  data.symmetric = o.grid.symmetric;
  data.group_size = o.grid.group_size;
  data.codes = std::move(rounded.codes);
  if (rounded.param_rows == 1 && out > 1) {
    // Per-tensor grid: the one scale (and zero) repeated for every output channel.
    data.scales.assign(out * rounded.param_cols, 0.0f);
    data.zeros.assign(out * rounded.param_cols, 0);
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t g = 0; g < rounded.param_cols; ++g) {
        data.scales[r * rounded.param_cols + g] = static_cast<float>(rounded.scales[g]);
        data.zeros[r * rounded.param_cols + g] = rounded.zeros[g];
      }
    }
  } else {
    data.scales.assign(rounded.scales.begin(), rounded.scales.end());
    data.zeros = std::move(rounded.zeros);
  }
  data.g_idx = std::move(rounded.g_idx);
  data.pack_int4 = o.pack_int4 && o.bits <= 4;
  const int64_t groups = o.grid.per_tensor ? 0 : rounded.param_cols;
  result.metrics.code_bits = o.bits;
  if (data.pack_int4) {
    // Packed codes (a padding nibble per row when in is odd) + F32 scales per channel/group.
    result.metrics.stored_bits =
        (8.0 * out * ((in + 1) / 2) + 32.0 * out * rounded.param_cols) / (out * in);
  } else {
    // GPTQ layout: packed codes, fp16 scales and packed zeros per (group, output).
    result.metrics.stored_bits =
        o.bits + static_cast<double>(groups * out * (16 + o.bits)) / (out * in);
  }
  QCAL_ASSIGN_OR_RETURN(auto linear, ScalarQuantLinear::Create(std::move(data)));
  result.layer = std::move(linear);
  return result;
}

}  // namespace qcal::quant
