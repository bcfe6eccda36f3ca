// The E8P 16-bit code layout, defined once for host and device code.
//
// E8P (QuIP# §4.2, appendix C) quantizes 8 weights to one of 2^16 points of E8 + 1/4:
//
//   point = sign-pattern ⊙ S[k]  ±  1/4·(1,...,1)
//
// where S is the 256-entry source table of |D̂8| vectors (kernels/e8p.h) and the sign pattern
// makes the signed vector a member of D̂8 = {x ∈ (Z+1/2)^8 : sum(x) even}. A code is
//
//   bit  15 ........ 8 | 7 6 5 4 3 2 1 | 0
//        source index k | sign bits      | shift
//
//   * bits 15..8: k, the row of S (0..255);
//   * bits 7..1:  signs of coordinates 1..7, one bit each, coordinate j at bit 8 - j
//                 (bit 7 -> coordinate 1, ..., bit 1 -> coordinate 7); a set bit negates;
//   * bit 0:      1 -> +1/4, 0 -> -1/4;
//   * coordinate 0's sign is implied: flipping one half-integer coordinate changes the parity of
//     the sum, so the number of negated coordinates must have the parity of sum(S[k]) (an
//     integer); coordinate 0 is negated iff popcount(bits 7..1) + sum(S[k]) is odd.
//
// Evidence for this order: QuIP# appendix C.2 decodes codeword 00010101|1001011|1 (our copy of
// the paper drops three digits of the string; the three fields it quotes are these) as
// "S[21], negate the 1st, 2nd, 4th and 7th coordinates from the right, the 8th from the right by
// parity, add 1/4" — with coordinates numbered 0..7 from the left that is coordinates 7, 6, 4, 1
// and the implied coordinate 0. The reference implementation's original ("origorder") codebook,
// Cornell-RelaxML/quip-sharp lib/codebook/latticee8_padded12.py get_full_grid, builds the same
// codes: (k << 8) + (signs7 << 1) + (shift is +1/4), sign bit 6 of signs7 for coordinate 1 through
// bit 0 for coordinate 7, coordinate 0 fixed by parity. (The reference's later "v1" layout for its
// fused GPU kernel stores 8 interleaved sign bits whose parity selects the shift, with the last
// coordinate of odd-sum rows pre-negated in the packed table; it spans the same 2^16 points with a
// different numbering. qcal uses the paper's layout above.) The worked example's last vector has
// a typo in its second coordinate (-3/4 for -1/2 + 1/4 = -1/4); our test checks the corrected one.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QCAL_E8P_HD __host__ __device__
#else
#define QCAL_E8P_HD
#endif

namespace qcal::kernels {

// One E8P code. A plain 16-bit word; the accessors name its fields.
struct E8pCode {
  uint16_t bits = 0;

  static constexpr int kSourceShift = 8;
  static constexpr uint16_t kSignMask = 0x00FE;  // bits 7..1
  static constexpr uint16_t kShiftMask = 0x0001;

  // sign_bits7: bit 6 -> coordinate 1, ..., bit 0 -> coordinate 7 (the paper's 7-bit string
  // read left to right is coordinates 1..7).
  QCAL_E8P_HD static constexpr E8pCode Make(unsigned source_index, unsigned sign_bits7,
                                            bool plus_quarter) {
    return E8pCode{static_cast<uint16_t>(((source_index & 0xFFu) << kSourceShift) |
                                         ((sign_bits7 & 0x7Fu) << 1) | (plus_quarter ? 1u : 0u))};
  }
  QCAL_E8P_HD constexpr unsigned source_index() const { return bits >> kSourceShift; }
  QCAL_E8P_HD constexpr unsigned sign_bits7() const { return (bits & kSignMask) >> 1; }
  QCAL_E8P_HD constexpr bool plus_quarter() const { return (bits & kShiftMask) != 0; }
  // Whether coordinate j (1..7) is negated; coordinate 0 needs the source parity, see below.
  QCAL_E8P_HD constexpr bool NegatesExplicit(int j) const { return (bits >> (8 - j)) & 1u; }
  // Whether coordinate 0 is negated, given sum(S[k]) mod 2 (source_sum_odd).
  QCAL_E8P_HD constexpr bool NegatesCoordinate0(bool source_sum_odd) const {
    unsigned v = sign_bits7();
    unsigned parity = 0;
    for (int i = 0; i < 7; ++i) parity ^= (v >> i) & 1u;
    return (parity ^ (source_sum_odd ? 1u : 0u)) != 0;
  }
  // Whether coordinate j (0..7) is negated.
  QCAL_E8P_HD constexpr bool Negates(int j, bool source_sum_odd) const {
    return j == 0 ? NegatesCoordinate0(source_sum_odd) : NegatesExplicit(j);
  }
};

static_assert(sizeof(E8pCode) == 2, "E8pCode must be exactly one 16-bit word");
// The worked example of QuIP# appendix C.2: k = 21, signs 1001011, shift +1/4.
static_assert(E8pCode::Make(21, 0b1001011, true).bits == 0b0001010110010111, "C.2 layout");
static_assert(E8pCode{0b0001010110010111}.source_index() == 21, "C.2 layout");
static_assert(E8pCode{0b0001010110010111}.sign_bits7() == 0b1001011, "C.2 layout");
static_assert(E8pCode{0b0001010110010111}.NegatesExplicit(1) &&
                  !E8pCode{0b0001010110010111}.NegatesExplicit(2) &&
                  !E8pCode{0b0001010110010111}.NegatesExplicit(3) &&
                  E8pCode{0b0001010110010111}.NegatesExplicit(4) &&
                  !E8pCode{0b0001010110010111}.NegatesExplicit(5) &&
                  E8pCode{0b0001010110010111}.NegatesExplicit(6) &&
                  E8pCode{0b0001010110010111}.NegatesExplicit(7),
              "C.2: negate the 1st, 2nd, 4th and 7th coordinates from the right");
// The example's s = (1,1,1,3,1,1,1,1)/2 has sum 5 (odd), so coordinate 0 (8th from the right) is
// negated as well.
static_assert(E8pCode{0b0001010110010111}.NegatesCoordinate0(true), "C.2 parity");
static_assert(E8pCode{0b0001010110010111}.plus_quarter(), "C.2 shift");

// Number of E8P codes and rows of the source table.
inline constexpr int kE8pNumCodes = 1 << 16;
inline constexpr int kE8pSourceRows = 256;
// Rows of S with norm^2 <= 10 (the rest are the 29 norm^2 = 12 padding rows).
inline constexpr int kE8pBallRows = 227;

}  // namespace qcal::kernels
