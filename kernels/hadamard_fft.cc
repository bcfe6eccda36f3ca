// Double-precision complex FFT of any length for the randomized FFT transform (QuIP# Alg. 4).
//
// Lengths whose prime factors are all ≤ kMaxDirectRadix use a mixed-radix Stockham autosort
// (decimation in frequency; radix 4 and 2 butterflies, an O(p²) direct DFT for odd primes p).
// Other lengths use Bluestein's chirp-z algorithm over a power-of-two Stockham FFT of length
// M ≥ 2n - 1. Twiddles are computed directly with cos/sin of exact rational angles (no
// recurrences), so errors stay at a few ulps · log n.
#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/hadamard_internal.h"

namespace qcal {
namespace hadamard_internal {
namespace {

using Complex = std::complex<double>;

constexpr double kTwoPi = 6.283185307179586476925286766559;

// e^{-2πi·num/den} with num reduced modulo den first (keeps the angle argument small).
Complex UnitRoot(int64_t num, int64_t den) {
  num %= den;
  if (num < 0) num += den;
  const double angle = kTwoPi * static_cast<double>(num) / static_cast<double>(den);
  return Complex(std::cos(angle), -std::sin(angle));
}

std::vector<int> Factorize(int64_t n, int64_t* largest_prime) {
  std::vector<int> primes;
  *largest_prime = 1;
  for (int64_t p = 2; p * p <= n; ++p) {
    while (n % p == 0) {
      primes.push_back(static_cast<int>(p));
      *largest_prime = p;
      n /= p;
    }
  }
  if (n > 1) {
    *largest_prime = n;
    if (n <= FftPlan::kMaxDirectRadix) primes.push_back(static_cast<int>(n));
  }
  return primes;
}

// Radix list for Stockham: 4s first (from pairs of 2s), then a leftover 2, then odd primes.
std::vector<int> RadixSchedule(const std::vector<int>& primes) {
  int twos = 0;
  std::vector<int> odd;
  for (int p : primes) {
    if (p == 2) {
      ++twos;
    } else {
      odd.push_back(p);
    }
  }
  std::vector<int> radices(twos / 2, 4);
  if (twos % 2) radices.push_back(2);
  radices.insert(radices.end(), odd.begin(), odd.end());
  return radices;
}

// Plain complex product. std::complex's operator* also handles inf/NaN per C Annex G, which
// costs a branch and a libgcc call on the slow path and blocks vectorization.
inline Complex Mul(Complex a, Complex b) {
  return Complex(a.real() * b.real() - a.imag() * b.imag(),
                 a.real() * b.imag() + a.imag() * b.real());
}

inline Complex MulI(Complex z, bool inverse) {
  // Forward uses ω_4 = -i, inverse ω_4 = +i: returns (∓i)·z.
  return inverse ? Complex(-z.imag(), z.real()) : Complex(z.imag(), -z.real());
}

}  // namespace

struct FftPlan::Bluestein {
  int64_t m = 0;                 // power-of-two convolution length
  std::vector<Complex> chirp;    // c_t = e^{-πi t²/n}, t < n
  std::vector<Complex> kernel;   // FFT_m of b, b_j = conj(c_|j|) on the circle, scaled by 1/m
  std::unique_ptr<FftPlan> sub;  // the length-m FFT
};

FftPlan::FftPlan(int64_t n) : n_(n) {
  int64_t largest_prime = 1;
  const std::vector<int> primes = Factorize(n, &largest_prime);
  if (largest_prime <= kMaxDirectRadix) {
    radices_ = RadixSchedule(primes);
    twiddles_.resize(n);
    for (int64_t t = 0; t < n; ++t) twiddles_[t] = UnitRoot(t, n);
    return;
  }
  bluestein_ = std::make_unique<Bluestein>();
  Bluestein& b = *bluestein_;
  b.m = 1;
  while (b.m < 2 * n - 1) b.m *= 2;
  b.sub = std::make_unique<FftPlan>(b.m);
  // t² mod 2n keeps the chirp angle exact: e^{-πi t²/n} = e^{-2πi (t² mod 2n)/(2n)}.
  b.chirp.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t t2 = static_cast<int64_t>((static_cast<unsigned __int128>(t) * t) % (2 * n));
    b.chirp[t] = UnitRoot(t2, 2 * n);
  }
  b.kernel.assign(b.m, Complex(0, 0));
  const double inv_m = 1.0 / static_cast<double>(b.m);
  for (int64_t t = 0; t < n; ++t) {
    b.kernel[t] = std::conj(b.chirp[t]) * inv_m;
    if (t > 0) b.kernel[b.m - t] = std::conj(b.chirp[t]) * inv_m;
  }
  std::vector<Complex> work;
  b.sub->Execute(b.kernel.data(), /*inverse=*/false, work);
}

FftPlan::~FftPlan() = default;

void FftPlan::Stockham(Complex* data, bool inverse, Complex* scratch) const {
  // Stage invariant: the current array holds `s` interleaved sub-problems of length `len`,
  // element t of sub-problem r at r + s·t. A radix-p stage splits each into p of length len/p.
  Complex* x = data;
  Complex* y = scratch;
  int64_t len = n_, s = 1;
  const int64_t n = n_;
  auto tw = [&](int64_t idx) {  // e^{∓2πi idx/n}
    const Complex w = twiddles_[idx];
    return inverse ? std::conj(w) : w;
  };
  std::vector<Complex> a, dft;
  for (int p : radices_) {
    const int64_t m = len / p;
    const int64_t stride = n / len;  // ω_len^e = ω_n^{e·stride}
    if (p == 2) {
      for (int64_t q = 0; q < m; ++q) {
        const Complex w1 = tw(q * stride);
        for (int64_t r = 0; r < s; ++r) {
          const Complex a0 = x[r + s * q], a1 = x[r + s * (q + m)];
          y[r + s * (2 * q)] = a0 + a1;
          y[r + s * (2 * q + 1)] = Mul(a0 - a1, w1);
        }
      }
    } else if (p == 4) {
      for (int64_t q = 0; q < m; ++q) {
        const Complex w1 = tw(q * stride), w2 = tw(2 * q * stride), w3 = tw(3 * q * stride);
        for (int64_t r = 0; r < s; ++r) {
          const Complex a0 = x[r + s * q], a1 = x[r + s * (q + m)];
          const Complex a2 = x[r + s * (q + 2 * m)], a3 = x[r + s * (q + 3 * m)];
          const Complex t0 = a0 + a2, t1 = a0 - a2, t2 = a1 + a3, t3 = MulI(a1 - a3, inverse);
          y[r + s * (4 * q)] = t0 + t2;
          y[r + s * (4 * q + 1)] = Mul(t1 + t3, w1);
          y[r + s * (4 * q + 2)] = Mul(t0 - t2, w2);
          y[r + s * (4 * q + 3)] = Mul(t1 - t3, w3);
        }
      }
    } else {
      // Direct radix-p DFT: y_j = ω_len^{jq} Σ_k a_k ω_p^{jk}, with ω_p = ω_n^{n/p}.
      a.resize(p);
      dft.resize(static_cast<size_t>(p) * p);
      for (int j = 0; j < p; ++j)
        for (int k = 0; k < p; ++k) dft[j * p + k] = tw(((j * k) % p) * (n / p));
      for (int64_t q = 0; q < m; ++q) {
        for (int64_t r = 0; r < s; ++r) {
          for (int k = 0; k < p; ++k) a[k] = x[r + s * (q + m * k)];
          for (int j = 0; j < p; ++j) {
            Complex acc = a[0];
            for (int k = 1; k < p; ++k) acc += Mul(a[k], dft[j * p + k]);
            y[r + s * (p * q + j)] = j == 0 ? acc : Mul(acc, tw(j * q * stride));
          }
        }
      }
    }
    std::swap(x, y);
    len = m;
    s *= p;
  }
  if (x != data) std::copy(x, x + n, data);
}

void FftPlan::Execute(Complex* data, bool inverse, std::vector<Complex>& work) const {
  if (n_ <= 1) return;
  if (!bluestein_) {
    if (static_cast<int64_t>(work.size()) < n_) work.resize(n_);
    Stockham(data, inverse, work.data());
    return;
  }
  // Bluestein: X_k = c_k Σ_t (x_t c_t) conj(c_{k-t}); the inverse DFT is conj∘DFT∘conj.
  const Bluestein& b = *bluestein_;
  const int64_t m = b.m;
  if (static_cast<int64_t>(work.size()) < 2 * m) work.resize(2 * m);
  Complex* conv = work.data();
  Complex* scratch = work.data() + m;  // the power-of-two sub-plan is always Stockham
  for (int64_t t = 0; t < n_; ++t) {
    const Complex xt = inverse ? std::conj(data[t]) : data[t];
    conv[t] = Mul(xt, b.chirp[t]);
  }
  std::fill(conv + n_, conv + m, Complex(0, 0));
  b.sub->Stockham(conv, /*inverse=*/false, scratch);
  for (int64_t j = 0; j < m; ++j) conv[j] = Mul(conv[j], b.kernel[j]);
  b.sub->Stockham(conv, /*inverse=*/true, scratch);
  for (int64_t k = 0; k < n_; ++k) {
    const Complex xk = Mul(conv[k], b.chirp[k]);
    data[k] = inverse ? std::conj(xk) : xk;
  }
}

}  // namespace hadamard_internal
}  // namespace qcal
