#include "kernels/e8p.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace qcal::kernels {
namespace {

// Index of a vector of |coordinates| in {1/2, 3/2, 5/2}^8 for the row lookup: base-3 digits.
constexpr int kRowLookupSize = 6561;  // 3^8

// The 29 padding rows of ||x||^2 = 12 (2·|x|), QuIP# appendix C.1 as listed in
// ../shared/reference/e8p-codebook.md.
constexpr std::array<std::array<int8_t, 8>, kE8pSourceRows - kE8pBallRows> kPadding = {{
    {3, 1, 1, 1, 3, 3, 3, 3}, {1, 3, 1, 1, 3, 3, 3, 3}, {1, 1, 3, 1, 3, 3, 3, 3},
    {1, 1, 1, 3, 3, 3, 3, 3}, {3, 3, 3, 1, 3, 3, 1, 1}, {3, 3, 3, 1, 3, 1, 3, 1},
    {3, 3, 3, 1, 1, 3, 3, 1}, {3, 3, 3, 1, 3, 1, 1, 3}, {3, 3, 3, 1, 1, 3, 1, 3},
    {3, 3, 3, 1, 1, 1, 3, 3}, {3, 3, 1, 3, 3, 3, 1, 1}, {3, 3, 1, 3, 3, 1, 3, 1},
    {3, 3, 1, 3, 1, 3, 3, 1}, {3, 3, 1, 3, 3, 1, 1, 3}, {3, 3, 1, 3, 1, 3, 1, 3},
    {3, 3, 1, 3, 1, 1, 3, 3}, {3, 1, 3, 3, 3, 3, 1, 1}, {3, 1, 3, 3, 3, 1, 3, 1},
    {3, 1, 3, 3, 1, 3, 3, 1}, {3, 1, 3, 3, 3, 1, 1, 3}, {3, 1, 3, 3, 1, 3, 1, 3},
    {1, 3, 3, 3, 1, 1, 3, 3}, {1, 3, 3, 3, 3, 3, 1, 1}, {1, 3, 3, 3, 3, 1, 3, 1},
    {1, 3, 3, 3, 1, 3, 3, 1}, {1, 3, 3, 3, 3, 1, 1, 3}, {1, 3, 3, 3, 1, 3, 1, 3},
    {1, 1, 3, 3, 1, 3, 3, 3}, {3, 3, 1, 1, 3, 3, 3, 1},
}};

E8pSourceTable BuildSource() {
  E8pSourceTable table{};
  // Every |x| of D̂8 is a vector of positive half-integers, and every such vector is one (when
  // its sum is even) or one sign flip (when odd) away from D̂8, so |D̂8| ∩ {||x||^2 <= 10} is
  // simply {t/2 : t ∈ {1,3,5,7}^8, ||t||^2 <= 40}. Counting i upward with coordinate 0 as the
  // most significant base-4 digit visits the vectors in ascending lexicographic order.
  int rows = 0;
  for (int i = 0; i < (1 << 16) && rows < kE8pBallRows; ++i) {
    std::array<int8_t, 8> t{};
    int norm2 = 0;
    for (int j = 0; j < 8; ++j) {
      const int digit = (i >> (2 * (7 - j))) & 3;
      t[j] = static_cast<int8_t>(2 * digit + 1);
      norm2 += t[j] * t[j];
    }
    if (norm2 <= 40) table[rows++] = t;
  }
  for (int r = 0; r < kE8pSourceRows - kE8pBallRows; ++r) table[kE8pBallRows + r] = kPadding[r];
  return table;
}

bool SumIsOdd(const std::array<int8_t, 8>& doubled) {
  int sum = 0;
  for (int8_t v : doubled) sum += v;
  // sum(2s) = 2·sum(s); sum(s) is an integer because there are 8 half-integers.
  return ((sum / 2) & 1) != 0;
}

}  // namespace

const E8pSourceTable& E8pSource() {
  static const E8pSourceTable table = BuildSource();
  return table;
}

const std::array<std::array<int8_t, 8>, kE8pSourceRows - kE8pBallRows>& E8pPaddingRows() {
  return kPadding;
}

void DecodeE8pWithSource(E8pCode code, const std::array<int8_t, 8>& source_row_doubled,
                         float* out) {
  const bool odd = SumIsOdd(source_row_doubled);
  const float shift = code.plus_quarter() ? 0.25f : -0.25f;
  for (int j = 0; j < 8; ++j) {
    const float magnitude = 0.5f * static_cast<float>(source_row_doubled[j]);
    out[j] = (code.Negates(j, odd) ? -magnitude : magnitude) + shift;
  }
}

E8pCodebook::E8pCodebook() : source_(E8pSource()) {
  for (int k = 0; k < kE8pSourceRows; ++k) {
    double norm2 = 0;
    for (int j = 0; j < 8; ++j) {
      s_[j][k] = 0.5 * source_[k][j];
      norm2 += s_[j][k] * s_[j][k];
    }
    norm2_[k] = norm2;
    odd_[k] = SumIsOdd(source_[k]) ? 1.0 : 0.0;
    even_[k] = 1.0 - odd_[k];
  }
  row_of_abs_.assign(kRowLookupSize, -1);
  for (int k = 0; k < kE8pSourceRows; ++k) {
    int index = 0;
    for (int j = 0; j < 8; ++j) index = 3 * index + (source_[k][j] - 1) / 2;  // 1, 3, 5 -> 0, 1, 2
    row_of_abs_[index] = static_cast<int16_t>(k);
  }
}

namespace {

// For source row k and y = x - shift, the sign pattern maximising <y, σ⊙s> under the parity
// constraint, choosing among equally good patterns the one with the smallest code. The
// candidates' distances are equal exactly when they differ only in coordinates with y_j == 0, or
// when the parity repair could flip any of several coordinates with equal cost s_j·|y_j|.
//   * Default: σ_j = sign(y_j), with + for y_j == 0.
//   * Parity wrong and some y_j == 0: flipping such a coordinate is free. Coordinate 0 is not in
//     the code, so prefer it; otherwise negate the last zero coordinate (lowest code bit).
//   * Parity wrong, no zeros: flip a coordinate of least cost. Among those, un-negating the
//     earliest negated coordinate lowers the code most; else flipping coordinate 0 leaves it
//     unchanged; else negating the last one raises it least.
// Returns the 8-bit negation mask (bit j -> coordinate j).
unsigned BestNegationMask(const double* y, const double* s_col, bool source_odd) {
  unsigned neg = 0;
  unsigned zero = 0;
  for (int j = 0; j < 8; ++j) {
    if (y[j] < 0) {
      neg |= 1u << j;
    } else if (y[j] == 0) {
      zero |= 1u << j;
    }
  }
  const bool parity = (__builtin_popcount(neg) & 1) != 0;
  if (parity == source_odd) return neg;
  if (zero != 0) {
    if (zero & 1u) return neg | 1u;
    return neg | (1u << (31 - __builtin_clz(zero)));
  }
  double least = std::numeric_limits<double>::infinity();
  for (int j = 0; j < 8; ++j) least = std::min(least, s_col[j] * std::fabs(y[j]));
  unsigned tied = 0;
  for (int j = 0; j < 8; ++j) {
    if (s_col[j] * std::fabs(y[j]) == least) tied |= 1u << j;
  }
  if (tied == 0) tied = 1u;  // non-finite input: any valid choice
  const unsigned tied_negated = tied & neg & 0xFEu;
  if (tied_negated != 0) return neg ^ (1u << __builtin_ctz(tied_negated));
  if (tied & 1u) return neg ^ 1u;
  return neg ^ (1u << (31 - __builtin_clz(tied)));
}

E8pCode CodeFromMask(int k, unsigned neg, bool plus_quarter) {
  unsigned signs7 = 0;
  for (int j = 1; j < 8; ++j) signs7 |= ((neg >> j) & 1u) << (7 - j);
  return E8pCode::Make(static_cast<unsigned>(k), signs7, plus_quarter);
}

}  // namespace

namespace {

// score[k] for every source row (see EncodeOneByScan). Written out so that the loop over rows is
// the one the compiler vectorizes; cloned for AVX2 (no FMA, so every lane computes exactly what
// the baseline build does: the same bits on any x86-64).
__attribute__((target_clones("avx2", "default"))) double ScoreSourceRows(
    const std::array<std::array<double, kE8pSourceRows>, 8>& s, const double* a_in, double base,
    const double* __restrict norm2, const double* __restrict wrong, double* __restrict score) {
  const double* __restrict s0 = s[0].data();
  const double* __restrict s1 = s[1].data();
  const double* __restrict s2 = s[2].data();
  const double* __restrict s3 = s[3].data();
  const double* __restrict s4 = s[4].data();
  const double* __restrict s5 = s[5].data();
  const double* __restrict s6 = s[6].data();
  const double* __restrict s7 = s[7].data();
  double a[8];
  for (int j = 0; j < 8; ++j) a[j] = a_in[j];
  for (int k = 0; k < kE8pSourceRows; ++k) {
    const double p0 = s0[k] * a[0], p1 = s1[k] * a[1], p2 = s2[k] * a[2], p3 = s3[k] * a[3];
    const double p4 = s4[k] * a[4], p5 = s5[k] * a[5], p6 = s6[k] * a[6], p7 = s7[k] * a[7];
    const double dot = p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7;
    const double m01 = p1 < p0 ? p1 : p0, m23 = p3 < p2 ? p3 : p2;
    const double m45 = p5 < p4 ? p5 : p4, m67 = p7 < p6 ? p7 : p6;
    const double m03 = m23 < m01 ? m23 : m01, m47 = m67 < m45 ? m67 : m45;
    const double least = m47 < m03 ? m47 : m03;
    score[k] = base + norm2[k] - 2 * dot + 4 * least * wrong[k];
  }
  // The minimum, in eight independent lanes.
  double lane_min[8];
  for (int i = 0; i < 8; ++i) lane_min[i] = score[i];
  for (int k = 8; k < kE8pSourceRows; k += 8) {
    for (int i = 0; i < 8; ++i) {
      lane_min[i] = score[k + i] < lane_min[i] ? score[k + i] : lane_min[i];
    }
  }
  double m = lane_min[0];
  for (int i = 1; i < 8; ++i) m = lane_min[i] < m ? lane_min[i] : m;
  return m;
}

}  // namespace

double E8pCodebook::ScanShift(const float* x, bool plus, uint32_t* code) const {
  // ||x - (σ⊙s + shift)||^2 = ||y||^2 - 2<y, σ⊙s> + ||s||^2 with y = x - shift. For each row the
  // best signs are sign(y) except that, when that pattern has the wrong parity, the cheapest
  // coordinate is flipped at a cost of 4·s_j·|y_j|. Exact over all 256 × 128 points of a shift.
  alignas(64) double score[kE8pSourceRows];
  const double shift = plus ? 0.25 : -0.25;
  double y[8];
  double a[8];
  double base = 0;
  unsigned neg_parity = 0;
  for (int j = 0; j < 8; ++j) {
    y[j] = static_cast<double>(x[j]) - shift;
    a[j] = std::fabs(y[j]);
    base += y[j] * y[j];
    neg_parity ^= y[j] < 0 ? 1u : 0u;
  }
  // wrong[k] = 1 when sign(y) has the wrong parity for row k.
  const double* wrong = neg_parity ? even_.data() : odd_.data();
  const double m = ScoreSourceRows(s_, a, base, norm2_.data(), wrong, score);
  *code = UINT32_MAX;
  // Every row at the minimal distance competes on its (smallest) code.
  for (int k = 0; k < kE8pSourceRows; ++k) {
    if (score[k] != m) continue;
    double s_col[8];
    for (int j = 0; j < 8; ++j) s_col[j] = s_[j][k];
    const E8pCode c = CodeFromMask(k, BestNegationMask(y, s_col, odd_[k] != 0), plus);
    *code = std::min<uint32_t>(*code, c.bits);
  }
  return m;
}

E8pCode E8pCodebook::EncodeOneByScan(const float* x, float* out) const {
  double best = std::numeric_limits<double>::infinity();
  uint32_t best_code = UINT32_MAX;  // none yet
  for (int plus = 0; plus < 2; ++plus) {
    uint32_t code;
    const double m = ScanShift(x, plus != 0, &code);
    if (!(m <= best)) continue;  // also skips NaN
    if (m < best) {
      best = m;
      best_code = UINT32_MAX;
    }
    best_code = std::min(best_code, code);
  }
  // Non-finite input leaves no candidate: return code 0 (documented as unspecified).
  const E8pCode result{static_cast<uint16_t>(best_code == UINT32_MAX ? 0 : best_code)};
  if (out != nullptr) DecodeE8pWithSource(result, source_[result.source_index()], out);
  return result;
}

namespace {

// The nearest point p of D̂8 + shift = {(Z + 1/2)^8 with even sum} + shift to x (Conway &
// Sloane's decoder for D8, shifted): with y = x − shift, round every coordinate to its nearest
// half-integer; if the sum is odd, move the coordinate whose second-nearest half-integer costs
// least (cost 1 − 2|y_j − p_j|) there.
struct CosetPoint {
  double dist = 0;   // ||y − p||²; for non-finite or huge input +inf
  double gap = 0;    // lower bound on how much farther the second-nearest coset point is: parity
                     // right, the two cheapest moves together; wrong, the second-cheapest move
                     // minus the cheapest
  bool unique = false;  // false on a tie (a coordinate halfway where that matters), non-finite
                        // or huge input (|y_j| >= 1e6, beyond the integer parity test)
  int index = -1;       // base-3 index of |p| when |p_j| <= 5/2 for all j, else -1
  unsigned neg = 0;     // bit j: p_j < 0
};

// Branch-light so that the data-dependent choices compile to selects; cloned for AVX2 for its
// rounding instruction (no FMA: the same bits as the baseline build).
__attribute__((target_clones("avx2", "default"))) void NearestCosetPoint(const float* x,
                                                                          double shift,
                                                                          CosetPoint* cp) {
  double y[8], p[8], c[8];
  bool finite = true, tie = false;
  double sum = 0.0;
  for (int j = 0; j < 8; ++j) {
    y[j] = static_cast<double>(x[j]) - shift;
    finite &= std::fabs(y[j]) < 1e6;  // false for NaN too
    p[j] = std::floor(y[j]) + 0.5;
    const double d = y[j] - p[j];  // in [-1/2, 1/2)
    tie |= d == -0.5;              // y_j an integer: p_j and p_j − 1 are equally near
    c[j] = 1.0 - 2.0 * std::fabs(d);
    sum += p[j];
  }
  if (!finite) {
    *cp = CosetPoint{std::numeric_limits<double>::infinity(), 0.0, false, -1, 0};
    return;
  }
  int j1 = 0;
  double c1 = c[0];
  for (int j = 1; j < 8; ++j) {
    const bool less = c[j] < c1;
    c1 = less ? c[j] : c1;
    j1 = less ? j : j1;
  }
  double c2 = 2.0;  // every cost is at most 1
  for (int j = 0; j < 8; ++j) c2 = (j != j1 && c[j] < c2) ? c[j] : c2;
  const bool odd = (static_cast<int64_t>(sum) & 1) != 0;  // sum of 8 half-integers: an integer
  if (odd) {
    const double d = y[j1] - p[j1];
    tie |= d == 0.0;  // both neighbours of p_j1 are equally near
    p[j1] += d >= 0.0 ? 1.0 : -1.0;
  }
  cp->gap = odd ? c2 - c1 : c1 + c2;
  double dist = 0.0;
  bool inside = true;
  int index = 0;
  unsigned neg = 0;
  for (int j = 0; j < 8; ++j) {
    dist += (y[j] - p[j]) * (y[j] - p[j]);
    const double a = std::fabs(p[j]);
    inside &= a <= 2.5;
    index = 3 * index + static_cast<int>(std::min(a, 2.5) - 0.5);  // 1/2, 3/2, 5/2 -> 0, 1, 2
    neg |= (p[j] < 0.0 ? 1u : 0u) << j;
  }
  cp->dist = dist;
  cp->unique = !tie;
  cp->index = inside ? index : -1;
  cp->neg = neg;
}

}  // namespace

E8pCode E8pCodebook::EncodeOne(const float* x, float* out) const {
  // Every E8P point with shift ±1/4 lies in D̂8 ± 1/4, so when the nearest point of the whole
  // coset D̂8 + shift is a codebook point (its |coordinates| form a source row) it is the nearest
  // codebook point of that shift, and the other shift's nearest coset point bounds its codebook
  // points from below. When one shift's coset-nearest point is in the codebook, unique, and
  // nearer than everything of the other shift by a margin far above double rounding, it is the
  // answer; otherwise (the point lies outside the ball, a tie or near-tie, non-finite input)
  // the exact scan decides. The two agree wherever the fast path answers, so the codes are those
  // of EncodeOneByScan (tested on every kind of input).
  double dist[2], gap[2];
  bool unique[2];
  int row[2];
  unsigned neg[2];
  for (int plus = 0; plus < 2; ++plus) {
    CosetPoint cp;
    NearestCosetPoint(x, plus ? 0.25 : -0.25, &cp);
    dist[plus] = cp.dist;
    gap[plus] = cp.gap;
    unique[plus] = cp.unique;
    neg[plus] = cp.neg;
    row[plus] = cp.index >= 0 ? row_of_abs_[cp.index] : -1;
  }
  // a: the shift whose coset point is nearer.
  const int a = dist[0] <= dist[1] ? 0 : 1, b = 1 - a;
  const double margin = 1e-9 * (1.0 + std::min(dist[a], dist[b]));
  auto clear = [&](int s) { return unique[s] && row[s] >= 0 && gap[s] > margin; };
  E8pCode code;
  bool decided = false;
  if (clear(a) && dist[a] < dist[b] - margin) {
    code = CodeFromMask(row[a], neg[a], a != 0);
    decided = true;
  } else if (clear(b)) {
    // Shift a's nearest coset point is outside the codebook: scan that shift alone.
    uint32_t code_a;
    const double m_a = ScanShift(x, a != 0, &code_a);
    if (dist[b] < m_a - margin) {
      code = CodeFromMask(row[b], neg[b], b != 0);
      decided = true;
    } else if (m_a < dist[b] - margin) {
      code = E8pCode{static_cast<uint16_t>(code_a)};
      decided = true;
    }
  }
  if (decided) {
    if (out != nullptr) DecodeE8pWithSource(code, source_[code.source_index()], out);
    return code;
  }
  return EncodeOneByScan(x, out);
}

void E8pCodebook::Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const {
  for (int64_t i = 0; i < count; ++i) {
    float in[8];
    std::copy(x + 8 * i, x + 8 * i + 8, in);  // out may alias x
    const E8pCode code = EncodeOne(in, out + 8 * i);
    if (codes != nullptr) codes[i] = code.bits;
  }
}

void E8pCodebook::Decode(const uint32_t* codes, int64_t count, float* out) const {
  for (int64_t i = 0; i < count; ++i) {
    const E8pCode code{static_cast<uint16_t>(codes[i] & 0xFFFFu)};
    DecodeE8pWithSource(code, source_[code.source_index()], out + 8 * i);
  }
}

void E8pCodebook::BuildExpansion() const {
  expanded_.resize(static_cast<size_t>(kE8pNumCodes) * 8);
  expanded_soa_.resize(static_cast<size_t>(kE8pNumCodes) * 8);
  for (int c = 0; c < kE8pNumCodes; ++c) {
    const E8pCode code{static_cast<uint16_t>(c)};
    float* p = expanded_.data() + 8 * static_cast<size_t>(c);
    DecodeE8pWithSource(code, source_[code.source_index()], p);
    for (int j = 0; j < 8; ++j) expanded_soa_[static_cast<size_t>(j) * kE8pNumCodes + c] = p[j];
  }
}

const std::vector<float>& E8pCodebook::expanded() const {
  std::call_once(expansion_once_, [this] { BuildExpansion(); });
  return expanded_;
}

void E8pCodebook::QuantizeBruteForce(const float* x, int64_t count, float* out,
                                     uint32_t* codes) const {
  const std::vector<float>& points = expanded();
  constexpr int kBlock = 8;    // vectors per pass over the table
  constexpr int kChunk = 256;  // codes per inner tile (16 KiB of doubles)
  for (int64_t i0 = 0; i0 < count; i0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, count - i0));
    double xs[kBlock][8];
    double best[kBlock];
    int best_code[kBlock];
    for (int v = 0; v < n; ++v) {
      for (int j = 0; j < 8; ++j) xs[v][j] = x[8 * (i0 + v) + j];
      best[v] = std::numeric_limits<double>::infinity();
      best_code[v] = 0;
    }
    alignas(64) double dist[kChunk];
    for (int c0 = 0; c0 < kE8pNumCodes; c0 += kChunk) {
      const double* base = expanded_soa_.data() + c0;
      const double* p0 = base;
      const double* p1 = base + 1 * kE8pNumCodes;
      const double* p2 = base + 2 * kE8pNumCodes;
      const double* p3 = base + 3 * kE8pNumCodes;
      const double* p4 = base + 4 * kE8pNumCodes;
      const double* p5 = base + 5 * kE8pNumCodes;
      const double* p6 = base + 6 * kE8pNumCodes;
      const double* p7 = base + 7 * kE8pNumCodes;
      for (int v = 0; v < n; ++v) {
        const double* xv = xs[v];
        // Written out so that the loop over codes is the one the compiler vectorizes.
        for (int c = 0; c < kChunk; ++c) {
          const double t0 = xv[0] - p0[c], t1 = xv[1] - p1[c], t2 = xv[2] - p2[c];
          const double t3 = xv[3] - p3[c], t4 = xv[4] - p4[c], t5 = xv[5] - p5[c];
          const double t6 = xv[6] - p6[c], t7 = xv[7] - p7[c];
          dist[c] = t0 * t0 + t1 * t1 + t2 * t2 + t3 * t3 + t4 * t4 + t5 * t5 + t6 * t6 + t7 * t7;
        }
        // Eight independent running minima keep the compare chain short.
        double lane_min[8];
        for (int k = 0; k < 8; ++k) lane_min[k] = dist[k];
        for (int c = 8; c < kChunk; c += 8) {
          for (int k = 0; k < 8; ++k) {
            lane_min[k] = dist[c + k] < lane_min[k] ? dist[c + k] : lane_min[k];
          }
        }
        double chunk_min = lane_min[0];
        for (int k = 1; k < 8; ++k) chunk_min = lane_min[k] < chunk_min ? lane_min[k] : chunk_min;
        // Codes ascend and a later chunk must be strictly better: the smallest code wins ties.
        if (chunk_min < best[v]) {
          int c = 0;
          while (dist[c] != chunk_min) ++c;
          best[v] = chunk_min;
          best_code[v] = c0 + c;
        }
      }
    }
    for (int v = 0; v < n; ++v) {
      const float* p = points.data() + 8 * static_cast<size_t>(best_code[v]);
      std::copy(p, p + 8, out + 8 * (i0 + v));  // xs holds the input, so out may alias x
      if (codes != nullptr) codes[i0 + v] = static_cast<uint32_t>(best_code[v]);
    }
  }
}

}  // namespace qcal::kernels
