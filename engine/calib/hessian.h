// Hessians of linear-layer inputs, H = E[x xᵀ] (QuIP# §2, GPTQ): the proxy loss
// tr((Ŵ − W) H (Ŵ − W)ᵀ) of a rounding is the expected squared output error of the layer.
//
// A decoder block has four distinct linear inputs: q/k/v share the attention input, o_proj reads
// the attention output, gate/up share the MLP input, down_proj reads silu(gate)·up. Collection
// wraps the block's linears in recorders for one pass over the calibration activations.
//
// Exact, order-independent accumulation. Each sequence's product P = xᵀx is computed in fp32
// (BLAS), then every entry is rounded once to a fixed-point integer q(p) = round(p · 2^F),
// F = kHessianFracBits = 50, and summed as 128-bit integers. Integer addition is associative, so
// the sum does not depend on how sequences are split across ranks or in which order partial sums
// are reduced: a 1-, 2- or 3-rank calibration gives the same bits (given the same per-sequence
// products, i.e. the same inputs and GEMM shapes; see calibration.h for the canonical chunks).
//
//  * What is stored: T = Σ_seq (q(P) + q(Pᵀ)) on the upper triangle (packed, row-major), i.e.
//    2^(F+1)·(S + Sᵀ)/2 — the symmetrised sum, so Mean() is exactly symmetric by construction.
//    For fp32 inputs only the upper triangle of each P is computed (tile by tile, P_ij = P_ji),
//    so each term is 2·q(P_ij); fp64 inputs and FromSum round both triangles.
//  * Resolution 2^-50 ≈ 8.9e-16 absolute per entry per sequence. Rounding is to nearest, ties to
//    even. An entry |p| ≤ 2^-51 ≈ 4.4e-16 contributes 0; relative to the fp32 product's own
//    rounding (2^-24 of the magnitude of the terms it sums) the fixed-point rounding is
//    negligible unless |p| < ~1e-8, and even then its absolute error (≤ 2^-51 per sequence) is
//    far below the damping added before any factorization (δ·mean(diag H), δ ~ 1e-2).
//  * Range: |T| < 2^127, i.e. |Σ p| < 2^76 ≈ 7.6e22 per entry — e.g. 10^4 sequences of 4096
//    tokens with activations of magnitude 4·10^7. Products of |p| ≥ 2^73 are refused. Anything
//    out of range is an OutOfRange error (never a silent wrap); callers name the block and input.
//  * fp64 views (sum(), Mean()) are derived from T deterministically: double(T) (round to
//    nearest) · 2^-(F+1) [/ count].
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "kernels/gpu_backend.h"
#include "kernels/hessian_fixed.h"
#include "engine/model/llama.h"

namespace qcal::calib {

class ExpertExchange;  // expert_parallel.h

// The fixed-point format and the CPU kernels that accumulate it live in kernels/ beside their
// reference and CUDA version (kernels/fixed_point.h, kernels/hessian_fixed.h).
using kernels::Fixed128;
using kernels::HessianRows;
using kernels::kHessianFracBits;
using kernels::kHessianStripRows;

// The band of rows that `rank` of `size` owns when a block's accumulators are sharded over the
// ranks (sharded calibration, calibration.h): whole strips of `strip_rows` rows, contiguous, cut
// so the ranks hold about the same number of packed entries (the triangle's rows shorten
// downwards, so the first band has the fewest rows). Deterministic; a rank may own no rows
// (begin == end) when there are fewer strips than ranks. The bands of all ranks tile [0, n).
HessianRows HessianBandForRank(int64_t n, int rank, int size,
                               int64_t strip_rows = kHessianStripRows);

// Sum of x xᵀ over rows and the number of rows, in exact fixed point. Not thread-safe.
//
// A band accumulator (Band) holds only the rows [rows.begin, rows.end) of T: the packed values
// from PackedIndex(begin, begin) on, exactly the values the whole accumulator holds there for the
// same inputs (the same GEMM pieces compute them), so the bands of all ranks, laid end to end,
// are the whole T. Sharded calibration gives each rank one band and every rank's inputs.
class HessianAccumulator {
 public:
  HessianAccumulator() : HessianAccumulator(0) {}
  explicit HessianAccumulator(int64_t n, int64_t strip_rows = kHessianStripRows);
  // Rows [rows.begin, rows.end) of an n-input Hessian. rows.begin must be a multiple of
  // strip_rows and rows.end one too, or n (InvalidArgument otherwise).
  static StatusOr<HessianAccumulator> Band(int64_t n, HessianRows rows,
                                           int64_t strip_rows = kHessianStripRows);
  // From an fp64 sum ([n, n], symmetrised and rounded to fixed point) and a row count: for
  // synthetic Hessians (benchmarks, tests). Not exact below 2^-50; OutOfRange when too large.
  static StatusOr<HessianAccumulator> FromSum(const at::Tensor& sum, int64_t count);
  // From the exact packed sums T (n(n+1)/2 values, see above) and a row count (cache files).
  static StatusOr<HessianAccumulator> FromFixed(int64_t n, std::vector<Fixed128> packed,
                                                int64_t count);

  // x: [..., n]; every row is one sample. Float inputs: xᵀx of each sequence (x [seqs, seq, n],
  // or all rows of a 2-D x as one sequence) in fp32, each entry rounded to fixed point; double
  // inputs: products in fp64, then rounded the same way (whole accumulators only). OutOfRange on
  // overflow or a non-finite product; the accumulator is then unusable.
  Status Add(const at::Tensor& x);
  // Adds another accumulator's sums (ranks, shards). InvalidArgument for another dimension or
  // band, OutOfRange on overflow (the accumulator is then unusable).
  Status Merge(const HessianAccumulator& other);

  int64_t dim() const { return n_; }
  int64_t count() const { return count_; }
  HessianRows rows() const { return rows_; }
  bool is_band() const { return rows_.begin != 0 || rows_.end != n_; }
  // The index in the whole packed triangle of packed()[0]: PackedIndex(rows().begin, rows().begin).
  int64_t packed_begin() const { return PackedIndex(rows_.begin, rows_.begin); }
  // T, packed upper triangle, row-major: entry (i, j), i <= j, at PackedIndex(i, j) (less
  // packed_begin() for a band).
  const std::vector<Fixed128>& packed() const { return packed_; }
  // Moves T out (for an in-place reduction), leaving the accumulator empty (dimension 0).
  std::vector<Fixed128> ReleasePacked();
  int64_t PackedIndex(int64_t i, int64_t j) const { return i * n_ - i * (i - 1) / 2 + (j - i); }
  // (S + Sᵀ)/2 in fp64 ([n, n], exactly symmetric), derived from T. Whole accumulators only (a
  // band throws: a caller bug).
  at::Tensor sum() const;
  // (S + Sᵀ) / (2 count) ([n, n] double, exactly symmetric); zeros when empty. Whole only.
  at::Tensor Mean() const;

  // For reductions over Comm::AllReduceSum(int64_t*): each value as 4 base-2^32 digits in int64
  // limbs (digits 0..2 in [0, 2^32), digit 3 signed), so summing the limbs of < 2^31 ranks cannot
  // overflow int64. Combine propagates carries; OutOfRange when the total leaves 128 bits.
  static void SplitDigits(const Fixed128* values, size_t n, int64_t* limbs);
  static Status CombineDigits(const int64_t* limbs, size_t n, Fixed128* values);

 private:
  int64_t n_;
  int64_t strip_rows_ = kHessianStripRows;
  HessianRows rows_;
  int64_t count_ = 0;
  std::vector<Fixed128> packed_;
};

enum class HessianKind { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
inline constexpr HessianKind kAllHessianKinds[] = {HessianKind::kQkv, HessianKind::kO,
                                                   HessianKind::kGateUp, HessianKind::kDown};
// "qkv", "o", "gate_up", "down"
const char* HessianKindName(HessianKind kind);
// Which Hessian a linear's input belongs to.
HessianKind HessianKindOf(model::LinearKind linear);

// A routed expert's two distinct linear inputs: gate/up read the block's normalised hidden
// state (Llama 4: scaled by the expert's router score), down_proj reads silu(gate)·up.
enum class ExpertInput { kGateUp = 0, kDown = 1 };
inline constexpr ExpertInput kExpertInputs[] = {ExpertInput::kGateUp, ExpertInput::kDown};
const char* ExpertInputName(ExpertInput input);  // "gate_up" / "down"

// Exact sums read from where they are stored rather than held in memory (a block's Hessian
// cache file, mapped: LoadBlockHessians(..., mapped = true)). Mean(kind) makes that kind's fp64
// mean from the stored sums, exactly as HessianAccumulator::Mean would from the same values.
class StoredHessianSums {
 public:
  virtual ~StoredHessianSums() = default;
  virtual int64_t dim(HessianKind kind) const = 0;
  virtual int64_t count(HessianKind kind) const = 0;
  virtual at::Tensor Mean(HessianKind kind) const = 0;
  // The same for routed expert `expert`'s input (a MoE block's file).
  virtual at::Tensor ExpertMean(int64_t expert, ExpertInput input) const = 0;
};

// One routed expert's Hessians (a MoE block, hf_config.h ModelFamily). What its accumulators
// sum depends on how the expert was calibrated:
//  * real routing (the default): the rows the router sends it, each sequence's rows one product;
//  * route_all (CalibrationOptions::moe_route_all, or the starved-expert rule of calibration.h):
//    every calibration token, as if the router had chosen it for every token (Llama 4: the input
//    scaled by the sigmoid of its own logit for that token), while the block's output keeps the
//    real routing.
// routed_tokens counts the tokens the router really chose it for either way (the report's tokens
// per expert); count() of its accumulators is the number of rows summed.
struct ExpertHessians {
  std::array<HessianAccumulator, 2> h;  // indexed by ExpertInput: [hidden], [intermediate]
  int64_t routed_tokens = 0;
  bool route_all = false;
  HessianAccumulator& at(ExpertInput i) { return h[static_cast<int>(i)]; }
  const HessianAccumulator& at(ExpertInput i) const { return h[static_cast<int>(i)]; }
};

// (S + Sᵀ)/2 in fp64 [n, n] from exact packed sums T (n(n+1)/2 values as HessianAccumulator
// stores them) at `packed`, which need not be aligned for Fixed128 (a mapped file's bytes).
at::Tensor SymmetricSumFromPacked(const void* packed, int64_t n);

struct BlockHessians {
  // The dense inputs. In a MoE block gate_up and down are the shared expert's (Llama 4), or empty
  // (dimension 0) without one (Mixtral).
  std::array<HessianAccumulator, 4> h;
  // A MoE block's routed experts, in order; empty for a dense block.
  std::vector<ExpertHessians> experts;
  // Which experts calibrate on every token (ExpertHessians). Empty: none; else one flag per
  // expert. ForwardCollectingHessians reads it and records it in experts[e].route_all.
  std::vector<bool> route_all;
  // Set by LoadBlockHessians(..., mapped = true): the sums stay in the cache file and a kind's
  // accumulator in h is empty (dimension 0): its mean is made from the file when asked for.
  std::shared_ptr<const StoredHessianSums> stored;
  // The fp64 mean of kind k from the accumulator, or from `stored` when the accumulator is
  // empty; undefined when neither has it.
  at::Tensor Mean(HessianKind k) const;
  // The same for routed expert `expert`'s input.
  at::Tensor ExpertMean(int64_t expert, ExpertInput input) const;
  // The rank's GPU backend the sums are collected on (ForwardCollectingHessians) and reduced on
  // (reduce.h AllReduceDeviceHessians); null: the CPU.
  kernels::GpuBackend* backend = nullptr;
  // The arithmetic of the device block forward's linears (CalibrationSpec::precision).
  kernels::BlockForwardPrecision forward_precision = kernels::BlockForwardPrecision::kFloat32;
  // With a GPU backend: the device's sums not yet merged into h (see ForwardCollectingHessians
  // and FlushDeviceHessians). Null otherwise. Shared by copies (flush before copying).
  std::array<std::shared_ptr<kernels::DeviceHessian>, 4> device;
  // With a GPU backend that runs the block forward: the block's weights on the device, uploaded
  // by the first ForwardCollectingHessians call of the block (keyed by its q_proj weights) and
  // kept until FlushDeviceHessians.
  std::shared_ptr<kernels::DeviceBlock> device_block;
  const void* device_block_key = nullptr;
  HessianAccumulator& at(HessianKind k) { return h[static_cast<int>(k)]; }
  const HessianAccumulator& at(HessianKind k) const { return h[static_cast<int>(k)]; }
};

// Merges the device's sums into the accumulators and releases them (a no-op without any).
Status FlushDeviceHessians(BlockHessians* hessians);

// The mean Hessians of a block task's linears, each kind's computed once when its first linear
// asks (kAllLinears order: q, k, v share one; gate, up share one) and dropped when the next
// kind is asked for; each accumulator is released once its mean exists. At a 70B shape the
// down_proj input's exact sums (6.6 GB) and its fp64 mean (6.6 GB) are then never both held
// with the other kinds' means. Not thread-safe.
class HessianMeans {
 public:
  explicit HessianMeans(BlockHessians* hessians) : h_(hessians) {}  // null: undefined means
  // [n, n] fp64 mean of the Hessian of `linear`'s input (undefined without Hessians).
  at::Tensor For(model::LinearKind linear);

 private:
  BlockHessians* h_;
  int current_ = -1;
  at::Tensor mean_;
};

// Runs x [num_seqs, seq, hidden] through `block` in chunks of `batch` sequences, accumulating the
// block's four input Hessians into *hessians (initialised to the right sizes when empty), and,
// for a MoE block, every routed expert's two (hessians->experts, ExpertHessians: each sequence's
// rows routed to the expert one product, so the sums do not depend on the ranks either), and
// returns the block's outputs [num_seqs, seq, hidden]. The block is left as it was. With
// hessians == nullptr it only runs the block (same chunks, same outputs). An overflow is
// OutOfRange naming the Hessian ("gate_up input: ...").
// With a GPU backend (hessians->backend, kernels/gpu_backend.h) the products are summed on the
// device. By default
// the device's sums are merged into *hessians before returning; with flush_device = false they
// stay on the device across calls (one device accumulator per kind for a whole block, instead
// of an allocation and a download of up to 6.6 GB per call) until FlushDeviceHessians, which
// the caller must then call before reading the accumulators. A MoE block runs on the CPU (the
// device block forward has no routed experts), its sums in the host accumulators.
StatusOr<at::Tensor> ForwardCollectingHessians(model::DecoderBlock& block, const at::Tensor& x,
                                               const model::Rope& rope, int64_t batch,
                                               BlockHessians* hessians, bool flush_device = true);

// ForwardCollectingHessians of a MoE block whose routed experts run through `exchange` on the
// ranks that own them (expert_parallel.h): the dense inputs' sums (attention, the shared expert)
// into *hessians as usual, the experts' rows to their owners, and this rank's experts' sums (of
// every rank's rows) into hessians->experts. x: one canonical chunk (at most `batch`
// sequences), so that every rank makes one exchange per step; an empty x only sizes the
// accumulators. exchange == nullptr: every expert here (what ForwardCollectingHessians does).
StatusOr<at::Tensor> ForwardCollectingMoeHessians(model::DecoderBlock& block, const at::Tensor& x,
                                                  const model::Rope& rope, int64_t batch,
                                                  BlockHessians* hessians,
                                                  ExpertExchange* exchange);

// A MoE block's real routing of x [num_seqs, seq, hidden] (the same chunks of `batch`
// sequences as ForwardCollectingHessians): how many tokens the router sends each expert, added
// to *tokens (resized to the block's experts when empty). Only attention and the router run:
// while it counts, the routed experts are not run (BlockHooks::run_experts returns zeros, so a
// block holding some of its experts counts too) and the shared expert's linears are stand-ins
// that return zeros (the block is restored on every path). The starved-expert rule's first pass
// (calibration.h).
Status CountRoutedTokens(model::DecoderBlock& block, const at::Tensor& x, const model::Rope& rope,
                         int64_t batch, std::vector<int64_t>* tokens);

// Runs x [num_seqs, seq, hidden] through `block` in the same chunks of `batch` sequences as
// ForwardCollectingHessians (same outputs) and, instead of summing products, returns the four
// distinct linear inputs: inputs->at(kind) = [num_seqs, seq, n] fp32 (kAllHessianKinds order).
// Sharded calibration gathers them from every rank and sums them into each rank's bands. The
// block is left as it was.
StatusOr<at::Tensor> ForwardCapturingInputs(model::DecoderBlock& block, const at::Tensor& x,
                                            const model::Rope& rope, int64_t batch,
                                            std::array<at::Tensor, 4>* inputs);

}  // namespace qcal::calib
