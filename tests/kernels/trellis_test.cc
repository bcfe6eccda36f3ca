// Tests for the bitshift trellis codebooks (kernels/trellis.h) and their use in BlockLDLQ and the
// refinement sweeps (kernels/rounding.h). The encoder is checked against an independent dynamic
// program written here (double precision, one state at a time), the codes against the decoder
// bit for bit, and the distortion on Gaussian sequences against the lattice codebooks'.
#include "kernels/trellis.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/codebook.h"
#include "kernels/rounding.h"
#include "kernels/trellis_pass.h"

namespace qcal::kernels {
namespace {

constexpr int kT = TrellisCodebook::kSequence;

std::unique_ptr<TrellisCodebook> Make(const std::string& name) {
  auto p = ParseTrellisName(name);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::make_unique<TrellisCodebook>(*p);
}

std::vector<float> Gaussian(int64_t count, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> x(count);
  for (auto& v : x) v = static_cast<float>(scale * normal(rng));
  return x;
}

uint32_t Bits(const uint32_t* words, int64_t pos, int len) {
  uint32_t v = 0;
  for (int i = 0; i < len; ++i) {
    const int64_t p = pos + i;
    v = (v << 1) | ((words[p >> 3] >> (7 - (p & 7))) & 1u);
  }
  return v;
}

// min over every stream whose last L − kV bits are `overlap` of Σ|c(state_t) − x_t|², by a
// forward dynamic program over all 2^L states in double precision (no back pointers).
double BestTailBitingError(const TrellisCodebook& cb, const float* x, int T, uint32_t overlap) {
  const TrellisParams& p = cb.params();
  const int V = p.V(), kv = p.k * V;
  const uint32_t n = 1u << p.L, M = n >> kv;
  const double inf = std::numeric_limits<double>::infinity();
  auto err = [&](uint32_t s, int t) {
    double e = 0;
    for (int j = 0; j < V; ++j) {
      const double d = static_cast<double>(cb.value(s)[j]) - x[t * V + j];
      e += d * d;
    }
    return e;
  };
  std::vector<double> cost(n, inf), next(n);
  for (uint32_t s = 0; s < n; ++s) {
    if ((s >> kv) == overlap) cost[s] = err(s, 0);
  }
  for (int t = 1; t < T / V; ++t) {
    for (uint32_t s = 0; s < n; ++s) {
      double best = inf;
      for (uint32_t i = 0; i < (1u << kv); ++i) best = std::min(best, cost[i * M + (s >> kv)]);
      next[s] = best + err(s, t);
    }
    cost.swap(next);
  }
  double best = inf;
  for (uint32_t s = 0; s < n; ++s) {
    if ((s & (M - 1)) == overlap) best = std::min(best, cost[s]);
  }
  return best;
}

TEST(TrellisTest, NamesParseAndBadNamesAreRefusedWithTheReason) {
  auto p = ParseTrellisName("qtip_hyb_l16_k2");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->code, TrellisCode::kHyb);
  EXPECT_EQ(p->L, 16);
  EXPECT_EQ(p->k, 2);
  EXPECT_EQ(p->V(), 2);
  EXPECT_EQ(TrellisName(*p), "qtip_hyb_l16_k2");
  EXPECT_EQ(ParseTrellisName("qtip_3inst_l12_k4")->V(), 1);
  auto bad_k = ParseTrellisName("qtip_1mad_l16_k5");
  ASSERT_FALSE(bad_k.ok());
  EXPECT_NE(bad_k.status().message().find("k = 5"), std::string::npos) << bad_k.status();
  auto bad_l = ParseTrellisName("qtip_hyb_l8_k4");  // kV = 8 needs L > 8
  ASSERT_FALSE(bad_l.ok());
  EXPECT_NE(bad_l.status().message().find("L = 8"), std::string::npos) << bad_l.status();
  EXPECT_FALSE(ParseTrellisName("qtip_2mad_l16_k2").ok());
  auto via_factory = MakeCodebook("qtip_hyb_l30_k2");
  ASSERT_FALSE(via_factory.ok());
  EXPECT_NE(via_factory.status().message().find("qtip_hyb_l30_k2"), std::string::npos);
  auto cb = MakeCodebook("qtip_1mad_l16_k3");
  ASSERT_TRUE(cb.ok()) << cb.status();
  EXPECT_EQ((*cb)->dim(), 8);
  EXPECT_EQ((*cb)->joint_vectors(), 32);
  EXPECT_EQ((*cb)->code_words(), 3);
  EXPECT_EQ((*cb)->bits_per_weight(), 3.0);
}

TEST(TrellisTest, CodesAreComputedNotStored) {
  // 1mad: four bytes summed; 3inst: two binary16 halves; both near N(0, 1) over all states.
  for (const char* name : {"qtip_1mad_l16_k2", "qtip_3inst_l16_k2", "qtip_hyb_l16_k2"}) {
    auto cb = Make(name);
    const uint32_t n = 1u << 16;
    double sum = 0, ss = 0;
    for (uint32_t s = 0; s < n; ++s) {
      for (int j = 0; j < cb->params().V(); ++j) {
        const double v = cb->value(s)[j];
        ASSERT_TRUE(std::isfinite(v)) << name << " state " << s;
        sum += v;
        ss += v * v;
      }
    }
    const double count = static_cast<double>(n) * cb->params().V();
    EXPECT_LT(std::abs(sum / count), 0.05) << name;
    EXPECT_GT(ss / count, 0.8) << name;
    EXPECT_LT(ss / count, 1.7) << name;
  }
  // 1mad of state 0: 76625530 = 0x0491367A -> bytes 0x04 + 0x91 + 0x36 + 0x7A = 325.
  auto mad = Make("qtip_1mad_l16_k2");
  EXPECT_FLOAT_EQ(mad->value(0)[0], static_cast<float>(325 - 510) / 147.800537109375f);
}

// The encoder's result is the best stream with its overlap (checked by the independent DP), and
// decoding its codes gives exactly the points it returned; for the vector pass (L − kV >= 2) and
// the scalar one (L − kV = 1), V = 1 and 2.
TEST(TrellisTest, ViterbiFindsTheBestTailBitingStreamAndDecodesBitForBit) {
  for (const char* name : {"qtip_1mad_l8_k2", "qtip_3inst_l10_k3", "qtip_hyb_l9_k2",
                           "qtip_hyb_l10_k4", "qtip_1mad_l3_k2", "qtip_hyb_l5_k2"}) {
    auto cb = Make(name);
    const TrellisParams& p = cb->params();
    const int kv = p.k * p.V();
    // Whole tiles (T = 256) and a matrix's last, shorter tile (here 6 rows: T = 48).
    for (int T : {kT, 48}) {
      for (uint64_t seed : {1u, 2u, 3u}) {
        std::vector<float> x = Gaussian(T, seed, cb->default_scale());
        std::vector<uint32_t> stream(T * p.k / 8, 0);
        std::vector<float> out(T), dec(T);
        const double e = cb->EncodeSequence(x.data(), T, stream.data(), out.data());
        cb->DecodeSequence(stream.data(), T, dec.data());
        for (uint32_t w : stream) ASSERT_LT(w, 256u);
        for (int i = 0; i < T; ++i) ASSERT_EQ(dec[i], out[i]) << name << " weight " << i;
        double check = 0;
        for (int i = 0; i < T; ++i) check += (double(out[i]) - x[i]) * (double(out[i]) - x[i]);
        EXPECT_NEAR(e, check, 1e-9 * check);
        const uint32_t overlap = Bits(stream.data(), T * p.k - (p.L - kv), p.L - kv);
        const double best = BestTailBitingError(*cb, x.data(), T, overlap);
        EXPECT_NEAR(e, best, 1e-4 * best) << name << " T " << T << " seed " << seed;
      }
    }
  }
}

// The Viterbi pass at every width this CPU runs (AVX-512F 16 lanes, AVX2 8, the baseline 4;
// kernels/trellis_pass.h) codes every name the same, bit for bit: the same streams and errors
// for all three codes at 2, 3 and 4 bits, at L = 16 and at widths whose lanes span several
// predecessor groups (J < W) or exactly fill the groups (2^(L − kV) = W).
TEST(TrellisTest, EveryVectorWidthCodesTheSameBits) {
  const std::vector<int> lanes = TrellisLanes();
  ASSERT_FALSE(lanes.empty());
  EXPECT_EQ(lanes.back(), 4);
  std::string widths;
  for (int w : lanes) widths += " " + std::to_string(w);
  std::printf("Viterbi widths on this CPU:%s lanes\n", widths.c_str());
  if (lanes.size() == 1) std::printf("only the 4-lane pass runs here: nothing wider to compare\n");
  int compared = 0;
  for (const char* name :
       {"qtip_1mad_l16_k2", "qtip_1mad_l16_k3", "qtip_1mad_l16_k4", "qtip_3inst_l16_k2",
        "qtip_hyb_l16_k2", "qtip_hyb_l16_k3", "qtip_hyb_l16_k4", "qtip_1mad_l6_k2",
        "qtip_hyb_l8_k2", "qtip_3inst_l7_k3", "qtip_hyb_l12_k4"}) {
    auto p = ParseTrellisName(name);
    ASSERT_TRUE(p.ok()) << p.status();
    p->lanes = 4;
    const TrellisCodebook base(*p);
    // 2 whole tiles and a last one of 6 rows.
    const int64_t rows = 2 * 32 + 6;
    const std::vector<float> x = Gaussian(rows * 8, 11, base.default_scale());
    std::vector<uint32_t> want(rows * p->k), got(rows * p->k);
    std::vector<float> want_out(x.size()), got_out(x.size());
    base.Quantize(x.data(), rows, want_out.data(), want.data());
    for (int w : lanes) {
      p->lanes = w;
      const TrellisCodebook wide(*p);
      const uint32_t groups = 1u << (p->L - p->k * p->V());
      if (groups < static_cast<uint32_t>(w)) {
        EXPECT_LT(wide.lanes(), w) << name;  // too few groups for w lanes: a narrower pass
        continue;
      }
      ASSERT_EQ(wide.lanes(), w) << name;
      wide.Quantize(x.data(), rows, got_out.data(), got.data());
      EXPECT_EQ(got, want) << name << " at " << w << " lanes";
      EXPECT_EQ(got_out, want_out) << name << " at " << w << " lanes";
      if (w != 4) ++compared;
    }
  }
  std::printf("%d (name, width) pairs compared with the 4-lane pass\n", compared);
  if (lanes.size() > 1) {
    EXPECT_GE(compared, 11);
  }
}

// The same at the level of one pass: every state's final cost and every back pointer of the
// wide passes equal the 4-lane pass's bit for bit (stronger than equal codes: a pass contracted
// to FMA, say, would differ here in the last bits yet mostly choose the same codes).
TEST(TrellisTest, EveryVectorWidthComputesTheSameCosts) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  namespace ti = trellis_internal;
  const std::vector<int> lanes = TrellisLanes();
  int compared = 0;
  for (const char* name : {"qtip_1mad_l16_k2", "qtip_3inst_l16_k3", "qtip_1mad_l16_k4",
                           "qtip_hyb_l16_k2", "qtip_hyb_l16_k3", "qtip_hyb_l16_k4"}) {
    auto p = ParseTrellisName(name);
    ASSERT_TRUE(p.ok()) << p.status();
    const TrellisCodebook cb(*p);
    const int V = p->V(), kv = p->k * V;
    const uint32_t n = 1u << p->L, M = n >> kv;
    std::vector<float> v0(n), v1(n);
    for (uint32_t s = 0; s < n; ++s) {
      v0[s] = cb.value(s)[0];
      v1[s] = V == 2 ? cb.value(s)[1] : 0.0f;
    }
    const std::vector<float> x = Gaussian(kT, 5, cb.default_scale());
    struct Run {
      std::vector<float> cost, next, best;
      std::vector<uint8_t> bp;
      std::vector<float> last;
    };
    auto run = [&](int w, int64_t overlap) {
      Run r{std::vector<float>(n), std::vector<float>(n), std::vector<float>(M + 16),
            std::vector<uint8_t>(static_cast<size_t>(kT / V) * M), {}};
      const ti::PassArgs a{v0.data(), v1.data(),   p->L,          x.data(),      kT,
                           overlap,   r.cost.data(), r.next.data(), r.best.data(), r.bp.data()};
      const float* last = w == 16  ? ti::PassW16(V, kv, a)
                          : w == 8 ? ti::PassW8(V, kv, a)
                                   : ti::DispatchPass<4>(V, kv, a);
      r.last.assign(last, last + n);
      return r;
    };
    for (int64_t overlap : {int64_t{-1}, int64_t{M / 3}}) {
      const Run base = run(4, overlap);
      for (int w : lanes) {
        if (w == 4) continue;
        const Run wide = run(w, overlap);
        ASSERT_EQ(0, std::memcmp(wide.last.data(), base.last.data(), n * sizeof(float)))
            << name << " at " << w << " lanes, overlap " << overlap;
        ASSERT_EQ(wide.bp, base.bp) << name << " at " << w << " lanes, overlap " << overlap;
        ++compared;
      }
    }
  }
  std::printf("%d (name, overlap, width) passes compared with the 4-lane pass\n", compared);
  if (lanes.size() == 1) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512F";
#else
  GTEST_SKIP() << "the wide Viterbi passes are built on x86-64 only";
#endif
}

TEST(TrellisTest, GaussianDistortionIsBelowTheLatticeCodebooks) {
  // bench/codebook_mse on N(0, 1): E8P 0.0913 (2 bits), RVQ E8P+E8 0.0295 (3), E8P+E8P 0.0084
  // (4); the rate-distortion bound is 4^-k. 16 tiles (4096 weights) at the default scale.
  struct Case {
    const char* name;
    double below;
  };
  for (const Case& c : {Case{"qtip_1mad_l16_k2", 0.080}, Case{"qtip_3inst_l16_k2", 0.080},
                        Case{"qtip_hyb_l16_k2", 0.080}, Case{"qtip_1mad_l16_k3", 0.021},
                        Case{"qtip_hyb_l16_k3", 0.022}, Case{"qtip_1mad_l16_k4", 0.0055}}) {
    auto cb = Make(c.name);
    const double s = cb->default_scale();
    std::vector<float> g = Gaussian(16 * kT, 7);
    std::vector<float> x(g.size()), out(g.size());
    for (size_t i = 0; i < g.size(); ++i) x[i] = static_cast<float>(g[i] * s);
    cb->Quantize(x.data(), 16 * 32, out.data(), nullptr);
    double mse = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const double d = out[i] / s - g[i];
      mse += d * d;
    }
    mse /= static_cast<double>(g.size());
    EXPECT_LT(mse, c.below) << c.name;
    EXPECT_GT(mse, std::pow(4.0, -cb->params().k)) << c.name << " beat the rate-distortion bound";
  }
}

// Random W [40, 48] (a whole 32-row tile and a last one of 8 rows) and SPD H: BlockLDLQ's codes
// decode (tile by tile, DecodeMatrix) to its Ŵ; with H = I it is nearest rounding, tile for tile;
// the refinement sweeps move whole tiles, keep codes and Ŵ consistent and never raise the loss.
TEST(TrellisTest, BlockLdlqCodesTilesAndTheSweepsMoveWholeTiles) {
  auto cb = Make("qtip_hyb_l10_k2");
  const int64_t m = 40, n = 48;
  std::vector<float> wf = Gaussian(m * n, 11);
  std::vector<double> w(wf.begin(), wf.end());
  std::vector<float> a = Gaussian(n * n, 12);
  std::vector<double> h(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t q = 0; q < n; ++q) s += double(a[i * n + q]) * a[j * n + q];
      h[i * n + j] = s / n + (i == j ? 0.1 : 0.0);
    }
  }
  VectorRoundingConfig vc;
  vc.scale = 1.0;
  vc.num_threads = 2;
  vc.refine_sweeps = 2;
  auto r = BlockLdlq(w.data(), m, n, h.data(), *cb, vc);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<float> dec(m * n);
  DecodeMatrix(*cb, r->codes.data(), m, n, dec.data());
  for (int64_t i = 0; i < m * n; ++i) ASSERT_EQ(r->w_hat[i], double(dec[i])) << i;
  EXPECT_LE(r->refine.loss_after, r->refine.loss_before);
  EXPECT_NEAR(r->refine.loss_after, ProxyLoss(w.data(), r->w_hat.data(), h.data(), m, n),
              1e-9 * r->refine.loss_after);
  vc.refine_sweeps = 0;
  auto plain = BlockLdlq(w.data(), m, n, h.data(), *cb, vc);
  ASSERT_TRUE(plain.ok());
  EXPECT_LT(ProxyLoss(w.data(), plain->w_hat.data(), h.data(), m, n),
            ProxyLoss(w.data(), NearestVectorRounding(w.data(), m, n, *cb, vc)->w_hat.data(),
                      h.data(), m, n));
  // Bits do not depend on the thread count.
  vc.num_threads = 1;
  auto one = BlockLdlq(w.data(), m, n, h.data(), *cb, vc);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->codes, plain->codes);
  // Progress: after each task of rows (32-row tiles here: 32, then the last 8), one call at a
  // time, rising to every row; on 2 threads too, and the bits do not change.
  for (int threads : {1, 2}) {
    vc.num_threads = threads;
    std::vector<int64_t> seen;
    vc.progress = [&seen, m](int64_t done, int64_t rows) {
      EXPECT_EQ(rows, m);
      seen.push_back(done);
    };
    auto watched = BlockLdlq(w.data(), m, n, h.data(), *cb, vc);
    vc.progress = nullptr;
    ASSERT_TRUE(watched.ok());
    EXPECT_EQ(watched->codes, plain->codes);
    ASSERT_EQ(seen.size(), 2u) << threads << " threads";
    EXPECT_LT(seen[0], seen[1]);
    EXPECT_EQ(seen.back(), m);
  }
  vc.num_threads = 1;

  std::vector<double> eye(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1.0;
  auto ldlq_eye = BlockLdlq(w.data(), m, n, eye.data(), *cb, vc);
  auto nearest = NearestVectorRounding(w.data(), m, n, *cb, vc);
  ASSERT_TRUE(ldlq_eye.ok() && nearest.ok());
  EXPECT_EQ(ldlq_eye->codes, nearest->codes);
  EXPECT_EQ(ldlq_eye->w_hat, nearest->w_hat);

  EXPECT_GT(r->refine.changed, 0);
  // A last tile of 1 row holds 8·2 = 16 code bits, fewer than L = 18 state bits: refused.
  auto l18 = Make("qtip_1mad_l18_k2");
  auto odd = BlockLdlq(w.data(), 33, n, h.data(), *l18, vc);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("last tile of 1 rows"), std::string::npos)
      << odd.status();
  EXPECT_TRUE(l18->CheckRows(34).ok());
}

}  // namespace
}  // namespace qcal::kernels
