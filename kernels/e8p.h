// E8P: QuIP#'s 2-bit, 8-dimensional lattice codebook (QuIP# §4.2, appendix C).
//
// The source table S holds 256 vectors of |D̂8| (element-wise absolute values of
// D̂8 = {x ∈ (Z+1/2)^8 : sum(x) even}):
//
//   rows 0..226:   every |x|, x ∈ D̂8, with ||x||^2 <= 10, in ascending lexicographic order of the
//                  absolute vectors (the order torch.unique gives in the reference code);
//   rows 227..255: 29 padding vectors of ||x||^2 = 12 with entries 1/2 and 3/2, in the order of
//                  ../shared/reference/e8p-codebook.md.
//
// Each 16-bit code (layout: kernels/e8p_format.h) picks a row, 7 signs (the 8th follows from
// parity) and a ±1/4 shift, so the 65,536 decoded points are the subset
// {σ ⊙ S[k] : σ makes the sum even} ± 1/4 of E8 + 1/4. Points are multiples of 1/4 with
// |coordinate| <= 11/4, so they are exact in float (and in fp16).
//
// Units: the codebook works at unit scale; callers multiply unit-RMS weights by a scale (about
// 1.03 for Gaussian input, default_scale()) before Quantize and divide afterwards.
//
// Thread-safety: immutable after construction; all methods may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/codebook.h"
#include "kernels/e8p_format.h"

namespace qcal::kernels {

// The E8P source table S stored as 2·S: odd integers in {1, 3, 5} (S has entries 1/2, 3/2, 5/2).
using E8pSourceTable = std::array<std::array<int8_t, 8>, kE8pSourceRows>;

// Builds S from the rules above (enumeration + the 29 padding rows). Deterministic.
const E8pSourceTable& E8pSource();

// The 29 padding rows (as 2·|x|), in table order; exposed for tests.
const std::array<std::array<int8_t, 8>, kE8pSourceRows - kE8pBallRows>& E8pPaddingRows();

// Decodes one code against a source row given as 2·|s| (odd integers). out: 8 floats.
// Exposed so that the appendix C.2 example (whose s is hypothetical) can be checked directly.
void DecodeE8pWithSource(E8pCode code, const std::array<int8_t, 8>& source_row_doubled, float* out);

class E8pCodebook final : public VectorCodebook {
 public:
  // Multiplier on unit-RMS (Gaussian) input that minimises the MSE; the reference uses 1.03.
  static constexpr double kDefaultScale = 1.03;

  E8pCodebook();

  std::string name() const override { return "e8p"; }
  int dim() const override { return 8; }
  int code_words() const override { return 1; }
  double bits_per_weight() const override { return 2.0; }
  double default_scale() const override { return kDefaultScale; }

  // Exact nearest point among the 65,536 (squared Euclidean distance). Ties (equal distances as
  // computed in double precision) go to the smallest code. codes: 16-bit codes in uint32 words.
  // Cost: a lattice decode per shift (about 2 × 8 roundings) for points whose nearest coset
  // point lies in the codebook by a clear margin; the exact scan (EncodeOneByScan) otherwise.
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override;
  // Decodes from the 256×8 source table alone. Bits above the low 16 of each code are ignored.
  void Decode(const uint32_t* codes, int64_t count, float* out) const override;

  // Reference encoder: scans all 65,536 decoded points, keeping the first (smallest code) of the
  // minimal squared distances computed as sum_i (x_i - p_i)^2 in double. Same contract as
  // Quantize; about 100x slower. For tests and benchmarks.
  void QuantizeBruteForce(const float* x, int64_t count, float* out, uint32_t* codes) const;

  // Encodes one vector (the fast exact encoder). out may be nullptr. Non-finite input gives an
  // unspecified (valid) code.
  E8pCode EncodeOne(const float* x, float* out) const;
  // The exact scan over 2 shifts × 256 source rows × 8 coordinates that EncodeOne falls back
  // to; it gives the same codes as EncodeOne on every input. For tests and benchmarks.
  E8pCode EncodeOneByScan(const float* x, float* out) const;

  // The full expansion: point c at expanded()[8c .. 8c+7], c = code. 65,536 × 8 floats.
  // Built on first use (thread-safe); about 6 MiB together with the brute-force table.
  const std::vector<float>& expanded() const;
  const E8pSourceTable& source() const { return source_; }

 private:
  void BuildExpansion() const;
  // The exact scan of one shift: its minimal distance (as computed; NaN for NaN input) and in
  // *code the smallest code at that distance.
  double ScanShift(const float* x, bool plus, uint32_t* code) const;

  const E8pSourceTable& source_;
  // Per source row, structure-of-arrays for the encoder: s_[j][k] = S[k][j] (double),
  // norm2_[k] = ||S[k]||^2, odd_[k] = sum(S[k]) mod 2.
  std::array<std::array<double, kE8pSourceRows>, 8> s_;
  std::array<double, kE8pSourceRows> norm2_;
  std::array<double, kE8pSourceRows> odd_;   // 0.0 or 1.0
  std::array<double, kE8pSourceRows> even_;  // 1 - odd_
  // Source row of each |x| in {1/2, 3/2, 5/2}^8 (base-3 index, coordinate 0 most significant),
  // -1 for vectors that are not rows.
  std::vector<int16_t> row_of_abs_;
  mutable std::once_flag expansion_once_;
  mutable std::vector<float> expanded_;
  // Structure-of-arrays copy of expanded_ in double for the brute-force scan:
  // expanded_soa_[j * 65536 + c] = coordinate j of point c.
  mutable std::vector<double> expanded_soa_;
};

}  // namespace qcal::kernels
