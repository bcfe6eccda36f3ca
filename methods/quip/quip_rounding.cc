#include "methods/quip/quip_rounding.h"

#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/codebook.h"
#include "kernels/gpu_backend.h"
#include "kernels/hadamard.h"
#include "kernels/incoherence.h"
#include "kernels/rounding.h"

namespace qcal::methods::quip {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

Status CheckFinite(const double* a, int64_t count, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(a[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("quip rounding: non-finite ", what, " entry at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t QuipTransformSize(int64_t n, int64_t multiple) {
  int64_t d = RoundUp(n, multiple);
  while (PlanHadamard(d).kind == HadamardKind::kNone) d += multiple;
  return d;
}

StatusOr<QuipRounding> RoundQuipLinear(const double* w, int64_t out, int64_t in, const double* h,
                                       const QuipRoundingOptions& options) {
  if (out <= 0 || in <= 0 || w == nullptr || h == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("quip rounding: need W [out, in] and H [in, in] with out, in > 0 (got ", out,
                     " x ", in, ")"));
  }
  QCAL_RETURN_IF_ERROR(CheckFinite(w, out * in, "weight"));
  QCAL_RETURN_IF_ERROR(CheckFinite(h, in * in, "Hessian"));
  if (options.choose_scale) {
    // Per-row and per-matrix scales each win on some layers (near-rank-1 q/k favour rows):
    // round with both and keep the lower proxy loss (ties: per row).
    QuipRoundingOptions o = options;
    o.choose_scale = false;
    o.per_row_scale = true;
    QCAL_ASSIGN_OR_RETURN(QuipRounding row, RoundQuipLinear(w, out, in, h, o));
    o.per_row_scale = false;
    QCAL_ASSIGN_OR_RETURN(QuipRounding matrix, RoundQuipLinear(w, out, in, h, o));
    QuipRounding& kept = matrix.proxy_loss < row.proxy_loss ? matrix : row;
    const QuipRounding& other = &kept == &row ? matrix : row;
    // Both roundings' time counts.
    kept.transform_seconds += other.transform_seconds;
    kept.times.factor += other.times.factor;
    kept.times.round += other.times.round;
    kept.times.refine += other.times.refine;
    kept.proxy_seconds += other.proxy_seconds;
    return std::move(kept);
  }
  QCAL_ASSIGN_OR_RETURN(auto codebook, kernels::MakeCodebook(options.codebook));
  const int64_t g = codebook->dim();
  const int64_t in_pad = options.incoherence ? QuipTransformSize(in, g) : RoundUp(in, g);
  int64_t out_pad = options.incoherence ? QuipTransformSize(out, 1) : out;
  // A trellis codes tiles of joint_vectors() rows, the last one shorter; when that last tile
  // would be too short for its stream (CheckRows), the rows are padded to whole tiles (zero
  // weights, coded like the others).
  if (!codebook->CheckRows(out_pad).ok()) {
    const int64_t joint = codebook->joint_vectors();
    out_pad = options.incoherence ? QuipTransformSize(out, joint) : RoundUp(out, joint);
  }

  // Zero-padded W [out_pad, in_pad] and H [in_pad, in_pad]; both are transformed in place.
  std::vector<double> wp(out_pad * in_pad, 0.0);
  for (int64_t r = 0; r < out; ++r) std::copy(&w[r * in], &w[r * in] + in, &wp[r * in_pad]);
  std::vector<double> hp(in_pad * in_pad, 0.0);
  for (int64_t r = 0; r < in; ++r) std::copy(&h[r * in], &h[r * in] + in, &hp[r * in_pad]);
  if (in_pad > in) {
    double mean_diag = 0;
    for (int64_t i = 0; i < in; ++i) mean_diag += h[i * in + i];
    mean_diag /= static_cast<double>(in);
    for (int64_t i = in; i < in_pad; ++i) hp[i * in_pad + i] = mean_diag;
  }

  QuipRounding result;
  QuipLinearData& data = result.data;
  data.in_features = in;
  data.out_features = out;
  data.in_pad = in_pad;
  data.out_pad = out_pad;
  data.codebook = options.codebook;
  data.incoherence = options.incoherence;
  auto t = std::chrono::steady_clock::now();
  auto lap = [&t] {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - t).count();
    t = now;
    return s;
  };
  kernels::IncoherenceTransforms transforms;
  if (options.incoherence) {
    QCAL_ASSIGN_OR_RETURN(transforms, kernels::MakeIncoherenceTransforms(
                                          out_pad, in_pad, options.seed_u, options.seed_v));
    QCAL_RETURN_IF_ERROR(kernels::TransformWeights(transforms, wp.data()));
    QCAL_RETURN_IF_ERROR(kernels::TransformHessian(transforms.v, hp.data()));
    data.t_u = transforms.u;
    data.t_v = transforms.v;
  }

  kernels::VectorRoundingConfig vc;
  vc.damp = options.damp;
  vc.num_threads = options.num_threads;
  vc.refine_sweeps = options.refine_sweeps;
  vc.progress = options.progress;
  if (options.per_row_scale) {
    // One scale per row of the rotated W: s_r = RMS(row r)/ρ (ρ = the codebook's default scale),
    // rounded to float since the layer stores F32. LDLQ's feedback W·U acts within each row, so
    // BlockLDLQ on D⁻¹W at scale 1 (D = diag(s)) followed by Ŵ = D·result is exactly BlockLDLQ
    // with scale s_r on row r. All-zero rows take the matrix scale (RMS(W)/ρ, or 1 when W = 0).
    const double rho = codebook->default_scale();
    double total = 0;
    for (double v : wp) total += v * v;
    const double rms_all = std::sqrt(total / static_cast<double>(out_pad * in_pad));
    const double matrix_scale = rms_all > 0 ? rms_all / rho : 1.0;
    auto usable = [](float s) { return std::isnormal(s) && s > 0; };
    const float fallback =
        usable(static_cast<float>(matrix_scale)) ? static_cast<float>(matrix_scale) : 1.0f;
    data.row_scales.resize(out_pad);
    for (int64_t r = 0; r < out_pad; ++r) {
      double* row = &wp[r * in_pad];
      double ss = 0;
      for (int64_t j = 0; j < in_pad; ++j) ss += row[j] * row[j];
      const double rms = std::sqrt(ss / static_cast<double>(in_pad));
      const float s = static_cast<float>(rms / rho);
      data.row_scales[r] = rms > 0 && usable(s) ? s : fallback;
      const double inv = 1.0 / static_cast<double>(data.row_scales[r]);
      for (int64_t j = 0; j < in_pad; ++j) row[j] *= inv;
    }
    vc.scale = 1.0;
  }
  result.transform_seconds = lap();
  // On a GPU rank, E8P BlockLDLQ runs on the device (the same algorithm; kernels::RunBlockLdlq
  // dispatches, the refinement sweeps after it run on the host as on the CPU path).
  QCAL_ASSIGN_OR_RETURN(auto rounded, kernels::RunBlockLdlq(options.gpu, wp.data(), out_pad,
                                                            in_pad, std::move(hp), *codebook, vc));
  hp = std::vector<double>();
  wp = std::vector<double>();
  lap();
  result.times = rounded.times;
  result.refine = rounded.refine;
  data.codes = std::move(rounded.codes);
  std::vector<double>& w_hat = rounded.w_hat;
  if (options.per_row_scale) {
    data.scale = 1.0;  // unused: row_scales apply
    for (int64_t r = 0; r < out_pad; ++r) {
      const double s = data.row_scales[r];
      for (int64_t j = 0; j < in_pad; ++j) w_hat[r * in_pad + j] *= s;
    }
  } else {
    data.scale = rounded.scale;
  }

  // Proxy loss in the original space: Ŵ = Uᵀ Ŵ_q V, sliced to [out, in] (what the layer computes:
  // its inputs are zero-padded and its outputs sliced).
  if (options.incoherence) QCAL_RETURN_IF_ERROR(kernels::RestoreWeights(transforms, w_hat.data()));
  result.transform_seconds += lap();
  if (out_pad != out || in_pad != in) {
    std::vector<double> sliced(out * in);
    for (int64_t r = 0; r < out; ++r) {
      std::copy(&w_hat[r * in_pad], &w_hat[r * in_pad] + in, &sliced[r * in]);
    }
    w_hat = std::move(sliced);
  }
  result.proxy_loss = kernels::ProxyLoss(w, w_hat.data(), h, out, in);
  const double trace = kernels::QuadraticForm(w, h, out, in);
  result.relative = trace != 0 ? result.proxy_loss / trace : std::nan("");
  result.proxy_seconds = lap();
  result.code_bits = codebook->bits_per_weight() * static_cast<double>(out_pad * in_pad) /
                     static_cast<double>(out * in);
  return result;
}

}  // namespace qcal::methods::quip
