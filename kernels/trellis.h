// Trellis-coded quantization with QTIP's "bitshift" trellis (Tseng et al., NeurIPS 2024; §3).
//
// A sequence of T weights (T = 256, or fewer in a matrix's last tile) is coded as a circular
// bitstream of T·k bits (k bits per weight).
// The stream is read V weights at a time: step t (t = 0 .. T/V − 1) owns the kV bits
// [t·kV, (t+1)·kV), and its state is the L-bit window of the stream ending with them,
//
//     state_t = bits [(t+1)·kV − L, (t+1)·kV) of the stream, indices mod T·k, first bit = MSB,
//
// so state_t = ((state_{t−1} << kV) | symbol_t) mod 2^L and state_{−1} is the stream's last L
// bits ("tail-biting": no bits are spent on a start state). Step t decodes to the V values
// c(state_t) of a code, a function of the state alone:
//
//   1mad  (V = 1): x = (s·34038481 + 76625530) mod 2^32; c = (Σ bytes of x − 510) / 147.800537.
//   3inst (V = 1): x = (s·89226354 + 64248484) mod 2^32; r = (x & 0x8FFF8FFF) ^ 0x3B603B60;
//                  c = half(r >> 16) + half(r & 0xFFFF) (IEEE binary16 bit patterns, summed in
//                  fp32).
//   hyb   (V = 2): h = s·(s+1) mod 2^32; c = (±t[i][0], t[i][1]) with i = bits 6..14 of h
//                  (Q = 9 table bits) and the sign of the first value flipped when bit 15 of h is
//                  set; t is a 512-entry 2-D table fitted by Lloyd's k-means to 2^16 Gaussian
//                  pairs drawn from a fixed seed (kernels/trellis.cc), so it is computed, not stored.
//
// Encoding is exact Viterbi over the 2^L states per sequence with QTIP's tail-biting heuristic:
// one unconstrained Viterbi pass on the sequence rotated by T/2, whose state at the rotated
// position of step 0 fixes the L − kV bits shared by the last and first steps; then a second pass
// constrained to start and end consistently with them. The second pass is the minimum-distortion
// stream among those sharing that overlap. Cost per sequence: two passes of T/V steps over 2^L
// states (a few flops per state and step), memory (T/V)·2^(L−kV) bytes of back pointers.
//
// As a VectorCodebook (for BlockLDLQ, kernels/rounding.h) a sequence is a tile of up to 32 rows
// × 8 columns: dim() = 8 columns (the BlockLDLQ block, as E8P's) and joint_vectors() = 32
// consecutive rows, row-major within the tile. QTIP's reference uses 16 × 16 tiles (its kernel's
// layout); with 8 columns BlockLDLQ feeds back every 8 columns instead of every 16, which lowered
// the proxy loss on every stories260K linear (docs/results.md). A matrix whose rows are not a
// multiple of 32 ends each block column with a shorter tile (its rows × 8 weights, T·k >= L
// required: CheckRows). Vector i of a tile (its row i) holds stream bits [8k·i, 8k·(i+1)) as
// code_words() = k words of 8 bits, MSB first, so a tile's codes, vectors in order, are its
// stream.
//
// Thread-safety: immutable after construction; all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/codebook.h"

namespace qcal::kernels {

enum class TrellisCode { k1Mad, k3Inst, kHyb };

struct TrellisParams {
  TrellisCode code = TrellisCode::kHyb;
  int L = 16;  // state bits
  int k = 2;   // bits per weight
  // The Viterbi pass's vector width: 0 = the widest this CPU runs (TrellisLanes()); 4, 8 or 16
  // to ask for one (tests and benchmarks; a width this CPU lacks falls back as 0 does). Every
  // width finds the same codes bit for bit; it is not part of the name.
  int lanes = 0;
  int V() const { return code == TrellisCode::kHyb ? 2 : 1; }
};

// The Viterbi pass widths this build runs on this CPU, widest first: 16 (AVX-512F) and 8 (AVX2)
// on x86-64 when the CPU has them, and 4 (SSE2 / NEON) always.
std::vector<int> TrellisLanes();

// "qtip_<1mad|3inst|hyb>_l<L>_k<k>", e.g. "qtip_hyb_l16_k2". InvalidArgument (naming the
// problem) unless k is 2, 3 or 4 and kV < L <= 20.
StatusOr<TrellisParams> ParseTrellisName(const std::string& name);
std::string TrellisName(const TrellisParams& p);
const char* TrellisCodeName(TrellisCode code);

class TrellisCodebook final : public VectorCodebook {
 public:
  static constexpr int kTileRows = 32;
  static constexpr int kTileCols = 8;
  static constexpr int kSequence = kTileRows * kTileCols;  // T

  explicit TrellisCodebook(const TrellisParams& p);

  std::string name() const override { return TrellisName(p_); }
  int dim() const override { return kTileCols; }
  int code_words() const override { return p_.k; }
  int joint_vectors() const override { return kTileRows; }
  double bits_per_weight() const override { return p_.k; }
  // The multiplier for unit-RMS Gaussian input (bench/codebook_mse sweeps it; see trellis.cc).
  double default_scale() const override { return default_scale_; }
  // Whole tiles of 32 vectors, then a last tile of the count % 32 vectors left (CheckRows must
  // accept count; a caller bug aborts).
  Status CheckRows(int64_t rows) const override;
  void Quantize(const float* x, int64_t count, float* out, uint32_t* codes) const override;
  void Decode(const uint32_t* codes, int64_t count, float* out) const override;

  const TrellisParams& params() const { return p_; }
  // The Viterbi pass width in use: 16, 8 or 4 lanes, or 0 for the scalar pass (2^(L − kV) < 4).
  int lanes() const { return lanes_; }
  // The V values of state s (s < 2^L).
  const float* value(uint32_t s) const { return &values_[static_cast<size_t>(s) * p_.V()]; }

  // One sequence of T weights (T a multiple of 16, T·k >= L): the tail-biting Viterbi encoding.
  // stream: T·k/8 words of 8 bits; out (may be null): the decoded sequence. Returns the squared
  // error Σ (out − x)².
  double EncodeSequence(const float* x, int T, uint32_t* stream, float* out) const;
  // Decodes one sequence's stream (T·k/8 words) into T values.
  void DecodeSequence(const uint32_t* stream, int T, float* out) const;

 private:
  struct Workspace;
  void Prepare(Workspace& ws) const;
  double Encode(const float* x, int T, Workspace& ws, uint32_t* stream, float* out) const;
  // One Viterbi pass over T/V steps of x. overlap < 0: unconstrained; otherwise the first state's
  // top L − kV bits and the last state's low L − kV bits must equal it. states: [T/V].
  void Viterbi(const float* x, int T, int64_t overlap, Workspace& ws, uint32_t* states) const;

  TrellisParams p_;
  std::vector<float> values_;  // [2^L, V]
  std::vector<float> soa0_, soa1_;  // values_ by component: [2^L] each (soa1_ empty at V = 1)
  double default_scale_ = 1.0;
  int lanes_ = 0;
};

std::unique_ptr<VectorCodebook> MakeTrellisCodebook(const TrellisParams& p);

// The 2-D table of the hyb code ([512][2], row-major), fitted once per process.
const std::vector<float>& HybTable();

}  // namespace qcal::kernels
