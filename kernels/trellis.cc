#include "kernels/trellis.h"

#include "kernels/trellis_pass.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <regex>

#include "absl/strings/str_cat.h"

namespace qcal::kernels {
namespace {

constexpr int kHybTableBits = 9;

// IEEE binary16 bit pattern -> float (normal and subnormal; 3inst never forms inf or NaN).
float HalfToFloat(uint32_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 31u, mant = h & 1023u;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, static_cast<int>(exp) - 15);
  }
  return sign ? -v : v;
}

float Value1Mad(uint32_t s) {
  const uint32_t x = s * 34038481u + 76625530u;
  const int sum = static_cast<int>((x & 255u) + ((x >> 8) & 255u) + ((x >> 16) & 255u) + (x >> 24));
  return static_cast<float>(sum - 510) / 147.800537109375f;
}

float Value3Inst(uint32_t s) {
  const uint32_t x = s * 89226354u + 64248484u;
  const uint32_t r = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
  return HalfToFloat(r >> 16) + HalfToFloat(r & 0xFFFFu);
}

// splitmix64: the fixed-seed source of the hyb table's Gaussian samples.
uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<float> FitHybTable() {
  // Lloyd's k-means, 512 centres, on 2^16 standard Gaussian pairs (Box–Muller from splitmix64,
  // seed 0x51C7), initialised with the first 512 pairs, 24 iterations; a centre that loses all
  // its points keeps its place. Deterministic: fixed order, double accumulation.
  constexpr int kCentres = 1 << kHybTableBits;
  constexpr int kSamples = 1 << 16;
  constexpr int kIterations = 24;
  std::vector<double> pts(2 * kSamples);
  uint64_t st = 0x51C7;
  for (int i = 0; i < kSamples; ++i) {
    const double u1 = (static_cast<double>(SplitMix(&st) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(SplitMix(&st) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    pts[2 * i] = r * std::cos(2.0 * M_PI * u2);
    pts[2 * i + 1] = r * std::sin(2.0 * M_PI * u2);
  }
  std::vector<double> c(pts.begin(), pts.begin() + 2 * kCentres);
  std::vector<double> sum(2 * kCentres);
  std::vector<int> n(kCentres);
  for (int it = 0; it < kIterations; ++it) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(n.begin(), n.end(), 0);
    for (int i = 0; i < kSamples; ++i) {
      const double x = pts[2 * i], y = pts[2 * i + 1];
      int arg = 0;
      double best = std::numeric_limits<double>::infinity();
      for (int j = 0; j < kCentres; ++j) {
        const double dx = c[2 * j] - x, dy = c[2 * j + 1] - y;
        const double d = dx * dx + dy * dy;
        if (d < best) {
          best = d;
          arg = j;
        }
      }
      sum[2 * arg] += x;
      sum[2 * arg + 1] += y;
      ++n[arg];
    }
    for (int j = 0; j < kCentres; ++j) {
      if (n[j] == 0) continue;
      c[2 * j] = sum[2 * j] / n[j];
      c[2 * j + 1] = sum[2 * j + 1] / n[j];
    }
  }
  return std::vector<float>(c.begin(), c.end());
}

// Bits [pos, pos + len) of a stream of 8-bit words (MSB first), len <= 24.
uint32_t GetBits(const uint32_t* words, int64_t pos, int len) {
  uint32_t v = 0;
  for (int i = 0; i < len; ++i) {
    const int64_t p = pos + i;
    v = (v << 1) | ((words[p >> 3] >> (7 - (p & 7))) & 1u);
  }
  return v;
}

void PutBits(uint32_t* words, int64_t pos, int len, uint32_t v) {
  for (int i = 0; i < len; ++i) {
    const int64_t p = pos + i;
    const uint32_t bit = (v >> (len - 1 - i)) & 1u;
    const uint32_t mask = 1u << (7 - (p & 7));
    words[p >> 3] = bit ? (words[p >> 3] | mask) : (words[p >> 3] & ~mask);
  }
}

}  // namespace

const char* TrellisCodeName(TrellisCode code) {
  switch (code) {
    case TrellisCode::k1Mad: return "1mad";
    case TrellisCode::k3Inst: return "3inst";
    case TrellisCode::kHyb: return "hyb";
  }
  return "?";
}

std::string TrellisName(const TrellisParams& p) {
  return absl::StrCat("qtip_", TrellisCodeName(p.code), "_l", p.L, "_k", p.k);
}

StatusOr<TrellisParams> ParseTrellisName(const std::string& name) {
  static const std::regex re("qtip_(1mad|3inst|hyb)_l([0-9]{1,2})_k([0-9])");
  std::smatch m;
  if (!std::regex_match(name, m, re)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trellis codebook '", name, "' is not qtip_<1mad|3inst|hyb>_l<L>_k<k> (e.g. qtip_hyb_l16_k2)"));
  }
  TrellisParams p;
  p.code = m[1] == "1mad" ? TrellisCode::k1Mad
           : m[1] == "3inst" ? TrellisCode::k3Inst
                             : TrellisCode::kHyb;
  p.L = std::stoi(m[2]);
  p.k = std::stoi(m[3]);
  if (p.k < 2 || p.k > 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis codebook '", name, "': k = ", p.k, " bits per weight, need 2, 3 or 4"));
  }
  if (p.L <= p.k * p.V() || p.L > 20) {
    return absl::InvalidArgumentError(absl::StrCat("trellis codebook '", name, "': L = ", p.L,
                                                   " state bits, need ", p.k * p.V() + 1,
                                                   "..20 for k = ", p.k, ", V = ", p.V()));
  }
  return p;
}

const std::vector<float>& HybTable() {
  static const std::vector<float> table = FitHybTable();
  return table;
}

struct TrellisCodebook::Workspace {
  std::vector<float> cost, next, best;
  std::vector<uint8_t> bp;  // [T/V, 2^(L−kV)]
  std::vector<float> rolled;
  std::vector<uint32_t> states;
};

TrellisCodebook::TrellisCodebook(const TrellisParams& p) : p_(p) {
  const int V = p.V();
  const uint32_t n = 1u << p.L;
  values_.resize(static_cast<size_t>(n) * V);
  const std::vector<float>* table = p.code == TrellisCode::kHyb ? &HybTable() : nullptr;
  for (uint32_t s = 0; s < n; ++s) {
    switch (p.code) {
      case TrellisCode::k1Mad: values_[s] = Value1Mad(s); break;
      case TrellisCode::k3Inst: values_[s] = Value3Inst(s); break;
      case TrellisCode::kHyb: {
        const uint32_t h = s * (s + 1u);
        const uint32_t i = (h >> (15 - kHybTableBits)) & ((1u << kHybTableBits) - 1u);
        const float flip = (h >> 15) & 1u ? -1.0f : 1.0f;
        values_[2 * s] = flip * (*table)[2 * i];
        values_[2 * s + 1] = (*table)[2 * i + 1];
        break;
      }
    }
  }
  soa0_.resize(n);
  soa1_.resize(V == 2 ? n : 0);
  for (uint32_t s = 0; s < n; ++s) {
    soa0_[s] = values_[s * V];
    if (V == 2) soa1_[s] = values_[s * V + 1];
  }
  // The input multiplier: the codes' RMS times a factor per bit rate, the best on N(0, 1) at
  // L = 16 for all three codes to within 1% (swept in steps of 0.05 with bench/codebook_mse;
  // docs/results.md, "Codebook MSE").
  double ss = 0;
  for (float v : values_) ss += static_cast<double>(v) * v;
  const double rms = std::sqrt(ss / static_cast<double>(values_.size()));
  static constexpr double kFactor[5] = {0, 0, 0.966, 0.90, 0.87};
  default_scale_ = rms * kFactor[p.k];
  // The Viterbi pass: the widest vector this CPU runs (or the one asked for, if it runs here)
  // that the 2^(L − kV) predecessor groups fill; the scalar pass below 4.
  const uint32_t groups = n >> (p.k * V);
  for (int w : TrellisLanes()) {
    if ((p.lanes == 0 || w == p.lanes) && groups >= static_cast<uint32_t>(w)) {
      lanes_ = w;
      break;
    }
  }
}

namespace {

// The cheapest final state (among those whose low L − KV bits equal the overlap, when given)
// and the back pointers' walk to the first.
void FinishViterbi(uint32_t J, uint32_t M, uint32_t n, int KV, int64_t S, const float* cost,
                   const uint8_t* bp_all, int64_t overlap, uint32_t* states) {
  uint32_t last = 0;
  float b = std::numeric_limits<float>::infinity();
  if (overlap >= 0) {
    for (uint32_t i = 0; i < J; ++i) {
      const uint32_t s = i * M + static_cast<uint32_t>(overlap);
      if (cost[s] < b) {
        b = cost[s];
        last = s;
      }
    }
  } else {
    for (uint32_t s = 0; s < n; ++s) {
      if (cost[s] < b) {
        b = cost[s];
        last = s;
      }
    }
  }
  states[S - 1] = last;
  for (int64_t t = S - 1; t > 0; --t) {
    const uint32_t m = states[t] >> KV;
    states[t - 1] = static_cast<uint32_t>(bp_all[t * M + m]) * M + m;
  }
}

// A constrained pass starts only from the states whose top L − KV bits are the overlap.
void RestrictToOverlap(uint32_t n, int KV, int64_t overlap, float* cost) {
  if (overlap < 0) return;
  for (uint32_t s = 0; s < n; ++s) {
    if ((s >> KV) != static_cast<uint32_t>(overlap)) cost[s] = std::numeric_limits<float>::infinity();
  }
}

// The same pass one state at a time, for any L, k, V (used when M = 2^(L − KV) < 4; the tests
// check both passes against an independent dynamic program).
void ScalarViterbiPass(const float* values, int V, int KV, int L, const float* x, int T,
                       int64_t overlap, float* cost, float* next, float* best, uint8_t* bp_all,
                       uint32_t* states) {
  const uint32_t J = 1u << KV;
  const int64_t S = T / V;
  const uint32_t n = 1u << L, M = n >> KV;
  auto step_error = [&](const float* xt, float* dst, const float* add) {
    for (uint32_t s = 0; s < n; ++s) {
      float d = 0.0f;
      for (int j = 0; j < V; ++j) {
        const float e = values[s * V + j] - xt[j];
        d += e * e;
      }
      dst[s] = (add ? add[s >> KV] : 0.0f) + d;
    }
  };
  step_error(x, cost, nullptr);
  RestrictToOverlap(n, KV, overlap, cost);
  for (int64_t t = 1; t < S; ++t) {
    uint8_t* bp = &bp_all[t * M];
    for (uint32_t m = 0; m < M; ++m) {
      float b = cost[m];
      uint8_t a = 0;
      for (uint32_t i = 1; i < J; ++i) {
        if (cost[i * M + m] < b) {
          b = cost[i * M + m];
          a = static_cast<uint8_t>(i);
        }
      }
      best[m] = b;
      bp[m] = a;
    }
    step_error(&x[t * V], next, best);
    std::swap(cost, next);
  }
  FinishViterbi(J, M, n, KV, S, cost, bp_all, overlap, states);
}

}  // namespace

std::vector<int> TrellisLanes() {
  std::vector<int> lanes;
#if QCAL_TRELLIS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) lanes.push_back(16);
  if (__builtin_cpu_supports("avx2")) lanes.push_back(8);
#endif
  lanes.push_back(4);
  return lanes;
}

void TrellisCodebook::Viterbi(const float* x, int T, int64_t overlap, Workspace& ws,
                              uint32_t* states) const {
  const int L = p_.L, V = p_.V(), kv = p_.k * V;
  const uint32_t J = 1u << kv, n = 1u << L, M = n >> kv;
  const int64_t S = T / V;
  if (lanes_ == 0) {
    ScalarViterbiPass(values_.data(), V, kv, L, x, T, overlap, ws.cost.data(), ws.next.data(),
                      ws.best.data(), ws.bp.data(), states);
    return;
  }
  const trellis_internal::PassArgs args{soa0_.data(), soa1_.data(),   L,
                                        x,            T,              overlap,
                                        ws.cost.data(), ws.next.data(), ws.best.data(),
                                        ws.bp.data()};
  const float* cost = nullptr;
  switch (lanes_) {
#if QCAL_TRELLIS_X86
    case 16: cost = trellis_internal::PassW16(V, kv, args); break;
    case 8: cost = trellis_internal::PassW8(V, kv, args); break;
#endif
    default: cost = trellis_internal::DispatchPass<4>(V, kv, args); break;
  }
  FinishViterbi(J, M, n, kv, S, cost, ws.bp.data(), overlap, states);
}

void TrellisCodebook::Prepare(Workspace& ws) const {
  const int kv = p_.k * p_.V();
  const int64_t S = kSequence / p_.V();
  const uint32_t n = 1u << p_.L;
  ws.cost.resize(n);
  ws.next.resize(n);
  ws.best.resize((n >> kv) + 16);  // the wide passes read up to 16 floats past the groups
  ws.bp.resize(static_cast<size_t>(S) * (n >> kv));
  ws.rolled.resize(kSequence);
  ws.states.resize(S);
}

double TrellisCodebook::EncodeSequence(const float* x, int T, uint32_t* stream, float* out) const {
  Workspace ws;
  Prepare(ws);
  return Encode(x, T, ws, stream, out);
}

double TrellisCodebook::Encode(const float* x, int T, Workspace& ws, uint32_t* stream,
                               float* out) const {
  const int V = p_.V(), kv = p_.k * V;
  const int64_t S = T / V;
  // Pass 1: the sequence rotated by T/2, so that step 0 sits mid-sequence.
  for (int i = 0; i < T; ++i) ws.rolled[(i + T / 2) % T] = x[i];
  Viterbi(ws.rolled.data(), T, -1, ws, ws.states.data());
  const int64_t overlap = ws.states[S / 2] >> kv;
  // Pass 2: constrained to start and end on that overlap.
  Viterbi(x, T, overlap, ws, ws.states.data());
  const uint32_t J = 1u << kv;
  std::fill(stream, stream + T * p_.k / 8, 0u);
  for (int64_t t = 0; t < S; ++t) PutBits(stream, t * kv, kv, ws.states[t] & (J - 1));
  double err = 0;
  for (int64_t t = 0; t < S; ++t) {
    const float* v = value(ws.states[t]);
    for (int j = 0; j < V; ++j) {
      const double d = static_cast<double>(v[j]) - x[t * V + j];
      err += d * d;
      if (out) out[t * V + j] = v[j];
    }
  }
  return err;
}

void TrellisCodebook::DecodeSequence(const uint32_t* stream, int T, float* out) const {
  const int V = p_.V(), kv = p_.k * V;
  const int64_t S = T / V;
  const int64_t bits = static_cast<int64_t>(T) * p_.k;
  const uint32_t mask = (1u << p_.L) - 1u;
  uint32_t state = GetBits(stream, bits - p_.L, p_.L);
  for (int64_t t = 0; t < S; ++t) {
    state = ((state << kv) | GetBits(stream, t * kv, kv)) & mask;
    const float* v = value(state);
    for (int j = 0; j < V; ++j) out[t * V + j] = v[j];
  }
}

Status TrellisCodebook::CheckRows(int64_t rows) const {
  const int64_t rest = rows % kTileRows;
  if (rows <= 0 || (rest != 0 && rest * kTileCols * p_.k < p_.L)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codebook '", name(), "': ", rows, " rows leave a last tile of ", rest, " rows (",
        rest * kTileCols * p_.k, " code bits), fewer than the ", p_.L,
        " state bits its tail-biting stream needs; pad the rows to a multiple of ", kTileRows));
  }
  return absl::OkStatus();
}

namespace {
void AbortOnBadCount(const TrellisCodebook& cb, const char* what, int64_t count) {
  const Status s = cb.CheckRows(count);
  if (s.ok()) return;
  std::fprintf(stderr, "TrellisCodebook::%s: %s\n", what, std::string(s.message()).c_str());
  std::abort();
}
}  // namespace

void TrellisCodebook::Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const {
  AbortOnBadCount(*this, "Quantize", count);
  const int64_t words_per_vector = p_.k;  // kTileCols·k bits in 8-bit words
  std::vector<uint32_t> scratch(codes ? 0 : kTileRows * words_per_vector);
  Workspace ws;
  Prepare(ws);
  for (int64_t r0 = 0; r0 < count; r0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, count - r0));
    uint32_t* stream = codes ? &codes[r0 * words_per_vector] : scratch.data();
    Encode(&x[r0 * kTileCols], rows * kTileCols, ws, stream, &out[r0 * kTileCols]);
  }
}

void TrellisCodebook::Decode(const uint32_t* codes, int64_t count, float* out) const {
  AbortOnBadCount(*this, "Decode", count);
  for (int64_t r0 = 0; r0 < count; r0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, count - r0));
    DecodeSequence(&codes[r0 * p_.k], rows * kTileCols, &out[r0 * kTileCols]);
  }
}

std::unique_ptr<VectorCodebook> MakeTrellisCodebook(const TrellisParams& p) {
  return std::unique_ptr<VectorCodebook>(new TrellisCodebook(p));
}

}  // namespace qcal::kernels
