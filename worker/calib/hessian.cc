#include "worker/calib/hessian.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/cpu.h"
#include "kernels/blas_threads.h"
#include "kernels/fixed_point.h"
#include "kernels/gpu_backend.h"

namespace qcal::calib {

namespace {

constexpr double kScale = 0x1p50;  // 2^kHessianFracBits
static_assert(kHessianFracBits == 50, "kScale must be 2^kHessianFracBits");
constexpr double kUnscale = 0x1p-51;  // 2^-(F+1): T holds two rounded copies of each product

// round(v · 2^F) (to nearest, ties to even) into *out; false when |v · 2^F| ≥ 2^123 or v is not
// finite. Multiplying by a power of two is exact, so the only rounding is the final one.
inline bool ToFixed(double v, Fixed128* out) {
  const double d = v * kScale;
  if (std::fabs(d) < 0x1p62) {
#if defined(__x86_64__)
    *out = _mm_cvtsd_si64(_mm_set_sd(d));  // MXCSR default: round to nearest even
#else
    *out = static_cast<int64_t>(std::nearbyint(d));
#endif
    return true;
  }
  if (!(std::fabs(d) < 0x1p123)) return false;
  *out = static_cast<Fixed128>(d);  // |d| ≥ 2^62 > 2^53: already an integer, converted exactly
  return true;
}

inline bool AddChecked(Fixed128* acc, Fixed128 v) { return !__builtin_add_overflow(*acc, v, acc); }

inline double ToDouble(Fixed128 v) { return static_cast<double>(v); }  // round to nearest

// packed[(i, j)] += q(P[i][j]) + q(P[j][i]) for i <= j; P is [n, n] row-major. In 64x64 tiles so
// both the row and the column reads stay in cache; tile rows are paired (k, last − k) so every
// parallel work item has the same amount of work. Returns false on overflow.
template <typename T>
bool AccumulateSymmetric(const T* p, int64_t n, Fixed128* packed) {
  constexpr int64_t kTile = 64;
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::atomic<bool> ok{true};
  auto tile_row = [&](int64_t ti) {
    const int64_t i0 = ti * kTile, i1 = std::min(n, i0 + kTile);
    for (int64_t tj = ti; tj < tiles; ++tj) {
      const int64_t j0 = tj * kTile, j1 = std::min(n, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        Fixed128* row = packed + (i * n - i * (i - 1) / 2 - i);  // row[j] = T(i, j)
        const T* pi = p + i * n;
        for (int64_t j = std::max(j0, i); j < j1; ++j) {
          Fixed128 a, b;
          if (!ToFixed(static_cast<double>(pi[j]), &a) ||
              !ToFixed(static_cast<double>(p[j * n + i]), &b) || !AddChecked(&row[j], a + b)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  };
  qcal::ParallelTasks((tiles + 1) / 2, at::get_num_threads(), [&](int64_t k) {
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
      finite &= ToFixed(static_cast<double>(p[g * stride + j]), &a);
      sum += a;
    }
    if (!finite || !AddChecked(&row[j], 2 * sum)) return false;
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
// Round-to-nearest-even is what ToFixed's cvtsd2si does under the default MXCSR.
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
      if (!AddChecked(&row[j + k], 2 * q)) return false;
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
// LibTorch's). A piece's product is one single-threaded sgemm X_s[:, i0:i1]ᵀ · X_s[:, j0:j1] over the sequence's t
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
bool AccumulateSequenceProducts(const float* x, int64_t seqs, int64_t t, int64_t n,
                                HessianRows rows, int64_t kRows, Fixed128* packed) {
  constexpr int64_t kCols = 2048, kGroup = 8;
  kernels::PinBlasToOneThread();  // one BLAS thread per work item
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
  qcal::ParallelTasks(static_cast<int64_t>(pieces.size()), at::get_num_threads(), [&](int64_t p) {
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

Status OverflowError(int64_t n) {
  return absl::OutOfRangeError(absl::StrCat(
      "Hessian [", n, "x", n, "]: an input product is not finite or the fixed-point sum left its ",
      "range (|sum| < 2^76 per entry, resolution 2^-", kHessianFracBits, ")"));
}

}  // namespace

HessianRows HessianBandForRank(int64_t n, int rank, int size, int64_t strip_rows) {
  if (n <= 0 || size <= 1) return {0, std::max<int64_t>(n, 0)};
  // Packed values in rows [0, r): r·n − r(r−1)/2. Band k ends at the first strip boundary where
  // that reaches k+1 shares of the total, so the cut is a function of (n, k, size) alone and
  // consecutive ranks' bands meet.
  const int64_t strips = (n + strip_rows - 1) / strip_rows;
  auto values_before = [&](int64_t r) {
    return static_cast<long double>(r) * n - static_cast<long double>(r) * (r - 1) / 2;
  };
  const long double total = values_before(n);
  auto cut = [&](int k) -> int64_t {  // end row of band k (k = size - 1: n)
    if (k >= size - 1) return n;
    if (k < 0) return 0;
    const long double want = total * (k + 1) / size;
    for (int64_t s = 1; s <= strips; ++s) {
      const int64_t r = std::min(n, s * strip_rows);
      if (values_before(r) >= want) return r;
    }
    return n;
  };
  return {cut(rank - 1), cut(rank)};
}

HessianAccumulator::HessianAccumulator(int64_t n, int64_t strip_rows)
    : n_(n),
      strip_rows_(strip_rows),
      rows_{0, n},
      packed_(static_cast<size_t>(n * (n + 1) / 2), 0) {}

StatusOr<HessianAccumulator> HessianAccumulator::Band(int64_t n, HessianRows rows,
                                                      int64_t strip_rows) {
  const bool aligned = [&] {
    if (strip_rows < 1 || rows.begin < 0 || rows.end > n || rows.begin > rows.end) return false;
    return (rows.begin % strip_rows == 0 || rows.begin == n) &&
           (rows.end % strip_rows == 0 || rows.end == n);
  }();
  if (!aligned) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hessian band [", rows.begin, ", ", rows.end, ") of ", n,
                     " rows is not made of whole ", strip_rows, "-row strips"));
  }
  HessianAccumulator acc(0, strip_rows);
  acc.n_ = n;
  acc.rows_ = rows;
  const int64_t end = rows.end * n - rows.end * (rows.end - 1) / 2;
  acc.packed_.assign(static_cast<size_t>(end - acc.packed_begin()), 0);
  return acc;
}

StatusOr<HessianAccumulator> HessianAccumulator::FromSum(const at::Tensor& sum, int64_t count) {
  if (sum.dim() != 2 || sum.size(0) != sum.size(1)) {
    return absl::InvalidArgumentError("HessianAccumulator::FromSum: sum must be [n, n]");
  }
  HessianAccumulator acc(sum.size(0));
  const at::Tensor s = sum.to(at::kDouble).contiguous();
  if (!AccumulateSymmetric(s.data_ptr<double>(), acc.n_, acc.packed_.data())) {
    return OverflowError(acc.n_);
  }
  acc.count_ = count;
  return acc;
}

StatusOr<HessianAccumulator> HessianAccumulator::FromFixed(int64_t n, std::vector<Fixed128> packed,
                                                           int64_t count) {
  if (n < 0 || packed.size() != static_cast<size_t>(n * (n + 1) / 2) || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("HessianAccumulator::FromFixed: ",
                                                   packed.size(), " packed values for n = ", n,
                                                   " (want n(n+1)/2), count ", count));
  }
  HessianAccumulator acc(0);
  acc.n_ = n;
  acc.rows_ = {0, n};
  acc.packed_ = std::move(packed);
  acc.count_ = count;
  return acc;
}

Status HessianAccumulator::Add(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  if (x.scalar_type() == at::kDouble) {
    if (is_band()) {
      return absl::InvalidArgumentError("a Hessian band accumulates fp32 inputs only");
    }
    at::Tensor rows = x.reshape({-1, n_});
    const at::Tensor p = at::mm(rows.t(), rows).contiguous();
    if (!AccumulateSymmetric(p.data_ptr<double>(), n_, packed_.data())) return OverflowError(n_);
    count_ += rows.size(0);
    return absl::OkStatus();
  }
  // Products in fp32 (fp32 GEMM runs at twice the fp64 rate on CPU, and TF32/fp32 on GPU), one
  // product per sequence, so that every product has the same shape whatever the batching or the
  // split over ranks; each upper-triangle entry is then rounded once into the exact integer sum
  // (counted twice: T is the symmetrised sum, see the header).
  at::Tensor seqs = x.dim() >= 3 ? x.reshape({-1, x.size(-2), n_}) : x.reshape({1, -1, n_});
  seqs = seqs.to(at::kFloat).contiguous();
  if (!AccumulateSequenceProducts(seqs.data_ptr<float>(), seqs.size(0), seqs.size(1), n_, rows_,
                                  strip_rows_, packed_.data())) {
    return OverflowError(n_);
  }
  count_ += seqs.size(0) * seqs.size(1);
  return absl::OkStatus();
}

Status HessianAccumulator::Merge(const HessianAccumulator& other) {
  if (other.n_ != n_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot merge a ", other.n_, "-dim Hessian into a ", n_, "-dim one"));
  }
  if (!(other.rows_ == rows_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot merge the Hessian rows [", other.rows_.begin, ", ", other.rows_.end,
        ") into rows [", rows_.begin, ", ", rows_.end, ")"));
  }
  for (size_t i = 0; i < packed_.size(); ++i) {
    if (!AddChecked(&packed_[i], other.packed_[i])) return OverflowError(n_);
  }
  count_ += other.count_;
  return absl::OkStatus();
}

at::Tensor HessianAccumulator::sum() const {
  TORCH_CHECK(!is_band(), "HessianAccumulator::sum() of a band (rows ", rows_.begin, "..",
              rows_.end, " of ", n_, "): only whole Hessians have an fp64 form");
  return SymmetricSumFromPacked(packed_.data(), n_);
}

at::Tensor SymmetricSumFromPacked(const void* packed_bytes, int64_t n) {
  at::Tensor out = at::empty({n, n}, at::kDouble);
  double* o = out.data_ptr<double>();
  const char* bytes = static_cast<const char*>(packed_bytes);
  // In 16-row tasks on qcal's threads (qcal's TUs are not built with OpenMP, so at::parallel_for
  // would run serially here).
  constexpr int64_t kRowsPerTask = 16;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  qcal::ParallelTasks(tasks, at::get_num_threads(), [&](int64_t t) {
    for (int64_t i = t * kRowsPerTask; i < std::min(n, (t + 1) * kRowsPerTask); ++i) {
      // Row i's values start at packed index i·n − i(i−1)/2; read through memcpy, since mapped
      // bytes are only 8-byte aligned.
      const char* row = bytes + (i * n - i * (i - 1) / 2) * sizeof(Fixed128);
      for (int64_t j = i; j < n; ++j) {
        Fixed128 v;
        std::memcpy(&v, row + (j - i) * sizeof(Fixed128), sizeof(v));
        o[i * n + j] = ToDouble(v) * kUnscale;
      }
    }
  });
  // Mirror (separate pass: the lower triangle of row i is written by other rows' owners).
  qcal::ParallelTasks(tasks, at::get_num_threads(), [&](int64_t t) {
    for (int64_t i = t * kRowsPerTask; i < std::min(n, (t + 1) * kRowsPerTask); ++i) {
      for (int64_t j = 0; j < i; ++j) o[i * n + j] = o[j * n + i];
    }
  });
  return out;
}

at::Tensor HessianAccumulator::Mean() const {
  TORCH_CHECK(!is_band(), "HessianAccumulator::Mean() of a band (rows ", rows_.begin, "..",
              rows_.end, " of ", n_, "): only whole Hessians have an fp64 form");
  if (count_ == 0) return at::zeros({n_, n_}, at::kDouble);
  return sum().div_(static_cast<double>(count_));
}

std::vector<Fixed128> HessianAccumulator::ReleasePacked() {
  std::vector<Fixed128> out = std::move(packed_);
  packed_ = {};
  n_ = 0;
  rows_ = {};
  count_ = 0;
  return out;
}

at::Tensor BlockHessians::Mean(HessianKind k) const {
  const HessianAccumulator& acc = at(k);
  if (acc.dim() > 0 || stored == nullptr) return acc.Mean();
  return stored->Mean(k);
}

at::Tensor HessianMeans::For(model::LinearKind linear) {
  if (h_ == nullptr) return at::Tensor();
  const int kind = static_cast<int>(HessianKindOf(linear));
  if (kind != current_) {
    mean_ = at::Tensor();  // the previous kind's
    mean_ = h_->Mean(static_cast<HessianKind>(kind));
    h_->h[kind].ReleasePacked();
    current_ = kind;
  }
  return mean_;
}

void HessianAccumulator::SplitDigits(const Fixed128* values, size_t n, int64_t* limbs) {
  for (size_t i = 0; i < n; ++i) kernels::SplitFixedDigits(values[i], limbs + 4 * i);
}

Status HessianAccumulator::CombineDigits(const int64_t* limbs, size_t n, Fixed128* values) {
  for (size_t i = 0; i < n; ++i) {
    if (!kernels::CombineFixedDigits(limbs + 4 * i, &values[i])) {
      return absl::OutOfRangeError(absl::StrCat(
          "reduced Hessian value ", i, " leaves the 128-bit fixed-point range (or its digits are "
          "malformed)"));
    }
  }
  return absl::OkStatus();
}

const char* HessianKindName(HessianKind kind) {
  switch (kind) {
    case HessianKind::kQkv: return "qkv";
    case HessianKind::kO: return "o";
    case HessianKind::kGateUp: return "gate_up";
    case HessianKind::kDown: return "down";
  }
  return "?";
}

HessianKind HessianKindOf(model::LinearKind linear) {
  switch (linear) {
    case model::LinearKind::kQ:
    case model::LinearKind::kK:
    case model::LinearKind::kV: return HessianKind::kQkv;
    case model::LinearKind::kO: return HessianKind::kO;
    case model::LinearKind::kGate:
    case model::LinearKind::kUp: return HessianKind::kGateUp;
    case model::LinearKind::kDown: return HessianKind::kDown;
  }
  return HessianKind::kQkv;
}

namespace {

// x [seqs, seq, n] (or 2-D: all rows one sequence) into a device accumulator: the same
// per-sequence products as HessianAccumulator::Add, on the GPU.
Status AddOnDevice(kernels::DeviceHessian* device, const at::Tensor& x) {
  const at::Tensor c = x.to(at::kFloat).contiguous();
  const int64_t n = c.size(-1);
  const int64_t seqs = c.dim() >= 3 ? c.numel() / (c.size(-2) * n) : 1;
  const int64_t t = c.dim() >= 3 ? c.size(-2) : c.numel() / std::max<int64_t>(n, 1);
  return device->Add(c.data_ptr<float>(), seqs, t);
}

// Forwards to the wrapped layer and records the input (all borrowed): into the CPU accumulator,
// the GPU backend's when one is active, or, for sharded calibration, as a captured tensor.
class RecordingLinear final : public model::Linear {
 public:
  RecordingLinear(std::unique_ptr<model::Linear> inner, HessianAccumulator* acc,
                  kernels::DeviceHessian* device = nullptr,
                  std::vector<at::Tensor>* captured = nullptr)
      : inner_(std::move(inner)), acc_(acc), device_(device), captured_(captured) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    // The first error sticks (the accumulator is unusable after it); the forward goes on and
    // the caller reports it after the pass.
    if (captured_ && status_.ok()) {
      if (x.dim() != 3) {
        status_ = absl::InternalError(
            absl::StrCat("a captured linear input must be [seqs, seq, n], got ", x.dim(), " dims"));
      } else {
        captured_->push_back(x.detach().to(at::kFloat).contiguous());
      }
    } else if (device_ && status_.ok()) {
      status_ = AddOnDevice(device_, x);
    } else if (acc_ && status_.ok()) {
      status_ = acc_->Add(x);
    }
    return inner_->Forward(x);
  }
  const Status& status() const { return status_; }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }
  std::unique_ptr<model::Linear> Release() { return std::move(inner_); }

 private:
  std::unique_ptr<model::Linear> inner_;
  HessianAccumulator* acc_;
  kernels::DeviceHessian* device_;
  std::vector<at::Tensor>* captured_;
  mutable Status status_;
};

// The linears that record a distinct input: q (for k and v), o, gate (for up), down.
bool RecordsInput(model::LinearKind k) {
  return k == model::LinearKind::kQ || k == model::LinearKind::kO ||
         k == model::LinearKind::kGate || k == model::LinearKind::kDown;
}

// Runs x through the block in chunks of `batch` sequences and concatenates the outputs.
StatusOr<at::Tensor> ForwardInChunks(model::DecoderBlock& block, const at::Tensor& x,
                                     const model::Rope& rope, int64_t batch) {
  std::vector<at::Tensor> outs;
  try {
    for (int64_t s = 0; s < x.size(0); s += batch) {
      outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block forward failed: ", e.what()));
  }
  return at::cat(outs, 0);
}

}  // namespace

Status FlushDeviceHessians(BlockHessians* hessians) {
  hessians->device_block.reset();
  hessians->device_block_key = nullptr;
  for (HessianKind k : kAllHessianKinds) {
    std::shared_ptr<kernels::DeviceHessian> d = std::move(hessians->device[static_cast<int>(k)]);
    if (d == nullptr) continue;
    int64_t count = 0;
    auto packed = d->Finish(&count);
    if (!packed.ok()) return Annotate(packed.status(), absl::StrCat(HessianKindName(k), " input"));
    HessianAccumulator& acc = hessians->at(k);
    QCAL_ASSIGN_OR_RETURN(HessianAccumulator part,
                          HessianAccumulator::FromFixed(acc.dim(), std::move(*packed), count));
    const Status merged = acc.Merge(part);
    if (!merged.ok()) return Annotate(merged, absl::StrCat(HessianKindName(k), " input"));
  }
  return absl::OkStatus();
}

namespace {

// The block's forward on the device (GpuBackend::NewBlock: weights uploaded once per block, the
// four linear inputs summed into the device Hessians where they are produced) for a plain block:
// no hooks, no K-sort, dense fp32 linears, a shape the device kernels take. Same chunks of
// `batch` sequences as the CPU forward. False (nothing done) when the block or the backend does
// not allow it; the caller then runs the CPU forward.
StatusOr<bool> DeviceForward(model::DecoderBlock& block, const at::Tensor& x,
                             const model::Rope& rope, int64_t batch, BlockHessians* hessians,
                             kernels::GpuBackend* gpu, at::Tensor* out) {
  const model::BlockHooks& hooks = block.hooks();
  const model::BlockWeights& w = block.weights();
  if (hooks.qk_rotation.defined() || hooks.kv_cache || hooks.prefix || w.rope_perm.defined()) {
    return false;
  }
  auto plain = [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_cuda();
  };
  kernels::BlockForwardWeights bw;
  for (model::LinearKind k : model::kAllLinears) {
    const auto* d = dynamic_cast<const model::DenseLinear*>(&w.linear(k));
    if (d == nullptr || !plain(d->DenseWeight())) return false;
    bw.linears[static_cast<int>(k)] = d->DenseWeight().data_ptr<float>();
  }
  if (!plain(w.input_norm) || !plain(w.post_norm)) return false;
  bw.input_norm = w.input_norm.data_ptr<float>();
  bw.post_norm = w.post_norm.data_ptr<float>();
  kernels::BlockForwardShape shape;
  shape.hidden = x.size(2);
  shape.intermediate = w.linear(model::LinearKind::kGate).out_features();
  shape.heads = block.heads();
  shape.kv_heads = block.kv_heads();
  shape.head_dim = block.head_dim();
  shape.rms_eps = block.rms_eps();
  if (!kernels::CheckBlockForwardShape(shape).ok()) return false;
  const int64_t t = x.size(1);
  if (t > rope.max_positions()) return false;  // the CPU forward reports it
  if (hessians->device_block == nullptr || hessians->device_block_key != bw.linears[0]) {
    hessians->device_block.reset();
    StatusOr<std::unique_ptr<kernels::DeviceBlock>> b = gpu->NewBlock(shape, bw);
    if (!b.ok()) {
      if (b.status().code() == absl::StatusCode::kUnimplemented) return false;
      return Annotate(b.status(), "device block forward");
    }
    hessians->device_block = std::move(*b);
    hessians->device_block_key = bw.linears[0];
  }
  const at::Tensor cos = rope.cos_table().narrow(0, 0, t).contiguous();
  const at::Tensor sin = rope.sin_table().narrow(0, 0, t).contiguous();
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(xc);
  kernels::DeviceHessian* taps[4];
  for (int k = 0; k < 4; ++k) taps[k] = hessians->device[k].get();
  const int64_t seqs = xc.size(0), row = t * shape.hidden;
  for (int64_t s = 0; s < seqs; s += batch) {
    const int64_t ns = std::min(batch, seqs - s);
    QCAL_RETURN_IF_ERROR(Annotate(
        hessians->device_block->Forward(xc.data_ptr<float>() + s * row, ns, t,
                                        cos.data_ptr<float>(), sin.data_ptr<float>(), taps,
                                        y.data_ptr<float>() + s * row),
        "device block forward"));
  }
  *out = std::move(y);
  return true;
}

}  // namespace

StatusOr<at::Tensor> ForwardCollectingHessians(model::DecoderBlock& block, const at::Tensor& x,
                                               const model::Rope& rope, int64_t batch,
                                               BlockHessians* hessians, bool flush_device) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  at::NoGradGuard no_grad;
  auto forward = [&]() { return ForwardInChunks(block, x, rope, batch); };
  if (hessians == nullptr) return x.size(0) == 0 ? x : forward();
  model::BlockWeights& w = block.mutable_weights();
  for (model::LinearKind k : model::kAllLinears) {
    HessianAccumulator& acc = hessians->at(HessianKindOf(k));
    const int64_t n = w.linear(k).in_features();
    if (acc.dim() == 0) acc = HessianAccumulator(n);
    if (acc.dim() != n) {
      return absl::InvalidArgumentError(absl::StrCat("Hessian for ", model::LinearName(k),
                                                     " has dim ", acc.dim(), ", expected ", n));
    }
  }
  if (x.size(0) == 0) return x;  // a rank without sequences still has sized accumulators
  // With a GPU backend the products and their exact sums run on the device; the sums are
  // merged into the CPU accumulators after the pass (the same integer format, so reductions
  // across ranks, caches and rounding are unchanged).
  std::array<std::shared_ptr<kernels::DeviceHessian>, 4>& device = hessians->device;
  if (kernels::GpuBackend* gpu = kernels::ActiveGpuBackend(); gpu != nullptr) {
    for (HessianKind k : kAllHessianKinds) {
      if (device[static_cast<int>(k)] != nullptr) continue;  // kept from an earlier call
      auto d = gpu->NewHessian(hessians->at(k).dim());
      if (!d.ok()) return Annotate(d.status(), absl::StrCat(HessianKindName(k), " input (GPU)"));
      device[static_cast<int>(k)] = std::move(*d);
    }
    at::Tensor out;
    QCAL_ASSIGN_OR_RETURN(const bool on_device,
                          DeviceForward(block, x, rope, batch, hessians, gpu, &out));
    if (on_device) {
      if (flush_device) QCAL_RETURN_IF_ERROR(FlushDeviceHessians(hessians));
      return out;
    }
  }
  // Wrap: only one linear per distinct input records (q records for k and v).
  std::array<RecordingLinear*, 4> recorders{};
  for (model::LinearKind k : model::kAllLinears) {
    const bool records = RecordsInput(k);
    auto& slot = w.linears[static_cast<int>(k)];
    auto rec = std::make_unique<RecordingLinear>(
        std::move(slot), records ? &hessians->at(HessianKindOf(k)) : nullptr,
        records ? device[static_cast<int>(HessianKindOf(k))].get() : nullptr);
    if (records) recorders[static_cast<int>(HessianKindOf(k))] = rec.get();
    slot = std::move(rec);
  }
  // Unwrap on every exit path, so the block is left as it was.
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) slot = static_cast<RecordingLinear*>(slot.get())->Release();
  });
  QCAL_ASSIGN_OR_RETURN(at::Tensor out, forward());
  for (HessianKind k : kAllHessianKinds) {
    const Status& s = recorders[static_cast<int>(k)]->status();
    if (!s.ok()) return Annotate(s, absl::StrCat(HessianKindName(k), " input"));
  }
  if (flush_device) QCAL_RETURN_IF_ERROR(FlushDeviceHessians(hessians));
  return out;
}

StatusOr<at::Tensor> ForwardCapturingInputs(model::DecoderBlock& block, const at::Tensor& x,
                                            const model::Rope& rope, int64_t batch,
                                            std::array<at::Tensor, 4>* inputs) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  at::NoGradGuard no_grad;
  model::BlockWeights& w = block.mutable_weights();
  std::array<std::vector<at::Tensor>, 4> parts;
  std::array<RecordingLinear*, 4> recorders{};
  for (model::LinearKind k : model::kAllLinears) {
    const bool records = RecordsInput(k);
    const int kind = static_cast<int>(HessianKindOf(k));
    auto& slot = w.linears[static_cast<int>(k)];
    auto rec = std::make_unique<RecordingLinear>(std::move(slot), nullptr, nullptr,
                                                 records ? &parts[kind] : nullptr);
    if (records) recorders[kind] = rec.get();
    slot = std::move(rec);
  }
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) slot = static_cast<RecordingLinear*>(slot.get())->Release();
  });
  at::Tensor out = x;
  if (x.size(0) > 0) {
    QCAL_ASSIGN_OR_RETURN(out, ForwardInChunks(block, x, rope, batch));
  }
  for (HessianKind k : kAllHessianKinds) {
    const int kind = static_cast<int>(k);
    const Status& s = recorders[kind]->status();
    if (!s.ok()) return Annotate(s, absl::StrCat(HessianKindName(k), " input"));
    const int64_t n = recorders[kind]->in_features();
    (*inputs)[kind] = parts[kind].empty() ? at::empty({0, x.size(1), n}, at::kFloat)
                      : parts[kind].size() == 1 ? std::move(parts[kind][0])
                                                : at::cat(parts[kind], 0);
  }
  return out;
}

}  // namespace qcal::calib
