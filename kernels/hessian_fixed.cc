#include "kernels/hessian_fixed.h"

#include <cblas.h>

#include "absl/strings/str_cat.h"

namespace qcal::kernels {

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
