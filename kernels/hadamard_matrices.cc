// Constructions of the small Hadamard matrices H_m used in H_{2^k} ⊗ H_m.
//
//   m    construction
//   12   Paley I,  q = 11            (q ≡ 3 mod 4 prime: order q + 1)
//   20   Paley I,  q = 19
//   28   Paley II, q = 13            (q ≡ 1 mod 4 prime power: order 2(q + 1))
//   36   Paley II, q = 17
//   40   H_2 ⊗ H_20                   (Sylvester doubling)
//   52   Paley II, q = 25 = 5^2      (over GF(25))
//   60   Paley I,  q = 59
//   108  Paley I,  q = 107
//   140  Paley I,  q = 139
//   156  Williamson, t = 39          (no Paley construction reaches 156 or 172)
//   172  Williamson, t = 43
//
// Williamson: four symmetric circulant ±1 matrices A, B, C, D of order t with
// A² + B² + C² + D² = 4t·I placed in the array
//   [  A  B  C  D ]
//   [ -B  A -D  C ]
//   [ -C  D  A -B ]
//   [ -D -C  B  A ].
// The first rows below are the sequences of the Williamson-type matrices had.156.will and
// had.172.will in N. J. A. Sloane's library of Hadamard matrices (the matrices QuIP# and QuaRot
// ship); the tests check H·H^T = m·I for every order.
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard.h"
#include "kernels/hadamard_internal.h"

namespace qcal {
namespace {

// ---------------------------------------------------------------------------------------------
// GF(p^k) for k ≤ 3: elements are integers whose base-p digits are polynomial coefficients
// (digit i = coefficient of x^i), reduced modulo a monic irreducible polynomial of degree k.
// ---------------------------------------------------------------------------------------------
class GaloisField {
 public:
  GaloisField(int p, int k) : p_(p), k_(k) {
    q_ = 1;
    for (int i = 0; i < k; ++i) q_ *= p;
    if (k > 1) modulus_ = FindIrreducible();
    // Quadratic character: +1 for nonzero squares, -1 for non-squares, 0 for 0.
    chi_.assign(q_, -1);
    chi_[0] = 0;
    for (int y = 1; y < q_; ++y) chi_[Mul(y, y)] = 1;
  }

  int size() const { return q_; }
  int Chi(int a) const { return chi_[a]; }

  int Sub(int a, int b) const {
    int result = 0, scale = 1;
    for (int i = 0; i < k_; ++i) {
      const int da = a % p_, db = b % p_;
      result += ((da - db + p_) % p_) * scale;
      a /= p_;
      b /= p_;
      scale *= p_;
    }
    return result;
  }

  int Mul(int a, int b) const {
    if (k_ == 1) return (a * b) % p_;
    std::vector<int> pa = Digits(a), pb = Digits(b), prod(2 * k_ - 1, 0);
    for (int i = 0; i < k_; ++i)
      for (int j = 0; j < k_; ++j) prod[i + j] = (prod[i + j] + pa[i] * pb[j]) % p_;
    // Reduce: x^k = -(modulus_[0] + modulus_[1] x + ... + modulus_[k-1] x^{k-1}).
    for (int d = 2 * k_ - 2; d >= k_; --d) {
      const int c = prod[d];
      if (c == 0) continue;
      prod[d] = 0;
      for (int i = 0; i < k_; ++i)
        prod[d - k_ + i] = ((prod[d - k_ + i] - c * modulus_[i]) % p_ + p_) % p_;
    }
    int result = 0, scale = 1;
    for (int i = 0; i < k_; ++i) {
      result += prod[i] * scale;
      scale *= p_;
    }
    return result;
  }

 private:
  std::vector<int> Digits(int a) const {
    std::vector<int> d(k_);
    for (int i = 0; i < k_; ++i) {
      d[i] = a % p_;
      a /= p_;
    }
    return d;
  }

  // A monic polynomial of degree k ≤ 3 is irreducible iff it has no root in GF(p).
  std::vector<int> FindIrreducible() const {
    if (k_ > 3) std::abort();  // programmer error: the construction table only needs k ≤ 3
    for (int code = 0; code < q_; ++code) {
      std::vector<int> coeffs = Digits(code);  // low coefficients; leading coefficient 1
      bool has_root = false;
      for (int x = 0; x < p_ && !has_root; ++x) {
        int value = 1;  // Horner with the leading 1
        for (int i = k_ - 1; i >= 0; --i) value = (value * x + coeffs[i]) % p_;
        has_root = value == 0;
      }
      if (!has_root) return coeffs;
    }
    std::abort();  // unreachable: irreducible polynomials exist for every degree
  }

  int p_, k_, q_;
  std::vector<int> modulus_;
  std::vector<int> chi_;
};

using Matrix = std::vector<int8_t>;  // row-major, ±1

// Paley I: q ≡ 3 (mod 4) prime power → order q + 1: H = [[1, 1^T], [-1, Q + I]], Q[i][j] = χ(i-j).
Matrix PaleyI(int p, int k) {
  const GaloisField field(p, k);
  const int q = field.size(), n = q + 1;
  Matrix h(static_cast<size_t>(n) * n);
  for (int j = 0; j < n; ++j) h[j] = 1;
  for (int i = 1; i < n; ++i) {
    h[static_cast<size_t>(i) * n] = -1;
    for (int j = 1; j < n; ++j) {
      const int chi = (i == j) ? 1 : field.Chi(field.Sub(i - 1, j - 1));
      h[static_cast<size_t>(i) * n + j] = static_cast<int8_t>(chi);
    }
  }
  return h;
}

// Paley II: q ≡ 1 (mod 4) prime power → order 2(q + 1). C = [[0, 1^T], [1, Q]] is a symmetric
// conference matrix; replace 0 by [[1, -1], [-1, -1]] and ±1 by ±[[1, 1], [1, -1]].
Matrix PaleyII(int p, int k) {
  const GaloisField field(p, k);
  const int q = field.size(), c_order = q + 1, n = 2 * c_order;
  auto conference = [&](int i, int j) -> int {
    if (i == j) return 0;
    if (i == 0 || j == 0) return 1;
    return field.Chi(field.Sub(i - 1, j - 1));
  };
  Matrix h(static_cast<size_t>(n) * n);
  for (int i = 0; i < c_order; ++i) {
    for (int j = 0; j < c_order; ++j) {
      const int c = conference(i, j);
      const int block[2][2] = {{c == 0 ? 1 : c, c == 0 ? -1 : c},
                               {c == 0 ? -1 : c, c == 0 ? -1 : -c}};
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b)
          h[static_cast<size_t>(2 * i + a) * n + (2 * j + b)] = static_cast<int8_t>(block[a][b]);
    }
  }
  return h;
}

// Williamson array from the first rows of four symmetric circulants of order t.
Matrix Williamson(const char* a, const char* b, const char* c, const char* d) {
  const std::string rows[4] = {a, b, c, d};
  const int t = static_cast<int>(rows[0].size());
  const int n = 4 * t;
  // Block (r, s) = sign[r][s] · circulant(which[r][s]).
  static constexpr int kWhich[4][4] = {{0, 1, 2, 3}, {1, 0, 3, 2}, {2, 3, 0, 1}, {3, 2, 1, 0}};
  static constexpr int kSign[4][4] = {{1, 1, 1, 1}, {-1, 1, -1, 1}, {-1, 1, 1, -1}, {-1, -1, 1, 1}};
  Matrix h(static_cast<size_t>(n) * n);
  for (int r = 0; r < 4; ++r) {
    for (int s = 0; s < 4; ++s) {
      const std::string& seq = rows[kWhich[r][s]];
      for (int i = 0; i < t; ++i) {
        for (int j = 0; j < t; ++j) {
          const int v = (seq[(j - i + t) % t] == '+') ? 1 : -1;
          h[static_cast<size_t>(r * t + i) * n + (s * t + j)] =
              static_cast<int8_t>(kSign[r][s] * v);
        }
      }
    }
  }
  return h;
}

Matrix Kron(const Matrix& a, int na, const Matrix& b, int nb) {
  const int n = na * nb;
  Matrix h(static_cast<size_t>(n) * n);
  for (int i = 0; i < na; ++i)
    for (int j = 0; j < na; ++j)
      for (int k = 0; k < nb; ++k)
        for (int l = 0; l < nb; ++l)
          h[static_cast<size_t>(i * nb + k) * n + (j * nb + l)] =
              static_cast<int8_t>(a[i * na + j] * b[k * nb + l]);
  return h;
}

Matrix Sylvester(int n) {
  Matrix h(static_cast<size_t>(n) * n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      h[static_cast<size_t>(i) * n + j] = (__builtin_popcount(i & j) & 1) ? -1 : 1;
  return h;
}

// Williamson sequences (first rows of A, B, C, D), '+' = +1, '-' = -1.
constexpr const char* kWilliamson39[4] = {
    "+++--+-+-----+--++----++--+-----+-+--++",
    "++++---+--++----+-+--+-+----++--+---+++",
    "+++--++-+---+-+--+----+--+-+---+-++--++",
    "+---++-+-+-----+++-++-+++-----+-+-++---",
};
constexpr const char* kWilliamson43[4] = {
    "+---++--++++-+-+++-++--++-+++-+-++++--++---",
    "++-++++++----+-+--++-++-++--+-+----++++++-+",
    "+++-+-++--+-+-++++-+----+-++++-+-+--++-+-++",
    "++---++++-+--+--++--------++--+--+-++++---+",
};

using hadamard_internal::FactorMatrix;

std::unique_ptr<FactorMatrix> MakeFactor(int order, const char* construction, Matrix entries) {
  auto f = std::make_unique<FactorMatrix>();
  f->order = order;
  f->construction = construction;
  f->entries = std::move(entries);
  const size_t size = static_cast<size_t>(order) * order;
  f->f.resize(size);
  f->f_t.resize(size);
  f->d.resize(size);
  f->d_t.resize(size);
  for (int i = 0; i < order; ++i) {
    for (int j = 0; j < order; ++j) {
      const int8_t v = f->entries[static_cast<size_t>(i) * order + j];
      f->f[static_cast<size_t>(i) * order + j] = v;
      f->d[static_cast<size_t>(i) * order + j] = v;
      f->f_t[static_cast<size_t>(j) * order + i] = v;
      f->d_t[static_cast<size_t>(j) * order + i] = v;
    }
  }
  return f;
}

const std::map<int, std::unique_ptr<FactorMatrix>>& FactorTable() {
  static const auto* table = [] {
    auto* t = new std::map<int, std::unique_ptr<FactorMatrix>>();
    const Matrix h20 = PaleyI(19, 1);
    (*t)[12] = MakeFactor(12, "paley1 q=11", PaleyI(11, 1));
    (*t)[20] = MakeFactor(20, "paley1 q=19", h20);
    (*t)[28] = MakeFactor(28, "paley2 q=13", PaleyII(13, 1));
    (*t)[36] = MakeFactor(36, "paley2 q=17", PaleyII(17, 1));
    (*t)[40] = MakeFactor(40, "sylvester(2) x paley1 q=19", Kron(Sylvester(2), 2, h20, 20));
    (*t)[52] = MakeFactor(52, "paley2 q=25 (GF(5^2))", PaleyII(5, 2));
    (*t)[60] = MakeFactor(60, "paley1 q=59", PaleyI(59, 1));
    (*t)[108] = MakeFactor(108, "paley1 q=107", PaleyI(107, 1));
    (*t)[140] = MakeFactor(140, "paley1 q=139", PaleyI(139, 1));
    (*t)[156] = MakeFactor(
        156, "williamson t=39",
        Williamson(kWilliamson39[0], kWilliamson39[1], kWilliamson39[2], kWilliamson39[3]));
    (*t)[172] = MakeFactor(
        172, "williamson t=43",
        Williamson(kWilliamson43[0], kWilliamson43[1], kWilliamson43[2], kWilliamson43[3]));
    return t;
  }();
  return *table;
}

}  // namespace

namespace hadamard_internal {

const FactorMatrix* FindFactor(int m) {
  const auto& table = FactorTable();
  auto it = table.find(m);
  return it == table.end() ? nullptr : it->second.get();
}

}  // namespace hadamard_internal

const std::vector<int>& HadamardFactorOrders() {
  static const std::vector<int> orders = {12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172};
  return orders;
}

StatusOr<HadamardMatrix> GetHadamardMatrix(int order) {
  HadamardMatrix result;
  result.order = order;
  if (order >= 1 && order <= 4096 && (order & (order - 1)) == 0) {
    result.construction = "sylvester";
    result.entries = Sylvester(order);
    return result;
  }
  const auto* factor = hadamard_internal::FindFactor(order);
  if (factor == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("no Hadamard matrix of order ", order,
                     " (supported: powers of two up to 4096 and 12, 20, 28, 36, 40, 52, 60, 108, "
                     "140, 156, 172)"));
  }
  result.construction = factor->construction;
  result.entries = factor->entries;
  return result;
}

}  // namespace qcal
