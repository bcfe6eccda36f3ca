// Internal pieces of the Hadamard/RFFT CPU reference shared by hadamard.cc, hadamard_matrices.cc
// and hadamard_fft.cc. Not part of the public API; include kernels/hadamard.h instead.
#pragma once

#include <complex>
#include <cstdint>
#include <memory>
#include <vector>

namespace qcal {
namespace hadamard_internal {

// One cached non-power-of-two Hadamard factor H_m, in the element types the transforms use.
// Row-major m×m; `*_t` hold the transpose. Immutable after construction.
struct FactorMatrix {
  int order = 0;
  const char* construction = "";
  std::vector<int8_t> entries;
  std::vector<float> f, f_t;
  std::vector<double> d, d_t;

  const float* Data(bool transpose, float) const { return transpose ? f_t.data() : f.data(); }
  const double* Data(bool transpose, double) const { return transpose ? d_t.data() : d.data(); }
};

// The cached factor of order m (one of HadamardFactorOrders()), or nullptr. Thread-safe.
const FactorMatrix* FindFactor(int m);

// Complex FFT of one fixed length n ≥ 1, unnormalized:
//   Forward: X_k = Σ_t x_t e^{-2πi tk/n};  Inverse: x_t = Σ_k X_k e^{+2πi tk/n}.
// Mixed-radix Stockham (radix 4, 2 and generic odd primes ≤ kMaxDirectRadix) or Bluestein for
// lengths with a larger prime factor. Plans are immutable; Execute is const and thread-safe as
// long as each thread passes its own `work` buffer.
class FftPlan {
 public:
  static constexpr int64_t kMaxDirectRadix = 64;

  explicit FftPlan(int64_t n);
  ~FftPlan();
  FftPlan(const FftPlan&) = delete;
  FftPlan& operator=(const FftPlan&) = delete;

  int64_t size() const { return n_; }
  bool uses_bluestein() const { return bluestein_ != nullptr; }

  // Transforms data[0..n) in place. `work` is resized as needed.
  void Execute(std::complex<double>* data, bool inverse,
               std::vector<std::complex<double>>& work) const;

 private:
  struct Bluestein;
  void Stockham(std::complex<double>* data, bool inverse, std::complex<double>* scratch) const;

  int64_t n_ = 0;
  std::vector<int> radices_;                    // product = n_ (Stockham only)
  std::vector<std::complex<double>> twiddles_;  // e^{-2πi t/n}, t < n (Stockham only)
  std::unique_ptr<Bluestein> bluestein_;
};

}  // namespace hadamard_internal
}  // namespace qcal
