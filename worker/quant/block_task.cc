#include "worker/quant/block_task.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "kernels/codebook.h"
#include "kernels/hadamard.h"
#include "kernels/incoherence.h"
#include "kernels/rounding.h"
#include "worker/quant/quantized_linear.h"
#include "worker/quarot/act_quant.h"
#include "worker/quarot/quarot_model.h"

namespace qcal::quant {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<double> ToDouble(const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Smallest size >= n (and a multiple of `multiple`) that has an orthogonal transform.
int64_t TransformSize(int64_t n, int64_t multiple) {
  int64_t d = RoundUp(n, multiple);
  while (PlanHadamard(d).kind == HadamardKind::kNone) d += multiple;
  return d;
}

// tr(A H Aᵀ) for A [rows, cols].
double QuadraticTrace(const std::vector<double>& a, const std::vector<double>& h, int64_t rows,
                      int64_t cols) {
  std::vector<double> zero(a.size(), 0.0);
  return kernels::ProxyLoss(zero.data(), a.data(), h.data(), rows, cols);
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

StatusOr<QuantizedLinear> QuantizeQuip(const Recipe& recipe, int64_t layer,
                                          model::LinearKind kind, const std::vector<double>& w,
                                          int64_t out, int64_t in, const std::vector<double>& h) {
  QCAL_ASSIGN_OR_RETURN(auto codebook, kernels::MakeCodebook(recipe.codebook));
  const int64_t g = codebook->dim();
  const int64_t in_pad = recipe.incoherence ? TransformSize(in, g) : RoundUp(in, g);
  const int64_t out_pad = recipe.incoherence ? TransformSize(out, 1) : out;
  // Zero-padded W [out_pad, in_pad] and H [in_pad, in_pad].
  std::vector<double> wp(out_pad * in_pad, 0.0), hp(in_pad * in_pad, 0.0);
  for (int64_t r = 0; r < out; ++r) {
    std::copy(&w[r * in], &w[r * in] + in, &wp[r * in_pad]);
  }
  for (int64_t r = 0; r < in; ++r) std::copy(&h[r * in], &h[r * in] + in, &hp[r * in_pad]);
  if (in_pad > in) {
    // The padded inputs are always zero; give them the mean diagonal so H stays well
    // conditioned (their weights multiply zeros, so any value is exact).
    double mean_diag = 0;
    for (int64_t i = 0; i < in; ++i) mean_diag += h[i * in + i];
    mean_diag /= static_cast<double>(in);
    for (int64_t i = in; i < in_pad; ++i) hp[i * in_pad + i] = mean_diag;
  }

  QuipLinearData data;
  data.in_features = in;
  data.out_features = out;
  data.in_pad = in_pad;
  data.out_pad = out_pad;
  data.codebook = recipe.codebook;
  data.incoherence = recipe.incoherence;
  const std::vector<double>* w_round = &wp;
  const std::vector<double>* h_round = &hp;
  kernels::IncoherenceResult ip;
  if (recipe.incoherence) {
    QCAL_ASSIGN_OR_RETURN(
        ip, kernels::IncoherenceProcess(wp.data(), out_pad, in_pad, hp.data(),
                                        TransformSeed(recipe.seed, layer, kind, true),
                                        TransformSeed(recipe.seed, layer, kind, false)));
    data.t_u = ip.transforms.u;
    data.t_v = ip.transforms.v;
    w_round = &ip.w_hat;
    h_round = &ip.h_hat;
  }
  kernels::VectorRoundingConfig vc;
  vc.damp = recipe.damp;
  if (recipe.scale_mode != "row" && recipe.scale_mode != "matrix") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown QuIP# scale mode '", recipe.scale_mode, "' (row or matrix)"));
  }
  const bool per_row = recipe.scale_mode == "row";
  std::vector<double> w_unit;
  if (per_row) {
    // One scale per row of the rotated W: s_r = RMS(row r)/ρ (ρ = the codebook's default scale),
    // rounded to float since the layer stores F32. LDLQ's feedback W·U acts within each row, so
    // BlockLDLQ on D⁻¹W at scale 1 (D = diag(s)) followed by Ŵ = D·result is exactly BlockLDLQ
    // with scale s_r on row r. All-zero rows take the matrix scale (RMS(W)/ρ, or 1 when W = 0).
    const double rho = codebook->default_scale();
    const std::vector<double>& wr = *w_round;
    double total = 0;
    for (double v : wr) total += v * v;
    const double rms_all = std::sqrt(total / static_cast<double>(out_pad * in_pad));
    const double matrix_scale = rms_all > 0 ? rms_all / rho : 1.0;
    auto usable = [](float s) { return std::isnormal(s) && s > 0; };
    const float fallback = usable(static_cast<float>(matrix_scale))
                               ? static_cast<float>(matrix_scale) : 1.0f;
    data.row_scales.resize(out_pad);
    w_unit.resize(out_pad * in_pad);
    for (int64_t r = 0; r < out_pad; ++r) {
      const double* row = &wr[r * in_pad];
      double ss = 0;
      for (int64_t j = 0; j < in_pad; ++j) ss += row[j] * row[j];
      const double rms = std::sqrt(ss / static_cast<double>(in_pad));
      const float s = static_cast<float>(rms / rho);
      data.row_scales[r] = rms > 0 && usable(s) ? s : fallback;
      const double inv = 1.0 / static_cast<double>(data.row_scales[r]);
      for (int64_t j = 0; j < in_pad; ++j) w_unit[r * in_pad + j] = row[j] * inv;
    }
    vc.scale = 1.0;
  }
  const double* w_ldlq = per_row ? w_unit.data() : w_round->data();
  QCAL_ASSIGN_OR_RETURN(auto rounded, kernels::BlockLdlq(w_ldlq, out_pad, in_pad,
                                                         h_round->data(), *codebook, vc));
  data.codes = std::move(rounded.codes);
  if (per_row) {
    data.scale = 1.0;  // unused: row_scales apply
    for (int64_t r = 0; r < out_pad; ++r) {
      const double s = data.row_scales[r];
      for (int64_t j = 0; j < in_pad; ++j) rounded.w_hat[r * in_pad + j] *= s;
    }
  } else {
    data.scale = rounded.scale;
  }

  // Proxy loss in the original space: Ŵ = Uᵀ Ŵ_q V, sliced to [out, in].
  std::vector<double> w_hat_pad = rounded.w_hat;
  if (recipe.incoherence) {
    QCAL_ASSIGN_OR_RETURN(w_hat_pad, kernels::RecoverWeights(ip.transforms, rounded.w_hat.data()));
  }
  std::vector<double> w_hat(out * in);
  for (int64_t r = 0; r < out; ++r) {
    std::copy(&w_hat_pad[r * in_pad], &w_hat_pad[r * in_pad] + in, &w_hat[r * in]);
  }
  QuantizedLinear result;
  result.metrics.proxy_loss = kernels::ProxyLoss(w.data(), w_hat.data(), h.data(), out, in);
  result.metrics.code_bits = codebook->bits_per_weight() * static_cast<double>(out_pad * in_pad) /
                             static_cast<double>(out * in);
  QCAL_ASSIGN_OR_RETURN(auto linear, QuipLinear::Create(std::move(data)));
  SafetensorsWriter sizer;
  QCAL_RETURN_IF_ERROR(linear->AppendTensors("x", &sizer));
  result.metrics.stored_bits = 8.0 * sizer.data_bytes() / static_cast<double>(out * in);
  result.layer = std::move(linear);
  return result;
}

StatusOr<QuantizedLinear> QuantizeScalar(const Recipe& recipe, const std::vector<double>& w,
                                            int64_t out, int64_t in, const std::vector<double>* h) {
  kernels::ScalarRoundingResult rounded;
  const bool gptq = recipe.method == QuantMethod::kGptq ||
                    (recipe.method == QuantMethod::kQuarot && recipe.weights == "gptq");
  if (gptq) {
    kernels::ScalarRoundingConfig sc;
    sc.quant = ScalarConfig(recipe);
    sc.damp = recipe.damp;
    sc.act_order = recipe.scalar.act_order;
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::Gptq(w.data(), out, in, h->data(), sc));
  } else {
    QCAL_ASSIGN_OR_RETURN(rounded, kernels::RoundToNearest(w.data(), out, in, ScalarConfig(recipe)));
  }
  QuantizedLinear result;
  if (h) result.metrics.proxy_loss = kernels::ProxyLoss(w.data(), rounded.w_hat.data(), h->data(),
                                                        out, in);
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
  std::vector<double> w = ToDouble(weight);
  std::vector<double> h;
  if (hessian.defined()) {
    if (hessian.dim() != 2 || hessian.size(0) != in || hessian.size(1) != in) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": Hessian is not ", in, "x", in));
    }
    h = ToDouble(hessian);
  }
  StatusOr<QuantizedLinear> q = recipe.method == QuantMethod::kQuip
                                    ? QuantizeQuip(recipe, layer, kind, w, out, in, h)
                                    : QuantizeScalar(recipe, w, out, in, h.empty() ? nullptr : &h);
  if (!q.ok()) return Annotate(q.status(), where);
  q->metrics.name = model::LinearName(kind);
  if (!h.empty()) {
    q->metrics.relative = q->metrics.proxy_loss / QuadraticTrace(w, h, out, in);
  } else {
    q->metrics.proxy_loss = q->metrics.relative = std::nan("");
  }
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
