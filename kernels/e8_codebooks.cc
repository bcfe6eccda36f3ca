#include "kernels/e8_codebooks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/e8p.h"

namespace qcal::kernels {

// ---------------------------------------------------------------------------------------------
// E8, 1 bit
// ---------------------------------------------------------------------------------------------

E8OneBitCodebook::E8OneBitCodebook() {
  int n = 0;
  // Integer points of norm^2 <= 2 have entries in {-1, 0, 1}; counting in base 3 with coordinate
  // 0 most significant visits them in ascending lexicographic order.
  for (int i = 0; i < 6561; ++i) {
    std::array<float, 8> p{};
    int sum = 0;
    int norm2 = 0;
    for (int j = 7, rest = i; j >= 0; --j, rest /= 3) {
      const int digit = rest % 3;
      p[j] = static_cast<float>(digit - 1);
      sum += digit - 1;
      norm2 += (digit - 1) * (digit - 1);
    }
    if (norm2 <= 2 && sum % 2 == 0) points_[n++] = p;
  }
  // Half-integer roots: bit (7 - j) of i set means coordinate j is +1/2 (so ascending i is
  // ascending lexicographic order); an even number of minus signs makes the sum even.
  for (int i = 0; i < 256; ++i) {
    if (__builtin_popcount(static_cast<unsigned>(~i) & 0xFFu) % 2 != 0) continue;
    std::array<float, 8> p{};
    for (int j = 0; j < 8; ++j) p[j] = ((i >> (7 - j)) & 1) ? 0.5f : -0.5f;
    points_[n++] = p;
  }
  for (int sign = 1; sign >= -1; sign -= 2) {
    for (int j = 0; j < 8; ++j) {
      if (sign < 0 && j == 7) continue;
      std::array<float, 8> p{};
      p[j] = 2.0f * static_cast<float>(sign);
      points_[n++] = p;
    }
  }
  for (int c = 0; c < 256; ++c) {
    for (int j = 0; j < 8; ++j) soa_[j][c] = points_[c][j];
  }
}

void E8OneBitCodebook::Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const {
  const double *p0 = soa_[0].data(), *p1 = soa_[1].data(), *p2 = soa_[2].data();
  const double *p3 = soa_[3].data(), *p4 = soa_[4].data(), *p5 = soa_[5].data();
  const double *p6 = soa_[6].data(), *p7 = soa_[7].data();
  alignas(64) double dist[256];
  for (int64_t i = 0; i < count; ++i) {
    double xs[8];
    for (int j = 0; j < 8; ++j) xs[j] = x[8 * i + j];
    // Written out so that the loop over points is the one the compiler vectorizes.
    for (int c = 0; c < 256; ++c) {
      const double t0 = xs[0] - p0[c], t1 = xs[1] - p1[c], t2 = xs[2] - p2[c];
      const double t3 = xs[3] - p3[c], t4 = xs[4] - p4[c], t5 = xs[5] - p5[c];
      const double t6 = xs[6] - p6[c], t7 = xs[7] - p7[c];
      dist[c] = t0 * t0 + t1 * t1 + t2 * t2 + t3 * t3 + t4 * t4 + t5 * t5 + t6 * t6 + t7 * t7;
    }
    double lane_min[8];
    for (int k = 0; k < 8; ++k) lane_min[k] = dist[k];
    for (int c = 8; c < 256; c += 8) {
      for (int k = 0; k < 8; ++k) {
        lane_min[k] = dist[c + k] < lane_min[k] ? dist[c + k] : lane_min[k];
      }
    }
    double m = lane_min[0];
    for (int k = 1; k < 8; ++k) m = lane_min[k] < m ? lane_min[k] : m;
    int best_index = 0;  // the first index at the minimum: smallest index wins ties
    while (best_index < 256 && dist[best_index] != m) ++best_index;
    if (best_index == 256) best_index = 0;  // non-finite input
    std::copy(points_[best_index].begin(), points_[best_index].end(), out + 8 * i);
    if (codes != nullptr) codes[i] = static_cast<uint32_t>(best_index);
  }
}

void E8OneBitCodebook::Decode(const uint32_t* codes, int64_t count, float* out) const {
  for (int64_t i = 0; i < count; ++i) {
    const auto& p = points_[codes[i] & 0xFFu];
    std::copy(p.begin(), p.end(), out + 8 * i);
  }
}

// ---------------------------------------------------------------------------------------------
// RVQ
// ---------------------------------------------------------------------------------------------

RvqCodebook::RvqCodebook(std::string name, std::shared_ptr<const VectorCodebook> stage1,
                         std::shared_ptr<const VectorCodebook> stage2, RvqScales scales)
    : name_(std::move(name)),
      stage1_(std::move(stage1)),
      stage2_(std::move(stage2)),
      scales_(scales),
      residual_scale_(static_cast<float>(scales.residual_scale)) {}

namespace {

// Shared by Quantize and Decode so both produce bit-identical sums.
inline float CombineStages(float q1, float q2, float residual_scale) {
  return q1 + q2 / residual_scale;
}

}  // namespace

void RvqCodebook::Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const {
  const int d = dim();
  constexpr int64_t kBlock = 256;
  std::vector<float> q1(kBlock * d);
  std::vector<float> residual(kBlock * d);
  std::vector<uint32_t> c1(kBlock);
  std::vector<uint32_t> c2(kBlock);
  for (int64_t i0 = 0; i0 < count; i0 += kBlock) {
    const int64_t n = std::min(kBlock, count - i0);
    const float* xb = x + i0 * d;
    stage1_->Quantize(xb, n, q1.data(), c1.data());
    for (int64_t t = 0; t < n * d; ++t) residual[t] = (xb[t] - q1[t]) * residual_scale_;
    stage2_->Quantize(residual.data(), n, residual.data(), c2.data());
    float* ob = out + i0 * d;  // x is no longer read past this point for this block
    for (int64_t t = 0; t < n * d; ++t) ob[t] = CombineStages(q1[t], residual[t], residual_scale_);
    if (codes != nullptr) {
      for (int64_t v = 0; v < n; ++v) {
        codes[2 * (i0 + v)] = c1[v];
        codes[2 * (i0 + v) + 1] = c2[v];
      }
    }
  }
}

void RvqCodebook::Decode(const uint32_t* codes, int64_t count, float* out) const {
  const int d = dim();
  constexpr int64_t kBlock = 256;
  std::vector<float> q1(kBlock * d);
  std::vector<float> q2(kBlock * d);
  std::vector<uint32_t> c1(kBlock);
  std::vector<uint32_t> c2(kBlock);
  for (int64_t i0 = 0; i0 < count; i0 += kBlock) {
    const int64_t n = std::min(kBlock, count - i0);
    for (int64_t v = 0; v < n; ++v) {
      c1[v] = codes[2 * (i0 + v)];
      c2[v] = codes[2 * (i0 + v) + 1];
    }
    stage1_->Decode(c1.data(), n, q1.data());
    stage2_->Decode(c2.data(), n, q2.data());
    float* ob = out + i0 * d;
    for (int64_t t = 0; t < n * d; ++t) ob[t] = CombineStages(q1[t], q2[t], residual_scale_);
  }
}

StatusOr<std::unique_ptr<VectorCodebook>> MakeRvqCodebook(const std::string& name,
                                                          RvqScales scales) {
  const auto valid = [](double s) { return std::isfinite(s) && s > 0; };
  if (!valid(scales.input_scale) || !valid(scales.residual_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("RVQ scales must be positive and finite, got ",
                                                   scales.input_scale, " and ",
                                                   scales.residual_scale));
  }
  auto e8p = std::make_shared<const E8pCodebook>();
  if (name == "rvq3_e8p_e8") {
    return std::unique_ptr<VectorCodebook>(
        new RvqCodebook(name, e8p, std::make_shared<const E8OneBitCodebook>(), scales));
  }
  if (name == "rvq4_e8p_e8p") {
    return std::unique_ptr<VectorCodebook>(new RvqCodebook(name, e8p, e8p, scales));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown RVQ codebook '", name, "' (expected rvq3_e8p_e8 or rvq4_e8p_e8p)"));
}

// ---------------------------------------------------------------------------------------------
// Half-integer grid
// ---------------------------------------------------------------------------------------------

HalfIntegerGridCodebook::HalfIntegerGridCodebook(int bits)
    : bits_(std::clamp(bits, 1, 8)), levels_(1 << bits_) {}

double HalfIntegerGridCodebook::default_scale() const {
  // 1 / (the MSE-optimal uniform step for N(0,1) with 2^bits levels), as measured by a fine sweep
  // over 2^20 samples; they agree with Max (1960): steps 1.596, 0.9957, 0.5860, 0.3352, ...
  static constexpr double kScale[9] = {0, 0.627, 1.005, 1.706, 2.985, 5.32, 9.63, 17.7, 32.2};
  return kScale[bits_];
}

void HalfIntegerGridCodebook::Quantize(const float* x, int64_t count, float* out,
                                       uint32_t* codes) const {
  const double offset = 0.5 * (levels_ - 1);
  for (int64_t i = 0; i < count; ++i) {
    // Level k sits at k - offset; the nearest is round(x + offset), halves going down so that
    // ties pick the smaller code. NaN maps to code 0.
    const double k = std::ceil(static_cast<double>(x[i]) + offset - 0.5);
    int code = 0;
    if (k >= levels_ - 1) {
      code = levels_ - 1;
    } else if (k > 0) {
      code = static_cast<int>(k);
    }
    out[i] = static_cast<float>(code - offset);
    if (codes != nullptr) codes[i] = static_cast<uint32_t>(code);
  }
}

void HalfIntegerGridCodebook::Decode(const uint32_t* codes, int64_t count, float* out) const {
  const double offset = 0.5 * (levels_ - 1);
  const uint32_t mask = static_cast<uint32_t>(levels_ - 1);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>((codes[i] & mask) - offset);
}

}  // namespace qcal::kernels
