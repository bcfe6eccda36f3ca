// Cayley SGD on the orthogonal group (SpinQuant's SGDG optimizer, Li et al. ICLR'20; the procedure
// in ../shared/reference/prefixquant-spinquant-notes.md (f)), for learned rotations R1 / R2
// (issue 17). One step for a parameter P [n, n] with gradient G, momentum 0 as the reference
// effectively runs it:
//   X = P with every row scaled to unit L2 norm (+1e-8); on the steps QrRetractionStep picks
//       (probability 1/101), X = Qᵀ of the QR decomposition Xᵀ = QR with Q's columns signed by
//       sign(diag R);
//   V = −Gᵀ;  Ŵ = V·X − ½·Xᵀ(X·V·X);  W = Ŵ − Ŵᵀ (skew-symmetric; ½(XᵀG − GᵀX) for orthogonal X);
//   α = min(lr, 1 / (‖W‖₁ + 1e-8)), ‖W‖₁ the largest absolute column sum;
//   Y = Xᵀ + α·V, then Y ← Xᵀ + α·W·(Xᵀ + Y)/2 — the fixed-point form of the Cayley
//       retraction (I − α/2·W)⁻¹(I + α/2·W)·Xᵀ — `iterations` (5) times as the reference, and
//       then on until it converges (the change below `tolerance`; a contraction by ≤ 1/2, since
//       α·‖W‖ ≤ 1);
//   P ← Yᵀ.
// The one departure: the reference stops after 5 iterations, which leaves the retraction
// orthogonal only to O(2⁻⁵·α‖W‖); over 1,000 steps at lr 1.5 that drifted to |R·Rᵀ − I| =
// 2.9e-4 (tests/engine/qsim/cayley_test.cc). Converged, the Cayley transform of a skew-symmetric W is
// orthogonal to rounding, and the drift stays below 1e-6.
// Computed in float64 (the rotations' master copies are float64; the model reads float32 casts).
// Deterministic: the retraction steps come from a hash of (seed, step, parameter index), not from a
// generator's state, so a resumed run takes the same steps.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace qcal::qsim {

struct CayleyOptions {
  int iterations = 5;          // fixed-point iterations of the retraction, at least
  double tolerance = 1e-14;    // then on until max |ΔY| <= tolerance (at most 200 in all)
  int64_t qr_period = 101;     // a QR re-orthonormalisation with probability 1 / qr_period
};

// Whether step `step` of parameter `param` re-orthonormalises by QR (probability 1/qr_period).
bool QrRetractionStep(uint64_t seed, int64_t step, int64_t param, int64_t qr_period);

// The updated parameter (float64 [n, n]) for p and its gradient g (any floating dtype, [n, n]).
at::Tensor CayleyStep(const at::Tensor& p, const at::Tensor& g, double lr, bool qr_retraction,
                      const CayleyOptions& options = {});

// max |P·Pᵀ − I|.
double OrthogonalityError(const at::Tensor& p);

}  // namespace qcal::qsim
