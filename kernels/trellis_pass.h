// The Viterbi pass of TrellisCodebook (kernels/trellis.h), written once over a vector width W and
// compiled per instruction set: W = 4 in trellis.cc (the baseline: SSE2 on x86-64, NEON on ARM),
// W = 8 in trellis_avx2.cc (-mavx2) and W = 16 in trellis_avx512.cc (-mavx512f), chosen at run
// time by TrellisCodebook. Every state is updated on its own lane with the same float operations
// in the same order (no FMA contraction: these files build with -ffp-contract=off), so every
// width finds the same costs, back pointers and states bit for bit (kernels_trellis_test checks
// it on this machine's instruction sets).
//
// Internal to qcal_kernels.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace qcal::kernels::trellis_internal {

// A pass's inputs and scratch. v0, v1: the states' first and second values, [2^L] each (v1 unused
// at V = 1). x: the T/V steps' V values. overlap < 0: unconstrained; otherwise the first state's
// top L − kV bits and the last state's low L − kV bits must equal it (the caller applies the
// latter). cost, next: [2^L]; best: [2^(L − kV)] plus 16 floats of padding; bp: [T/V,
// 2^(L − kV)] back pointers (the predecessor's top kV bits).
struct PassArgs {
  const float* v0;
  const float* v1;
  int L;
  const float* x;
  int T;
  int64_t overlap;
  float* cost;
  float* next;
  float* best;
  uint8_t* bp;
};

// The pass for one (V, k·V) at width W; returns the last step's costs (cost or next). Requires
// 2^(L − kV) >= W (the caller falls back to a narrower width or the scalar pass).
using PassFn = const float* (*)(int V, int KV, const PassArgs& a);

// The widths this build has for this CPU: 16 (AVX-512F), 8 (AVX2), 4 (always).
const float* PassW8(int V, int KV, const PassArgs& a);   // trellis_avx2.cc
const float* PassW16(int V, int KV, const PassArgs& a);  // trellis_avx512.cc

// Internal linkage for everything below: each file's instantiations carry its own instruction set
// and must never be merged with another file's by the linker.
namespace {

template <int W>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
  typedef uint8_t U8 __attribute__((vector_size(W)));
};

template <int W, int V, int KV>
const float* ViterbiPass(const PassArgs& a) {
  using F = typename Lanes<W>::F;
  using I = typename Lanes<W>::I;
  using U8 = typename Lanes<W>::U8;
  constexpr uint32_t J = 1u << KV;
  const int64_t S = a.T / V;
  const uint32_t n = 1u << a.L, M = n >> KV;
  float* cost = a.cost;
  float* next = a.next;
  // Lane q of a run of W states starting at a multiple of W has group (state >> KV) equal to the
  // run's first group plus q / J (when J < W).
  I lane_group;
  for (int q = 0; q < W; ++q) lane_group[q] = q >> KV;
  // dst[s] = add[s >> KV] + |c(s) − x_t|² over all states s, W at a time.
  auto step_error = [&](const float* xt, float* dst, const float* add) {
    const F x0 = F{} + xt[0];
    const F x1 = F{} + (V == 2 ? xt[1] : 0.0f);
    for (uint32_t s = 0; s < n; s += W) {
      F b = F{};
      if (add != nullptr) {
        if constexpr (J >= W) {
          b = F{} + add[s >> KV];
        } else {
#if defined(__clang__)
          for (int q = 0; q < W; ++q) b[q] = add[(s >> KV) + lane_group[q]];
#else
          F g;
          std::memcpy(&g, &add[s >> KV], sizeof(g));  // reads past M: best is padded
          b = __builtin_shuffle(g, lane_group);
#endif
        }
      }
      F v;
      std::memcpy(&v, &a.v0[s], sizeof(v));
      const F e0 = v - x0;
      F d = e0 * e0;
      if constexpr (V == 2) {
        std::memcpy(&v, &a.v1[s], sizeof(v));
        const F e1 = v - x1;
        d = d + e1 * e1;
      }
      const F r = b + d;
      std::memcpy(&dst[s], &r, sizeof(r));
    }
  };
  step_error(a.x, cost, nullptr);
  if (a.overlap >= 0) {  // start only from states whose top L − kV bits are the overlap
    for (uint32_t s = 0; s < n; ++s) {
      if ((s >> KV) != static_cast<uint32_t>(a.overlap)) {
        cost[s] = std::numeric_limits<float>::infinity();
      }
    }
  }
  for (int64_t t = 1; t < S; ++t) {
    // The predecessors of the states m·J + j (any j) are i·M + m (any i): keep the cheapest
    // (the first on ties).
    uint8_t* bp = &a.bp[t * M];
    for (uint32_t m = 0; m < M; m += W) {
      F b;
      std::memcpy(&b, &cost[m], sizeof(b));
      I arg = I{};
      for (uint32_t i = 1; i < J; ++i) {
        F c;
        std::memcpy(&c, &cost[i * M + m], sizeof(c));
        const I lt = c < b;  // all ones where strictly cheaper
        b = lt ? c : b;
        arg = lt ? (I{} + static_cast<int32_t>(i)) : arg;
      }
      std::memcpy(&a.best[m], &b, sizeof(b));
      const U8 arg8 = __builtin_convertvector(arg, U8);
      std::memcpy(&bp[m], &arg8, sizeof(arg8));
    }
    step_error(&a.x[t * V], next, a.best);
    float* const done = next;
    next = cost;
    cost = done;
  }
  return cost;
}

// The (V, kV) pairs of the three codes at k = 2, 3, 4.
template <int W>
const float* DispatchPass(int V, int KV, const PassArgs& a) {
  if (V == 1) {
    switch (KV) {
      case 2: return ViterbiPass<W, 1, 2>(a);
      case 3: return ViterbiPass<W, 1, 3>(a);
      default: return ViterbiPass<W, 1, 4>(a);
    }
  }
  switch (KV) {
    case 4: return ViterbiPass<W, 2, 4>(a);
    case 6: return ViterbiPass<W, 2, 6>(a);
    default: return ViterbiPass<W, 2, 8>(a);
  }
}

}  // namespace
}  // namespace qcal::kernels::trellis_internal
