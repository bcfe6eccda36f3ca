#include "kernels/hessian_fixed.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/cpu.h"
#include "kernels/blas_threads.h"

namespace qcal::kernels {

namespace {

constexpr double kScale = 0x1p50;  // 2^kHessianFracBits
static_assert(kHessianFracBits == 50, "kScale must be 2^kHessianFracBits");

// packed[(i, j)] += q(P[i][j]) + q(P[j][i]) for i <= j; P is [n, n] row-major. In 64x64 tiles so
// both the row and the column reads stay in cache; tile rows are paired (k, last − k) so every
// parallel work item has the same amount of work. Returns false on overflow.
bool AccumulateSymmetricImpl(const double* p, int64_t n, int threads, Fixed128* packed) {
  constexpr int64_t kTile = 64;
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::atomic<bool> ok{true};
  auto tile_row = [&](int64_t ti) {
    const int64_t i0 = ti * kTile, i1 = std::min(n, i0 + kTile);
    for (int64_t tj = ti; tj < tiles; ++tj) {
      const int64_t j0 = tj * kTile, j1 = std::min(n, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        Fixed128* row = packed + (i * n - i * (i - 1) / 2 - i);  // row[j] = T(i, j)
        const double* pi = p + i * n;
        for (int64_t j = std::max(j0, i); j < j1; ++j) {
          Fixed128 a, b;
          if (!ToFixed128(static_cast<double>(pi[j]), &a) ||
              !ToFixed128(static_cast<double>(p[j * n + i]), &b) || !AddFixed128(&row[j], a + b)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  };
  qcal::ParallelTasks((tiles + 1) / 2, threads, [&](int64_t k) {
    if (!ok.load(std::memory_order_relaxed)) return;
    tile_row(k);
    if (tiles - 1 - k != k) tile_row(tiles - 1 - k);
  });
  return ok.load();
}

// row[j] += 2 · Σ_g q(p[g · stride + j]) for j in [jb, je) and g < gs (gs <= 8), q(v) = round(v ·
// 2^F) as ToFixed. False on overflow or a non-finite value.
bool AddGroupSumsScalar(const float* p, int64_t stride, int64_t gs, int64_t jb, int64_t je,
                        Fixed128* row) {
  for (int64_t j = jb; j < je; ++j) {
    // |q| < 2^123 each, so up to 8 of them (and twice their sum) stay below 2^127.
    Fixed128 sum = 0;
    bool finite = true;
    for (int64_t g = 0; g < gs; ++g) {
      Fixed128 a = 0;
      finite &= ToFixed128(static_cast<double>(p[g * stride + j]), &a);
      sum += a;
    }
    if (!finite || !AddFixed128(&row[j], 2 * sum)) return false;
  }
  return true;
}

#if defined(__x86_64__)
// AddGroupSumsScalar, four entries at a time, for entries whose gs values all have |v| < 2^12
// (the common case; others take the scalar path). Same integers: d = v · 2^50 is exact (v → double
// and a power of two), |d| < 2^62. Adding and subtracting C = 1.5 · 2^84 rounds d to a multiple of
// 2^32, hi, exactly (|d| ≪ 2^83); lo = d − hi is exact with |lo| <= 2^31. Then round(d) = hi +
// round(lo) (hi is even, so ties still go to even), and round(lo) is read from the bits of lo + M,
// M = 1.5 · 2^52 (|lo| < 2^51): bits(lo + M) − bits(M). The group's hi's are summed in doubles
// (multiples of 2^32 below 2^66: exact) and the biased bits of the lo's in int64 lanes.
// Round-to-nearest-even is what ToFixed128's cvtsd2si does under the default MXCSR.
__attribute__((target("avx2"))) bool AddGroupSumsAvx2(const float* p, int64_t stride, int64_t gs,
                                                      int64_t jb, int64_t je, Fixed128* row) {
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const int32_t limit_bits = 0x45800000;  // 2^12 as fp32; NaN and ∞ compare above it as integers
  const __m256d scale = _mm256_set1_pd(kScale), c_hi = _mm256_set1_pd(0x1.8p84),
                c_lo = _mm256_set1_pd(0x1.8p52);
  const int64_t bias = gs * static_cast<int64_t>(0x4338000000000000);  // gs · bits(1.5 · 2^52)
  int64_t j = jb;
  for (; j + 4 <= je; j += 4) {
    __m256d shi = _mm256_setzero_pd();
    __m256i slo = _mm256_setzero_si256();
    __m128i max_bits = _mm_setzero_si128();
    for (int64_t g = 0; g < gs; ++g) {
      const __m128 v = _mm_loadu_ps(p + g * stride + j);
      max_bits = _mm_max_epi32(max_bits, _mm_and_si128(_mm_castps_si128(v), abs_mask));
      const __m256d d = _mm256_mul_pd(_mm256_cvtps_pd(v), scale);
      const __m256d hi = _mm256_sub_pd(_mm256_add_pd(d, c_hi), c_hi);
      shi = _mm256_add_pd(shi, hi);
      slo = _mm256_add_epi64(
          slo, _mm256_castpd_si256(_mm256_add_pd(_mm256_sub_pd(d, hi), c_lo)));
    }
    alignas(16) int32_t m[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(m), max_bits);
    if (std::max(std::max(m[0], m[1]), std::max(m[2], m[3])) >= limit_bits) {
      if (!AddGroupSumsScalar(p, stride, gs, j, j + 4, row)) return false;
      continue;
    }
    alignas(32) double h[4];
    alignas(32) int64_t l[4];
    _mm256_store_pd(h, _mm256_mul_pd(shi, _mm256_set1_pd(0x1p-32)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(l), slo);
    for (int k = 0; k < 4; ++k) {
      const Fixed128 q =
          static_cast<Fixed128>(static_cast<int64_t>(h[k])) * (int64_t{1} << 32) + (l[k] - bias);
      if (!AddFixed128(&row[j + k], 2 * q)) return false;
    }
  }
  return AddGroupSumsScalar(p, stride, gs, j, je, row);
}
#endif

bool AddGroupSums(const float* p, int64_t stride, int64_t gs, int64_t jb, int64_t je,
                  Fixed128* row) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return AddGroupSumsAvx2(p, stride, gs, jb, je, row);
#endif
  return AddGroupSumsScalar(p, stride, gs, jb, je, row);
}

// Σ_s 2·q(P_s[i][j]) into packed for i <= j, P_s = X_sᵀX_s for each sequence X_s [t, n] (fp32,
// row-major, sequences consecutive in x). Tiled over the upper triangle: row strips of kRows rows
// starting at the diagonal, cut into kCols-wide pieces, one task per piece (as many threads as
// `threads`). A piece's product is one single-threaded sgemm X_s[:, i0:i1]ᵀ · X_s[:, j0:j1] over the sequence's t
// tokens (wide enough that short sequences still run the GEMM near its peak). Up to kGroup
// sequences' products are kept side by side and converted together, entry by entry: each is
// rounded to fixed point on its own (q(P_s), exactly as one sequence at a time) and their integer
// sum is added to the packed 128-bit sums once per group, so the 16-byte sums cross the memory
// bus once per group instead of once per sequence. Only the upper triangle is computed (about
// half the flops of the full product; the strips' diagonal squares are computed whole) and there
// is no [n, n] fp32 buffer. Every entry comes from the same GEMM shape whatever the thread count,
// and integer sums are exact, so the bits do not depend on the threads or the grouping. Returns
// false on overflow or a non-finite product.
//
// Only the strips of rows [rows.begin, rows.end) are computed (a band accumulator's; the whole
// triangle for a whole one), into `packed`, which holds the values from PackedIndex(rows.begin,
// rows.begin) on: a strip's pieces are the same GEMMs whichever band holds it, so a band's values
// equal the whole accumulator's there bit for bit. kRows = the accumulator's strip_rows
// (kHessianStripRows).
bool AccumulateSequenceProductsImpl(const float* x, int64_t seqs, int64_t t, int64_t n,
                                    HessianRows rows, int64_t kRows, int threads,
                                    Fixed128* packed) {
  constexpr int64_t kCols = 2048, kGroup = 8;
  PinBlasToOneThread();  // one BLAS thread per work item
  // Row i of T starts at packed + row_at(i) (row_at(i)[j] = T(i, j), j >= i).
  const int64_t base = rows.begin * n - rows.begin * (rows.begin - 1) / 2;
  auto row_at = [&](int64_t i) { return packed + (i * n - i * (i - 1) / 2 - i - base); };
  struct Piece {
    int64_t i0, j0;
  };
  std::vector<Piece> pieces;
  for (int64_t i0 = rows.begin; i0 < rows.end; i0 += kRows) {
    for (int64_t j0 = i0; j0 < n; j0 += kCols) pieces.push_back({i0, j0});
  }
  // Largest pieces first, handed out one at a time (the pieces' widths differ: a static split
  // of the list left one of two threads with 40% more work at n = 4096).
  std::stable_sort(pieces.begin(), pieces.end(), [&](const Piece& a, const Piece& b) {
    return std::min(kCols, n - a.j0) * std::min(kRows, n - a.i0) >
           std::min(kCols, n - b.j0) * std::min(kRows, n - b.i0);
  });
  std::atomic<bool> ok{true};
  std::mutex buffers_mu;
  std::vector<std::vector<float>> buffers;  // reused product buffers, one per running task
  qcal::ParallelTasks(static_cast<int64_t>(pieces.size()), threads, [&](int64_t p) {
    if (!ok.load(std::memory_order_relaxed)) return;
    std::vector<float> tiles;
    {
      std::lock_guard<std::mutex> lock(buffers_mu);
      if (!buffers.empty()) {
        tiles = std::move(buffers.back());
        buffers.pop_back();
      }
    }
    auto give_back = absl::MakeCleanup([&] {
      std::lock_guard<std::mutex> lock(buffers_mu);
      buffers.push_back(std::move(tiles));
    });
    const int64_t i0 = pieces[p].i0, mi = std::min(kRows, rows.end - i0);
    const int64_t j0 = pieces[p].j0, nj = std::min(kCols, n - j0);
    for (int64_t s0 = 0; s0 < seqs; s0 += kGroup) {
      const int64_t gs = std::min(kGroup, seqs - s0);
      tiles.resize(gs * mi * nj);
      for (int64_t g = 0; g < gs; ++g) {
        const float* xs = x + (s0 + g) * t * n;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(mi),
                    static_cast<int>(nj), static_cast<int>(t), 1.0f, xs + i0,
                    static_cast<int>(n), xs + j0, static_cast<int>(n), 0.0f,
                    tiles.data() + g * mi * nj, static_cast<int>(nj));
      }
      for (int64_t i = i0; i < i0 + mi; ++i) {
        Fixed128* row = row_at(i);  // row[j] = T(i, j)
        const float* pi = tiles.data() + (i - i0) * nj - j0;
        if (!AddGroupSums(pi, mi * nj, gs, std::max(j0, i), j0 + nj, row)) {
          ok.store(false, std::memory_order_relaxed);
          return;
        }
      }
    }
  });
  return ok.load();
}

}  // namespace

bool AccumulateHessianFixed(const float* x, int64_t seqs, int64_t t, int64_t n, HessianRows rows,
                            int64_t strip_rows, int threads, Fixed128* packed) {
  return AccumulateSequenceProductsImpl(x, seqs, t, n, rows, strip_rows, std::max(1, threads),
                                        packed);
}

bool AccumulateSymmetricFixed(const double* p, int64_t n, int threads, Fixed128* packed) {
  return AccumulateSymmetricImpl(p, n, std::max(1, threads), packed);
}

Status AccumulateHessianFixedReference(const float* x, int64_t seqs, int64_t t, int64_t n,
                                       Fixed128* packed) {
  if (seqs < 0 || t < 0 || n <= 0 || (seqs > 0 && t > 0 && x == nullptr) || packed == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AccumulateHessianFixedReference: bad shape seqs=", seqs, " t=", t, " n=", n));
  }
  std::vector<float> p(static_cast<size_t>(n) * n);
  for (int64_t s = 0; s < seqs; ++s) {
    const float* xs = x + s * t * n;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(n),
                static_cast<int>(t), 1.0f, xs, static_cast<int>(n), xs, static_cast<int>(n), 0.0f,
                p.data(), static_cast<int>(n));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = i; j < n; ++j) {
        Fixed128 q = 0;
        if (!ToFixed128(static_cast<double>(p[i * n + j]), &q) ||
            !AddFixed128(&packed[HessianPackedIndex(n, i, j)], 2 * q)) {
          return absl::OutOfRangeError(absl::StrCat(
              "Hessian entry (", i, ", ", j, ") of sequence ", s,
              " is not finite or leaves the 128-bit fixed-point range"));
        }
      }
    }
  }
  return absl::OkStatus();
}

std::vector<double> HessianMeanFromFixed(const Fixed128* packed, int64_t n, int64_t count) {
  std::vector<double> h(static_cast<size_t>(n) * n, 0.0);
  if (count <= 0) return h;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) {
      const double v = static_cast<double>(packed[HessianPackedIndex(n, i, j)]) * 0x1p-51 /
                       static_cast<double>(count);
      h[i * n + j] = v;
      h[j * n + i] = v;
    }
  }
  return h;
}

}  // namespace qcal::kernels
