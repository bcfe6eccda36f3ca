// CPU reference for the Hadamard, randomized Hadamard and randomized FFT transforms.
//
// Every transform works on a strided view [outer][n][inner]: `outer` independent blocks, each
// holding `inner` interleaved vectors of length n (element i of vector c at i·inner + c). Rows of
// a row-major matrix are (outer = rows, inner = 1); columns are (outer = 1, inner = cols). With
// inner > 1 the butterflies move whole contiguous runs of `inner` elements, which vectorizes and
// needs no transpose.
#include "kernels/hadamard.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard_internal.h"

namespace qcal {
namespace {

using hadamard_internal::FactorMatrix;
using hadamard_internal::FftPlan;

bool IsPow2(int64_t n) { return n >= 1 && (n & (n - 1)) == 0; }

Status CheckShape(const void* data, int64_t n, int64_t count, const char* what) {
  if (n < 1 || count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": invalid shape n=", n, " count=", count));
  }
  if (data == nullptr && count > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null data pointer"));
  }
  return absl::OkStatus();
}

// Unnormalized FWHT along the n axis of [outer][n][inner].
template <typename T>
void FwhtStrided(T* x, int64_t outer, int64_t n, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o) {
    T* base = x + o * n * inner;
    if (inner == 1) {
      // Radix-4 first pass (h = 1, 2) in registers, then radix-2 passes.
      int64_t h = 1;
      if (n >= 4) {
        for (int64_t i = 0; i < n; i += 4) {
          const T a0 = base[i], a1 = base[i + 1], a2 = base[i + 2], a3 = base[i + 3];
          const T s01 = a0 + a1, d01 = a0 - a1, s23 = a2 + a3, d23 = a2 - a3;
          base[i] = s01 + s23;
          base[i + 1] = d01 + d23;
          base[i + 2] = s01 - s23;
          base[i + 3] = d01 - d23;
        }
        h = 4;
      }
      for (; h < n; h *= 2) {
        for (int64_t i = 0; i < n; i += 2 * h) {
          T* lo = base + i;
          T* hi = base + i + h;
          for (int64_t j = 0; j < h; ++j) {
            const T a = lo[j], b = hi[j];
            lo[j] = a + b;
            hi[j] = a - b;
          }
        }
      }
    } else {
      for (int64_t h = 1; h < n; h *= 2) {
        for (int64_t i = 0; i < n; i += 2 * h) {
          for (int64_t j = i; j < i + h; ++j) {
            T* lo = base + j * inner;
            T* hi = base + (j + h) * inner;
            for (int64_t c = 0; c < inner; ++c) {
              const T a = lo[c], b = hi[c];
              lo[c] = a + b;
              hi[c] = a - b;
            }
          }
        }
      }
    }
  }
}

// y ← scale·H·y along the m axis of [outer][m][inner]; H row-major m×m, and h_t = H^T.
template <typename T>
void DenseStrided(T* x, int64_t outer, int64_t m, int64_t inner, const T* h, const T* h_t,
                  T scale) {
  if (inner == 1) {
    // y = Σ_j v_j·(column j of H) = Σ_j v_j·(row j of H^T): axpy form, which vectorizes over i
    // (a dot-product loop would be a serial floating-point reduction).
    std::vector<T> tmp(m);
    for (int64_t o = 0; o < outer; ++o) {
      T* v = x + o * m;
      std::fill(tmp.begin(), tmp.end(), T(0));
      for (int64_t j = 0; j < m; ++j) {
        const T vj = v[j];
        const T* col = h_t + j * m;
        for (int64_t i = 0; i < m; ++i) tmp[i] += vj * col[i];
      }
      for (int64_t i = 0; i < m; ++i) v[i] = tmp[i] * scale;
    }
    return;
  }
  constexpr int64_t kChunk = 256;
  std::vector<T> tmp(m * kChunk);
  for (int64_t o = 0; o < outer; ++o) {
    T* block = x + o * m * inner;
    for (int64_t c0 = 0; c0 < inner; c0 += kChunk) {
      const int64_t width = std::min(kChunk, inner - c0);
      std::fill(tmp.begin(), tmp.end(), T(0));
      for (int64_t i = 0; i < m; ++i) {
        T* out = tmp.data() + i * kChunk;
        for (int64_t j = 0; j < m; ++j) {
          const T hij = h[i * m + j];
          const T* in = block + j * inner + c0;
          for (int64_t c = 0; c < width; ++c) out[c] += hij * in[c];
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        T* dst = block + i * inner + c0;
        const T* src = tmp.data() + i * kChunk;
        for (int64_t c = 0; c < width; ++c) dst[c] = src[c] * scale;
      }
    }
  }
}

// Multiplies element i of every vector of [outer][n][inner] by signs[i].
template <typename T>
void ApplySigns(T* x, int64_t outer, int64_t n, int64_t inner, const int8_t* signs) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < n; ++i) {
      if (signs[i] >= 0) continue;
      T* run = x + (o * n + i) * inner;
      for (int64_t c = 0; c < inner; ++c) run[c] = -run[c];
    }
  }
}

Status CheckHadamardSize(int64_t n) {
  const HadamardPlan plan = PlanHadamard(n);
  if (plan.IsHadamard()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "no Hadamard transform of size ", n, " (", DescribeHadamardPlan(plan),
      "); supported: 2^k and 2^k*m for m in {12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172}"));
}

template <typename T>
Status HadamardStrided(T* x, int64_t outer, int64_t n, int64_t inner, bool transpose) {
  QCAL_RETURN_IF_ERROR(CheckHadamardSize(n));
  const HadamardPlan plan = PlanHadamard(n);
  if (outer == 0 || inner == 0) return absl::OkStatus();
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)));
  if (plan.kind == HadamardKind::kPow2) {
    FwhtStrided(x, outer, n, inner);
    const int64_t total = outer * n * inner;
    for (int64_t i = 0; i < total; ++i) x[i] *= scale;
    return absl::OkStatus();
  }
  const FactorMatrix* factor = hadamard_internal::FindFactor(static_cast<int>(plan.m));
  if (factor == nullptr) return absl::InternalError("Hadamard factor table is missing an order");
  // H_{2^k} ⊗ H_m: first H_m on each contiguous m-run (with the 1/sqrt(n) folded in), then the
  // FWHT across the 2^k runs.
  DenseStrided(x, outer * plan.pow2, plan.m, inner, factor->Data(transpose, T()),
               factor->Data(!transpose, T()), scale);
  FwhtStrided(x, outer, plan.pow2, plan.m * inner);
  return absl::OkStatus();
}

template <typename T>
Status RandomizedHadamardStrided(T* x, int64_t outer, int64_t n, int64_t inner, const int8_t* signs,
                                 TransformDirection dir) {
  if (signs == nullptr) return absl::InvalidArgumentError("RHT: null sign vector");
  QCAL_RETURN_IF_ERROR(CheckHadamardSize(n));  // before touching the data
  if (dir == TransformDirection::kForward) {
    ApplySigns(x, outer, n, inner, signs);
    return HadamardStrided(x, outer, n, inner, /*transpose=*/false);
  }
  QCAL_RETURN_IF_ERROR(HadamardStrided(x, outer, n, inner, /*transpose=*/true));
  ApplySigns(x, outer, n, inner, signs);
  return absl::OkStatus();
}

// Randomized FFT along the n axis of [outer][n][inner]; n even.
template <typename T>
Status RfftStrided(T* x, int64_t outer, int64_t n, int64_t inner,
                   const std::complex<double>* phases, TransformDirection dir) {
  if (n < 2 || n % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("randomized FFT needs an even dimension, got ", n));
  }
  if (phases == nullptr) return absl::InvalidArgumentError("RFFT: null phase vector");
  if (outer == 0 || inner == 0) return absl::OkStatus();
  const int64_t half = n / 2;
  const FftPlan plan(half);
  const double scale = 1.0 / std::sqrt(static_cast<double>(half));
  const bool inverse = dir == TransformDirection::kInverse;
  constexpr int64_t kColumnBlock = 8;  // vectors gathered at once when inner > 1
  const int64_t width_max = std::min(inner, kColumnBlock);
  std::vector<std::complex<double>> z(half * width_max), work;
  for (int64_t o = 0; o < outer; ++o) {
    T* block = x + o * n * inner;
    for (int64_t c0 = 0; c0 < inner; c0 += kColumnBlock) {
      const int64_t width = std::min(kColumnBlock, inner - c0);
      for (int64_t k = 0; k < half; ++k) {
        const T* re = block + (2 * k) * inner + c0;
        const T* im = re + inner;
        for (int64_t c = 0; c < width; ++c) {
          z[c * half + k] =
              std::complex<double>(static_cast<double>(re[c]), static_cast<double>(im[c]));
        }
      }
      for (int64_t c = 0; c < width; ++c) {
        std::complex<double>* v = z.data() + c * half;
        if (!inverse) {
          for (int64_t k = 0; k < half; ++k) v[k] *= phases[k];
        }
        plan.Execute(v, inverse, work);
        if (inverse) {
          for (int64_t k = 0; k < half; ++k) v[k] *= std::conj(phases[k]) * scale;
        } else {
          for (int64_t k = 0; k < half; ++k) v[k] *= scale;
        }
      }
      for (int64_t k = 0; k < half; ++k) {
        T* re = block + (2 * k) * inner + c0;
        T* im = re + inner;
        for (int64_t c = 0; c < width; ++c) {
          re[c] = static_cast<T>(z[c * half + k].real());
          im[c] = static_cast<T>(z[c * half + k].imag());
        }
      }
    }
  }
  return absl::OkStatus();
}

// Maps a matrix axis to the strided view: (outer, n, inner).
struct StridedView {
  int64_t outer, n, inner;
};

StatusOr<StridedView> MatrixView(const void* a, int64_t rows, int64_t cols, MatrixAxis axis) {
  if (rows < 1 || cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("invalid matrix shape ", rows, "x", cols));
  }
  if (a == nullptr) return absl::InvalidArgumentError("null matrix pointer");
  if (axis == MatrixAxis::kRows) return StridedView{rows, cols, 1};
  return StridedView{1, rows, cols};
}

template <typename T>
Status FwhtImpl(T* x, int64_t n, int64_t batch) {
  QCAL_RETURN_IF_ERROR(CheckShape(x, n, batch, "FWHT"));
  if (!IsPow2(n)) {
    return absl::InvalidArgumentError(absl::StrCat("FWHT needs a power of two, got ", n));
  }
  return HadamardStrided(x, batch, n, 1, false);
}

template <typename T>
Status HadamardImpl(T* x, int64_t n, int64_t batch, bool transpose) {
  QCAL_RETURN_IF_ERROR(CheckShape(x, n, batch, "Hadamard transform"));
  return HadamardStrided(x, batch, n, 1, transpose);
}

template <typename T>
Status HadamardMatrixImpl(T* a, int64_t rows, int64_t cols, MatrixAxis axis, bool transpose) {
  QCAL_ASSIGN_OR_RETURN(const StridedView v, MatrixView(a, rows, cols, axis));
  return HadamardStrided(a, v.outer, v.n, v.inner, transpose);
}

template <typename T>
Status RhtImpl(T* x, int64_t n, int64_t batch, const int8_t* signs, TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckShape(x, n, batch, "randomized Hadamard transform"));
  return RandomizedHadamardStrided(x, batch, n, 1, signs, dir);
}

template <typename T>
Status RhtMatrixImpl(T* a, int64_t rows, int64_t cols, MatrixAxis axis, const int8_t* signs,
                     TransformDirection dir) {
  QCAL_ASSIGN_OR_RETURN(const StridedView v, MatrixView(a, rows, cols, axis));
  return RandomizedHadamardStrided(a, v.outer, v.n, v.inner, signs, dir);
}

template <typename T>
Status RfftImpl(T* x, int64_t n, int64_t batch, const std::complex<double>* phases,
                TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckShape(x, n, batch, "randomized FFT"));
  return RfftStrided(x, batch, n, 1, phases, dir);
}

template <typename T>
Status RfftMatrixImpl(T* a, int64_t rows, int64_t cols, MatrixAxis axis,
                      const std::complex<double>* phases, TransformDirection dir) {
  QCAL_ASSIGN_OR_RETURN(const StridedView v, MatrixView(a, rows, cols, axis));
  return RfftStrided(a, v.outer, v.n, v.inner, phases, dir);
}

template <typename T>
Status OrthogonalMatrixImpl(T* a, int64_t rows, int64_t cols, MatrixAxis axis, uint64_t seed,
                            TransformDirection dir) {
  QCAL_ASSIGN_OR_RETURN(const StridedView v, MatrixView(a, rows, cols, axis));
  const HadamardPlan plan = PlanHadamard(v.n);
  if (plan.IsHadamard()) {
    const std::vector<int8_t> signs = RandomSigns(v.n, seed);
    return RandomizedHadamardStrided(a, v.outer, v.n, v.inner, signs.data(), dir);
  }
  if (plan.kind == HadamardKind::kRfft) {
    const std::vector<std::complex<double>> phases = RandomPhases(v.n / 2, seed);
    return RfftStrided(a, v.outer, v.n, v.inner, phases.data(), dir);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no orthogonal transform for odd dimension ", v.n));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------------------------

HadamardPlan PlanHadamard(int64_t n) {
  HadamardPlan plan;
  plan.n = n;
  if (n < 1) return plan;
  if (IsPow2(n)) {
    plan.kind = HadamardKind::kPow2;
    plan.pow2 = n;
    return plan;
  }
  // Ascending m: the first match has the largest power-of-two factor.
  for (int m : HadamardFactorOrders()) {
    if (n % m == 0 && IsPow2(n / m)) {
      plan.kind = HadamardKind::kPow2TimesM;
      plan.pow2 = n / m;
      plan.m = m;
      return plan;
    }
  }
  if (n % 2 == 0) plan.kind = HadamardKind::kRfft;
  return plan;
}

const char* HadamardKindName(HadamardKind kind) {
  switch (kind) {
    case HadamardKind::kPow2:
      return "pow2";
    case HadamardKind::kPow2TimesM:
      return "pow2xm";
    case HadamardKind::kRfft:
      return "rfft";
    case HadamardKind::kNone:
      return "none";
  }
  return "unknown";
}

std::string DescribeHadamardPlan(const HadamardPlan& plan) {
  switch (plan.kind) {
    case HadamardKind::kPow2:
      return absl::StrCat(plan.n, " = 2^", static_cast<int>(std::log2(plan.n) + 0.5));
    case HadamardKind::kPow2TimesM:
      return absl::StrCat(plan.n, " = ", plan.pow2, " x ", plan.m);
    case HadamardKind::kRfft:
      return absl::StrCat(plan.n, ": randomized FFT of length ", plan.n / 2);
    case HadamardKind::kNone:
      return absl::StrCat(plan.n, ": none");
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Random signs and phases
// ---------------------------------------------------------------------------------------------

std::vector<int8_t> RandomSigns(int64_t n, uint64_t seed) {
  std::vector<int8_t> signs(std::max<int64_t>(n, 0));
  std::mt19937_64 rng(seed);
  uint64_t word = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 64 == 0) word = rng();
    signs[i] = ((word >> (i % 64)) & 1) ? -1 : 1;
  }
  return signs;
}

std::vector<std::complex<double>> RandomPhases(int64_t count, uint64_t seed) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  std::vector<std::complex<double>> phases(std::max<int64_t>(count, 0));
  std::mt19937_64 rng(seed);
  for (int64_t k = 0; k < count; ++k) {
    const double theta = kTwoPi * static_cast<double>(rng() >> 11) * 0x1.0p-53;
    phases[k] = std::complex<double>(std::cos(theta), std::sin(theta));
  }
  return phases;
}

// ---------------------------------------------------------------------------------------------
// Public entry points (float and double)
// ---------------------------------------------------------------------------------------------

Status FwhtInPlace(float* x, int64_t n, int64_t batch) { return FwhtImpl(x, n, batch); }
Status FwhtInPlace(double* x, int64_t n, int64_t batch) { return FwhtImpl(x, n, batch); }

Status HadamardTransform(float* x, int64_t n, int64_t batch, bool transpose) {
  return HadamardImpl(x, n, batch, transpose);
}
Status HadamardTransform(double* x, int64_t n, int64_t batch, bool transpose) {
  return HadamardImpl(x, n, batch, transpose);
}

Status HadamardTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                               bool transpose) {
  return HadamardMatrixImpl(a, rows, cols, axis, transpose);
}
Status HadamardTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                               bool transpose) {
  return HadamardMatrixImpl(a, rows, cols, axis, transpose);
}

Status RandomizedHadamardTransform(float* x, int64_t n, int64_t batch, const int8_t* signs,
                                   TransformDirection dir) {
  return RhtImpl(x, n, batch, signs, dir);
}
Status RandomizedHadamardTransform(double* x, int64_t n, int64_t batch, const int8_t* signs,
                                   TransformDirection dir) {
  return RhtImpl(x, n, batch, signs, dir);
}

Status RandomizedHadamardTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                         const int8_t* signs, TransformDirection dir) {
  return RhtMatrixImpl(a, rows, cols, axis, signs, dir);
}
Status RandomizedHadamardTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                         const int8_t* signs, TransformDirection dir) {
  return RhtMatrixImpl(a, rows, cols, axis, signs, dir);
}

Status RandomizedFftTransform(float* x, int64_t n, int64_t batch,
                              const std::complex<double>* phases, TransformDirection dir) {
  return RfftImpl(x, n, batch, phases, dir);
}
Status RandomizedFftTransform(double* x, int64_t n, int64_t batch,
                              const std::complex<double>* phases, TransformDirection dir) {
  return RfftImpl(x, n, batch, phases, dir);
}

Status RandomizedFftTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                    const std::complex<double>* phases, TransformDirection dir) {
  return RfftMatrixImpl(a, rows, cols, axis, phases, dir);
}
Status RandomizedFftTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                    const std::complex<double>* phases, TransformDirection dir) {
  return RfftMatrixImpl(a, rows, cols, axis, phases, dir);
}

Status RandomizedOrthogonalTransformMatrix(float* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                           uint64_t seed, TransformDirection dir) {
  return OrthogonalMatrixImpl(a, rows, cols, axis, seed, dir);
}
Status RandomizedOrthogonalTransformMatrix(double* a, int64_t rows, int64_t cols, MatrixAxis axis,
                                           uint64_t seed, TransformDirection dir) {
  return OrthogonalMatrixImpl(a, rows, cols, axis, seed, dir);
}

}  // namespace qcal
