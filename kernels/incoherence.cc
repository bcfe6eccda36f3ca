#include "kernels/incoherence.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>

// LAPACK (Fortran ABI; provided by OpenBLAS). The trailing size_t values are the hidden lengths of
// the character arguments that gfortran passes.
extern "C" {
void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
             double* work, const int* lwork, int* iwork, const int* liwork, int* info, size_t,
             size_t);
}

namespace qcal::kernels {
namespace {

Status CheckTransform(const RandomizedTransform& t, const char* what) {
  const HadamardPlan& p = t.plan;
  if (p.IsHadamard()) {
    if (static_cast<int64_t>(t.signs.size()) != p.n) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": transform of dimension ", p.n,
                                                     " holds ", t.signs.size(), " signs"));
    }
    return absl::OkStatus();
  }
  if (p.kind == HadamardKind::kRfft) {
    if (static_cast<int64_t>(t.phases.size()) * 2 != p.n) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": rfft transform of dimension ", p.n,
                                                     " holds ", t.phases.size(), " phases"));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": transform has no construction (dimension ", p.n, ")"));
}

template <typename T>
Status ApplyMatrixImpl(const RandomizedTransform& t, T* a, int64_t rows, int64_t cols,
                       MatrixAxis axis, TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckTransform(t, "incoherence"));
  const int64_t len = axis == MatrixAxis::kRows ? cols : rows;
  if (len != t.dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("incoherence: matrix [", rows, ", ", cols, "] along ",
                     axis == MatrixAxis::kRows ? "rows" : "columns", " has length ", len,
                     " but the transform has dimension ", t.dim()));
  }
  if (t.plan.IsHadamard()) {
    return RandomizedHadamardTransformMatrix(a, rows, cols, axis, t.signs.data(), dir);
  }
  return RandomizedFftTransformMatrix(a, rows, cols, axis, t.phases.data(), dir);
}

template <typename T>
Status ApplyImpl(const RandomizedTransform& t, T* x, int64_t batch, TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckTransform(t, "incoherence"));
  if (batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("incoherence: batch = ", batch, " < 0"));
  }
  if (batch == 0) return absl::OkStatus();
  if (t.plan.IsHadamard()) {
    return RandomizedHadamardTransform(x, t.dim(), batch, t.signs.data(), dir);
  }
  return RandomizedFftTransform(x, t.dim(), batch, t.phases.data(), dir);
}

Status CheckPair(const IncoherenceTransforms& t) {
  QCAL_RETURN_IF_ERROR(CheckTransform(t.u, "incoherence U"));
  return CheckTransform(t.v, "incoherence V");
}

// W ← U W Vᵀ: rows w_r → V w_r (kRows forward), then columns c → U c (kColumns forward).
template <typename T>
Status TransformWeightsImpl(const IncoherenceTransforms& t, T* w) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  if (w == nullptr) return absl::InvalidArgumentError("incoherence: null weights");
  const int64_t m = t.rows(), n = t.cols();
  QCAL_RETURN_IF_ERROR(
      ApplyMatrixImpl(t.v, w, m, n, MatrixAxis::kRows, TransformDirection::kForward));
  return ApplyMatrixImpl(t.u, w, m, n, MatrixAxis::kColumns, TransformDirection::kForward);
}

// Ŵ ← Uᵀ Ŵ V: columns c → Uᵀ c, then rows r → Vᵀ r (A ← A V).
template <typename T>
Status RestoreWeightsImpl(const IncoherenceTransforms& t, T* w_hat) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  if (w_hat == nullptr) return absl::InvalidArgumentError("incoherence: null weights");
  const int64_t m = t.rows(), n = t.cols();
  QCAL_RETURN_IF_ERROR(
      ApplyMatrixImpl(t.u, w_hat, m, n, MatrixAxis::kColumns, TransformDirection::kInverse));
  return ApplyMatrixImpl(t.v, w_hat, m, n, MatrixAxis::kRows, TransformDirection::kInverse);
}

template <typename T>
Status CheckBatch(const T* x, int64_t batch, const char* what) {
  if (batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": batch = ", batch, " < 0"));
  }
  if (x == nullptr && batch > 0) return absl::InvalidArgumentError(absl::StrCat(what, ": null"));
  return absl::OkStatus();
}

template <typename T>
Status TransformInputsImpl(const IncoherenceTransforms& t, T* x, int64_t batch) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  QCAL_RETURN_IF_ERROR(CheckBatch(x, batch, "incoherence inputs"));
  if (batch == 0) return absl::OkStatus();
  return ApplyImpl(t.v, x, batch, TransformDirection::kForward);
}

template <typename T>
Status RestoreOutputsImpl(const IncoherenceTransforms& t, T* y, int64_t batch) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  QCAL_RETURN_IF_ERROR(CheckBatch(y, batch, "incoherence outputs"));
  if (batch == 0) return absl::OkStatus();
  return ApplyImpl(t.u, y, batch, TransformDirection::kInverse);
}

template <typename T>
Status CheckFinite(const T* a, int64_t rows, int64_t cols, const char* what) {
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(a[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": non-finite entry at (", i / cols, ", ", i % cols, ")"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
StatusOr<double> WeightIncoherenceImpl(const T* w, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight incoherence: shape [", m, ", ", n, "] must be positive"));
  }
  if (w == nullptr) return absl::InvalidArgumentError("weight incoherence: null weights");
  QCAL_RETURN_IF_ERROR(CheckFinite(w, m, n, "weight incoherence"));
  double max_abs = 0.0;
  for (int64_t i = 0; i < m * n; ++i) max_abs = std::max(max_abs, std::abs(double(w[i])));
  if (max_abs == 0.0) return absl::InvalidArgumentError("weight incoherence: all-zero matrix");
  // ||W||_F / max|W| without overflow: every scaled entry is in [-1, 1].
  double sum = 0.0;
  for (int64_t i = 0; i < m * n; ++i) {
    const double s = double(w[i]) / max_abs;
    sum += s * s;
  }
  return std::sqrt(double(m) * double(n) / sum);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Transforms
// ---------------------------------------------------------------------------------------------

StatusOr<RandomizedTransform> MakeRandomizedTransform(int64_t d, uint64_t seed) {
  RandomizedTransform t;
  t.plan = PlanHadamard(d);
  t.seed = seed;
  t.has_seed = true;
  if (t.plan.IsHadamard()) {
    t.signs = RandomSigns(d, seed);
  } else if (t.plan.kind == HadamardKind::kRfft) {
    t.phases = RandomPhases(d / 2, seed);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "incoherence: no randomized orthogonal transform for dimension ", d,
        " (needs a power of two, 2^k·m with a known Hadamard order m, or an even size)"));
  }
  return t;
}

StatusOr<RandomizedTransform> RandomizedTransformFromSigns(std::vector<int8_t> signs) {
  const int64_t d = static_cast<int64_t>(signs.size());
  RandomizedTransform t;
  t.plan = PlanHadamard(d);
  if (!t.plan.IsHadamard()) {
    return absl::InvalidArgumentError(
        absl::StrCat("incoherence: ", d, " signs given, but dimension ", d,
                     " has no Hadamard construction (", HadamardKindName(t.plan.kind), ")"));
  }
  for (int64_t i = 0; i < d; ++i) {
    if (signs[i] != 1 && signs[i] != -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("incoherence: sign ", i, " is ", int(signs[i]), ", not +1 or -1"));
    }
  }
  t.signs = std::move(signs);
  return t;
}

StatusOr<RandomizedTransform> RandomizedTransformFromPhases(
    int64_t d, std::vector<std::complex<double>> phases) {
  RandomizedTransform t;
  t.plan = PlanHadamard(d);
  if (t.plan.kind != HadamardKind::kRfft) {
    return absl::InvalidArgumentError(absl::StrCat("incoherence: phases given for dimension ", d,
                                                   ", whose plan is ",
                                                   HadamardKindName(t.plan.kind), ", not rfft"));
  }
  if (static_cast<int64_t>(phases.size()) * 2 != d) {
    return absl::InvalidArgumentError(absl::StrCat("incoherence: dimension ", d, " needs ", d / 2,
                                                   " phases, got ", phases.size()));
  }
  for (size_t k = 0; k < phases.size(); ++k) {
    const double r = std::abs(phases[k]);
    if (!std::isfinite(r) || std::abs(r - 1.0) > 1e-9) {
      return absl::InvalidArgumentError(
          absl::StrCat("incoherence: phase ", k, " has modulus ", r, ", not 1"));
    }
  }
  t.phases = std::move(phases);
  return t;
}

Status ApplyTransform(const RandomizedTransform& t, double* x, int64_t batch,
                      TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckBatch(x, batch, "incoherence"));
  return ApplyImpl(t, x, batch, dir);
}
Status ApplyTransform(const RandomizedTransform& t, float* x, int64_t batch,
                      TransformDirection dir) {
  QCAL_RETURN_IF_ERROR(CheckBatch(x, batch, "incoherence"));
  return ApplyImpl(t, x, batch, dir);
}
Status ApplyTransformMatrix(const RandomizedTransform& t, double* a, int64_t rows, int64_t cols,
                            MatrixAxis axis, TransformDirection dir) {
  return ApplyMatrixImpl(t, a, rows, cols, axis, dir);
}
Status ApplyTransformMatrix(const RandomizedTransform& t, float* a, int64_t rows, int64_t cols,
                            MatrixAxis axis, TransformDirection dir) {
  return ApplyMatrixImpl(t, a, rows, cols, axis, dir);
}

StatusOr<IncoherenceTransforms> MakeIncoherenceTransforms(int64_t m, int64_t n, uint64_t seed_u,
                                                          uint64_t seed_v) {
  IncoherenceTransforms t;
  StatusOr<RandomizedTransform> u = MakeRandomizedTransform(m, seed_u);
  if (!u.ok()) return Annotate(u.status(), "U (out_features)");
  StatusOr<RandomizedTransform> v = MakeRandomizedTransform(n, seed_v);
  if (!v.ok()) return Annotate(v.status(), "V (in_features)");
  t.u = *std::move(u);
  t.v = *std::move(v);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Incoherence processing
// ---------------------------------------------------------------------------------------------

StatusOr<IncoherenceResult> IncoherenceProcess(const double* w, int64_t m, int64_t n,
                                               const double* h, uint64_t seed_u, uint64_t seed_v) {
  QCAL_ASSIGN_OR_RETURN(IncoherenceTransforms t, MakeIncoherenceTransforms(m, n, seed_u, seed_v));
  return IncoherenceProcess(w, h, t);
}

StatusOr<IncoherenceResult> IncoherenceProcess(const double* w, const double* h,
                                               const IncoherenceTransforms& t) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  const int64_t m = t.rows(), n = t.cols();
  if (w == nullptr) return absl::InvalidArgumentError("incoherence process: null weights");
  QCAL_RETURN_IF_ERROR(CheckFinite(w, m, n, "incoherence process: W"));
  if (h != nullptr) QCAL_RETURN_IF_ERROR(CheckFinite(h, n, n, "incoherence process: H"));
  IncoherenceResult r;
  r.rows = m;
  r.cols = n;
  r.transforms = t;
  r.w_hat.assign(w, w + m * n);
  QCAL_RETURN_IF_ERROR(TransformWeightsImpl(t, r.w_hat.data()));
  if (h != nullptr) {
    r.h_hat.assign(h, h + n * n);
    QCAL_RETURN_IF_ERROR(TransformHessian(t.v, r.h_hat.data()));
  }
  return r;
}

Status TransformWeights(const IncoherenceTransforms& t, double* w) {
  return TransformWeightsImpl(t, w);
}
Status TransformWeights(const IncoherenceTransforms& t, float* w) {
  return TransformWeightsImpl(t, w);
}
Status RestoreWeights(const IncoherenceTransforms& t, double* w_hat) {
  return RestoreWeightsImpl(t, w_hat);
}
Status RestoreWeights(const IncoherenceTransforms& t, float* w_hat) {
  return RestoreWeightsImpl(t, w_hat);
}

StatusOr<std::vector<double>> RecoverWeights(const IncoherenceTransforms& t, const double* w_hat) {
  QCAL_RETURN_IF_ERROR(CheckPair(t));
  if (w_hat == nullptr) return absl::InvalidArgumentError("incoherence: null weights");
  std::vector<double> w(w_hat, w_hat + t.rows() * t.cols());
  QCAL_RETURN_IF_ERROR(RestoreWeightsImpl(t, w.data()));
  return w;
}

// H ← V H Vᵀ: columns c → V c (A ← V A), then rows r → V r (A ← A Vᵀ).
Status TransformHessian(const RandomizedTransform& v, double* h) {
  QCAL_RETURN_IF_ERROR(CheckTransform(v, "incoherence V"));
  if (h == nullptr) return absl::InvalidArgumentError("incoherence: null Hessian");
  const int64_t n = v.dim();
  QCAL_RETURN_IF_ERROR(
      ApplyMatrixImpl(v, h, n, n, MatrixAxis::kColumns, TransformDirection::kForward));
  return ApplyMatrixImpl(v, h, n, n, MatrixAxis::kRows, TransformDirection::kForward);
}

// Ĥ ← Vᵀ Ĥ V.
Status RestoreHessian(const RandomizedTransform& v, double* h_hat) {
  QCAL_RETURN_IF_ERROR(CheckTransform(v, "incoherence V"));
  if (h_hat == nullptr) return absl::InvalidArgumentError("incoherence: null Hessian");
  const int64_t n = v.dim();
  QCAL_RETURN_IF_ERROR(
      ApplyMatrixImpl(v, h_hat, n, n, MatrixAxis::kColumns, TransformDirection::kInverse));
  return ApplyMatrixImpl(v, h_hat, n, n, MatrixAxis::kRows, TransformDirection::kInverse);
}

Status TransformInputs(const IncoherenceTransforms& t, double* x, int64_t batch) {
  return TransformInputsImpl(t, x, batch);
}
Status TransformInputs(const IncoherenceTransforms& t, float* x, int64_t batch) {
  return TransformInputsImpl(t, x, batch);
}
Status RestoreOutputs(const IncoherenceTransforms& t, double* y, int64_t batch) {
  return RestoreOutputsImpl(t, y, batch);
}
Status RestoreOutputs(const IncoherenceTransforms& t, float* y, int64_t batch) {
  return RestoreOutputsImpl(t, y, batch);
}

// ---------------------------------------------------------------------------------------------
// Incoherence measures
// ---------------------------------------------------------------------------------------------

StatusOr<double> WeightIncoherence(const double* w, int64_t m, int64_t n) {
  return WeightIncoherenceImpl(w, m, n);
}
StatusOr<double> WeightIncoherence(const float* w, int64_t m, int64_t n) {
  return WeightIncoherenceImpl(w, m, n);
}

StatusOr<double> HessianIncoherence(const double* h, int64_t n) {
  if (n <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("hessian incoherence: n = ", n, " must be > 0"));
  }
  if (n > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hessian incoherence: n = ", n, " too large for LAPACK"));
  }
  if (h == nullptr) return absl::InvalidArgumentError("hessian incoherence: null matrix");
  QCAL_RETURN_IF_ERROR(CheckFinite(h, n, n, "hessian incoherence"));
  // The row-major lower triangle is LAPACK's (column-major) upper triangle. On exit the array
  // holds the eigenvectors as LAPACK columns (row-major rows): Qᵀ, whose max |entry| is Q's.
  std::vector<double> a(h, h + n * n);
  std::vector<double> eig(n);
  const int ni = static_cast<int>(n);
  int info = 0, lwork = -1, liwork = -1, iwork_query = 0;
  double work_query = 0.0;
  dsyevd_("V", "U", &ni, a.data(), &ni, eig.data(), &work_query, &lwork, &iwork_query, &liwork,
          &info, 1, 1);
  if (info != 0) {
    return absl::InternalError(absl::StrCat("hessian incoherence: dsyevd query info = ", info));
  }
  lwork = static_cast<int>(work_query) + 1;
  liwork = iwork_query;
  std::vector<double> work(lwork);
  std::vector<int> iwork(std::max(liwork, 1));
  dsyevd_("V", "U", &ni, a.data(), &ni, eig.data(), work.data(), &lwork, iwork.data(), &liwork,
          &info, 1, 1);
  if (info != 0) {
    return absl::InternalError(
        absl::StrCat("hessian incoherence: dsyevd failed to converge (info = ", info, ")"));
  }
  double max_abs = 0.0;
  for (double q : a) max_abs = std::max(max_abs, std::abs(q));
  return max_abs * std::sqrt(double(n));
}

}  // namespace qcal::kernels
