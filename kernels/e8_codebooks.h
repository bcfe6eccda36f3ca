// The other codebooks of QuIP#'s family: the 1-bit E8 codebook, residual VQ (RVQ) stacks of
// E8P / E8 stages, and the scalar half-integer grid of the "no E8" ablation.
//
// All work at unit scale (see kernels/codebook.h): default_scale() is the multiplier for unit-RMS
// Gaussian input. Encoders are exact nearest-point searches; ties (equal distances as computed in
// double precision) go to the smallest code.
//
// Thread-safety: immutable after construction; all methods may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/codebook.h"

namespace qcal::kernels {

// E8 at 1 bit per weight: 256 points of E8 — the origin, the 240 roots (norm^2 2) and 15 of the
// 16 vectors ±2·e_i (all but -2·e_7, counting coordinates from 0). Index order follows the
// reference implementation (quip-sharp get_e81bgrid): the integer points in ascending
// lexicographic order (112 roots ±e_i±e_j and the origin), then the 128 half-integer roots
// (±1/2)^8 with an even number of minus signs in ascending lexicographic order, then
// +2e_0..+2e_7, -2e_0..-2e_6. Codes are indices 0..255 (bits above the low 8 are ignored).
class E8OneBitCodebook final : public VectorCodebook {
 public:
  // Best multiplier for unit Gaussian input when used on its own (bench/codebook_mse: 0.604,
  // MSE 0.318). As the second RVQ stage it sees the residual scaled by RvqScales.
  static constexpr double kDefaultScale = 0.60;

  E8OneBitCodebook();

  std::string name() const override { return "e8_1bit"; }
  int dim() const override { return 8; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override { return 1.0; }
  double default_scale() const override { return kDefaultScale; }
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override;
  void Decode(const uint32_t* codes, int64_t count, float* out) const override;

  // Point i (8 floats, exact: entries in {0, ±1/2, ±1, ±2}).
  const std::array<float, 8>& point(int i) const { return points_[i]; }

 private:
  std::array<std::array<float, 8>, 256> points_;
  std::array<std::array<double, 256>, 8> soa_;  // soa_[j][c] = points_[c][j]
};

// Scales of a two-stage RVQ, in the reference implementation's convention:
//   input_scale:    the multiplier for unit-RMS input (the codebook's default_scale());
//   residual_scale: the multiplier applied to the first stage's residual before the second stage,
//                   Quantize(x) = Q1(x) + Q2((x - Q1(x))·residual_scale) / residual_scale.
// In the notation Q1(x/s1)·s1 + Q2((x - Q1(x/s1)·s1)/s2)·s2 applied to the codebook's input x,
// that is s1 = 1 and s2 = 1/residual_scale (and, relative to unit-RMS weights, the caller's
// 1/input_scale multiplies both).
struct RvqScales {
  double input_scale = 1.0;
  double residual_scale = 1.0;
};

// QuIP# §4.3 / appendix F.5 reference scales. On N(0,1) (bench/codebook_mse, 2^19 weights) the
// rvq3 optimum is (0.985, 2.04), the reference values; for rvq4 the optimum is (0.90, 3.74), MSE
// 0.0084 against 0.0096 at the reference (1.03, 3.45), so sweep both scales where it matters.
inline constexpr RvqScales kRvq3Scales{0.98, 2.04};  // E8P + E8 1-bit
inline constexpr RvqScales kRvq4Scales{1.03, 3.45};  // E8P + E8P

// Two-stage residual VQ. Codes: [count, 2], word 0 the first stage's code, word 1 the second's.
class RvqCodebook final : public VectorCodebook {
 public:
  // stage1 and stage2 must have the same dim() and one code word each; they may be the same
  // object. residual_scale must be positive and finite.
  RvqCodebook(std::string name, std::shared_ptr<const VectorCodebook> stage1,
              std::shared_ptr<const VectorCodebook> stage2, RvqScales scales);

  std::string name() const override { return name_; }
  int dim() const override { return stage1_->dim(); }
  int code_words() const override { return 2; }
  double bits_per_weight() const override {
    return stage1_->bits_per_weight() + stage2_->bits_per_weight();
  }
  double default_scale() const override { return scales_.input_scale; }
  // Greedy residual quantization (each stage exact nearest; the sum is not necessarily the
  // nearest point of the sum set). out may alias x.
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override;
  void Decode(const uint32_t* codes, int64_t count, float* out) const override;

  const RvqScales& scales() const { return scales_; }
  const VectorCodebook& stage1() const { return *stage1_; }
  const VectorCodebook& stage2() const { return *stage2_; }

 private:
  std::string name_;
  std::shared_ptr<const VectorCodebook> stage1_;
  std::shared_ptr<const VectorCodebook> stage2_;
  RvqScales scales_;
  float residual_scale_;  // as float: Quantize and Decode combine stages with the same ops
};

// The 1-D half-integer grid {±1/2, ±3/2, ..., ±(2^(b-1) - 1/2)} (2^b levels, dim 1): QuIP#'s
// "no E8" ablation. Code k in [0, 2^b) is the level k - (2^b - 1)/2; bits above b are ignored.
class HalfIntegerGridCodebook final : public VectorCodebook {
 public:
  // bits in [1, 8] (values outside are clamped); MakeCodebook offers 2, 3 and 4.
  explicit HalfIntegerGridCodebook(int bits);

  std::string name() const override { return "halfint" + std::to_string(bits_); }
  int dim() const override { return 1; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override { return bits_; }
  // The multiplier that makes the grid step the Gaussian-optimal uniform step: 1.005, 1.706,
  // 2.985 for 2, 3, 4 bits (steps 0.995, 0.586, 0.335).
  double default_scale() const override;
  // Ties (x exactly between two levels) go to the lower level, i.e. the smaller code.
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override;
  void Decode(const uint32_t* codes, int64_t count, float* out) const override;

 private:
  int bits_;
  int levels_;
};

// Builds "rvq3_e8p_e8" or "rvq4_e8p_e8p" with the given scales (MakeCodebook uses kRvq3Scales /
// kRvq4Scales). InvalidArgument for other names or non-positive / non-finite scales.
StatusOr<std::unique_ptr<VectorCodebook>> MakeRvqCodebook(const std::string& name,
                                                          RvqScales scales);

}  // namespace qcal::kernels
