#include "worker/quant/block_task.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "kernels/codebook.h"
#include "kernels/rounding.h"
#include "worker/quant/quantized_linear.h"
#include "worker/quant/quip_rounding.h"
#include "worker/quarot/act_quant.h"
#include "worker/quarot/quarot_model.h"

namespace qcal::quant {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

kernels::ScalarQuantConfig ScalarConfig(const Recipe& r) {
  kernels::ScalarQuantConfig q;
  q.bits = r.bits;
  q.symmetric = r.scalar.symmetric;
  q.clip_search = r.scalar.clip_search;
  if (r.scalar.per_tensor) {
    q.granularity = kernels::QuantGranularity::kPerTensor;
  } else if (r.scalar.group_size > 0) {
    q.granularity = kernels::QuantGranularity::kPerGroup;
    q.group_size = r.scalar.group_size;
  } else {
    q.granularity = kernels::QuantGranularity::kPerChannel;
  }
  return q;
}

// QuIP#: quip_rounding.h's RoundQuipLinear, wrapped into a QuipLinear.
StatusOr<QuantizedLinear> QuantizeQuip(const Recipe& recipe, int64_t layer,
                                       model::LinearKind kind, const double* w, int64_t out,
                                       int64_t in, const double* h) {
  if (recipe.scale_mode != "row" && recipe.scale_mode != "matrix") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown QuIP# scale mode '", recipe.scale_mode, "' (row or matrix)"));
  }
  QuipRoundingOptions options;
  options.codebook = recipe.codebook;
  options.incoherence = recipe.incoherence;
  options.seed_u = TransformSeed(recipe.seed, layer, kind, true);
  options.seed_v = TransformSeed(recipe.seed, layer, kind, false);
  options.damp = recipe.damp;
  options.per_row_scale = recipe.scale_mode == "row";
  QCAL_ASSIGN_OR_RETURN(QuipRounding rounded, RoundQuipLinear(w, out, in, h, options));
  QuantizedLinear result;
  result.metrics.proxy_loss = rounded.proxy_loss;
  result.metrics.relative = rounded.relative;
  result.metrics.code_bits = rounded.code_bits;
  QCAL_ASSIGN_OR_RETURN(auto linear, QuipLinear::Create(std::move(rounded.data)));
  SafetensorsWriter sizer;
  QCAL_RETURN_IF_ERROR(linear->AppendTensors("x", &sizer));
  result.metrics.stored_bits = 8.0 * sizer.data_bytes() / static_cast<double>(out * in);
  result.layer = std::move(linear);
  return result;
}

StatusOr<QuantizedLinear> QuantizeScalar(const Recipe& recipe, const double* w, int64_t out,
                                          int64_t in, const double* h) {
  kernels::ScalarRoundingResult rounded;
  const bool gptq = recipe.method == QuantMethod::kGptq ||
                    (recipe.method == QuantMethod::kQuarot && recipe.weights == "gptq");
  if (gptq) {
    kernels::ScalarRoundingConfig sc;
    sc.quant = ScalarConfig(recipe);
    sc.damp = recipe.damp;
    sc.act_order = recipe.scalar.act_order;
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::Gptq(w, out, in, h, sc));
  } else {
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::RoundToNearest(w, out, in, ScalarConfig(recipe)));
  }
  QuantizedLinear result;
  if (h) {
    result.metrics.proxy_loss = kernels::ProxyLoss(w, rounded.w_hat.data(), h, out, in);
    const double trace = kernels::QuadraticForm(w, h, out, in);
    result.metrics.relative = result.metrics.proxy_loss / trace;
  }
  ScalarLinearData data;
  data.in_features = in;
  data.out_features = out;
  data.bits = recipe.bits;
  data.symmetric = recipe.scalar.symmetric;
  data.group_size = recipe.scalar.group_size;
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
  // QuaRot checkpoints store 2..4-bit codes packed two per byte.
  data.pack_int4 = recipe.method == QuantMethod::kQuarot && recipe.bits <= 4;
  const int64_t groups = recipe.scalar.per_tensor ? 0 : rounded.param_cols;
  // GPTQ layout: packed codes, fp16 scales and packed zeros per (group, output).
  result.metrics.code_bits = recipe.bits;
  if (data.pack_int4) {
    // Packed codes (a padding nibble per row when in is odd) + F32 scales per channel/group.
    result.metrics.stored_bits =
        (8.0 * out * ((in + 1) / 2) + 32.0 * out * rounded.param_cols) / (out * in);
  } else {
    result.metrics.stored_bits =
        recipe.bits + static_cast<double>(groups * out * (16 + recipe.bits)) / (out * in);
  }
  QCAL_ASSIGN_OR_RETURN(auto linear, ScalarQuantLinear::Create(std::move(data)));
  result.layer = std::move(linear);
  return result;
}

}  // namespace

uint64_t TransformSeed(uint64_t recipe_seed, int64_t layer, model::LinearKind linear,
                       bool output) {
  uint64_t x = SplitMix64(recipe_seed);
  x = SplitMix64(x ^ static_cast<uint64_t>(layer));
  x = SplitMix64(x ^ static_cast<uint64_t>(linear));
  return SplitMix64(x ^ (output ? 1u : 2u));
}

StatusOr<QuantizedLinear> QuantizeLinear(const Recipe& recipe, int64_t layer,
                                         model::LinearKind kind, const at::Tensor& weight,
                                         const at::Tensor& hessian) {
  const auto t1 = Clock::now();
  const int64_t out = weight.size(0), in = weight.size(1);
  const std::string where = absl::StrCat("block ", layer, " ", model::LinearName(kind));
  if (recipe.needs_hessians() && !hessian.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": method ",
                                                   QuantMethodName(recipe.method),
                                                   " needs a Hessian"));
  }
  // fp64 views: the weight is converted (a copy); a contiguous fp64 Hessian (what
  // HessianAccumulator::Mean returns) is read in place, not copied.
  const at::Tensor w = weight.to(at::kDouble).contiguous();
  at::Tensor h;
  if (hessian.defined()) {
    if (hessian.dim() != 2 || hessian.size(0) != in || hessian.size(1) != in) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": Hessian is not ", in, "x", in));
    }
    h = hessian.to(at::kDouble).contiguous();
  }
  const double* hp = h.defined() ? h.data_ptr<double>() : nullptr;
  StatusOr<QuantizedLinear> q =
      recipe.method == QuantMethod::kQuip
          ? QuantizeQuip(recipe, layer, kind, w.data_ptr<double>(), out, in, hp)
          : QuantizeScalar(recipe, w.data_ptr<double>(), out, in, hp);
  if (!q.ok()) return Annotate(q.status(), where);
  q->metrics.name = model::LinearName(kind);
  if (hp == nullptr) q->metrics.proxy_loss = q->metrics.relative = std::nan("");
  q->metrics.seconds = Seconds(t1);
  return q;
}

namespace {

// QuaRot: the block's weights were already rotated (worker/quarot/rotate.h); a linear may be an
// ActQuantLinear carrying an online transform T (R4 on down_proj) around its dense weight. The
// dense weight is rounded per the recipe (rtn / gptq / none) with the Hessian of what it really
// multiplies, T·H·Tᵀ, and the result is wrapped again with the same transform.
StatusOr<BlockTaskResult> QuantizeQuarotBlock(const Recipe& recipe, int64_t layer,
                                              const model::BlockWeights& rotated,
                                              const calib::BlockHessians* hessians) {
  const auto t0 = Clock::now();
  BlockTaskResult result;
  result.layer = layer;
  result.weights.input_norm = rotated.input_norm.clone();
  result.weights.post_norm = rotated.post_norm.clone();
  result.weights.rope_perm = rotated.rope_perm;
  result.weights.extra = rotated.extra;
  for (model::LinearKind kind : model::kAllLinears) {
    const model::Linear& linear = rotated.linear(kind);
    const auto* wrapped = dynamic_cast<const quarot::ActQuantLinear*>(&linear);
    std::shared_ptr<const quarot::OnlineHadamard> transform =
        wrapped ? wrapped->rotation() : nullptr;
    const at::Tensor weight = quarot::WeightCarrier(linear).DenseWeight();
    std::unique_ptr<model::Linear> layer_out;
    LinearMetrics metrics;
    if (recipe.weights == "none") {
      const auto t1 = Clock::now();
      layer_out = std::make_unique<model::DenseLinear>(weight.to(at::kFloat).contiguous().clone());
      metrics.name = model::LinearName(kind);
      metrics.proxy_loss = metrics.relative = std::nan("");
      metrics.code_bits = metrics.stored_bits = 32;
      metrics.seconds = Seconds(t1);
    } else {
      at::Tensor h;
      if (hessians) {
        h = hessians->at(calib::HessianKindOf(kind)).Mean();
        if (transform) {
          QCAL_ASSIGN_OR_RETURN(h, quarot::RotateHessian(h, *transform));
        }
      }
      QCAL_ASSIGN_OR_RETURN(QuantizedLinear q, QuantizeLinear(recipe, layer, kind, weight, h));
      layer_out = std::move(q.layer);
      metrics = q.metrics;
    }
    if (transform) {
      layer_out = std::make_unique<quarot::ActQuantLinear>(std::move(layer_out), transform,
                                                           nullptr);
    }
    result.weights.linears[static_cast<int>(kind)] = std::move(layer_out);
    result.linears.push_back(metrics);
  }
  result.seconds = Seconds(t0);
  return result;
}

}  // namespace

StatusOr<BlockTaskResult> QuantizeBlock(const Recipe& recipe, const LlamaConfig& config,
                                        int64_t layer, const model::BlockWeights& float_weights,
                                        const calib::BlockHessians* hessians) {
  const auto t0 = Clock::now();
  if (recipe.method == QuantMethod::kQuarot) {
    if (float_weights.extra.count(quarot::kRotationsKey) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", layer, ": method quarot needs the block rotated by quarot::RotateBlockWeights "
          "first (worker/quarot/quarot_model.h QuantizeModel drives the whole QuaRot pipeline)"));
    }
    if (recipe.needs_hessians() && hessians == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", layer, ": quarot with gptq weights needs Hessians"));
    }
    return QuantizeQuarotBlock(recipe, layer, float_weights, hessians);
  }
  if (recipe.needs_hessians() && hessians == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": method ",
                                                   QuantMethodName(recipe.method),
                                                   " needs Hessians"));
  }
  BlockTaskResult result;
  result.layer = layer;
  result.weights.input_norm = float_weights.input_norm.clone();
  result.weights.post_norm = float_weights.post_norm.clone();
  for (model::LinearKind kind : model::kAllLinears) {
    at::Tensor h;
    if (hessians) h = hessians->at(calib::HessianKindOf(kind)).Mean();
    QCAL_ASSIGN_OR_RETURN(QuantizedLinear q,
                          QuantizeLinear(recipe, layer, kind,
                                         float_weights.linear(kind).DenseWeight(), h));
    result.weights.linears[static_cast<int>(kind)] = std::move(q.layer);
    result.linears.push_back(q.metrics);
  }
  result.seconds = Seconds(t0);
  return result;
}

}  // namespace qcal::quant
