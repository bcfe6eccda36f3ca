// Hessians of linear-layer inputs, H = E[x xᵀ], accumulated in fp64 (QuIP# §2, GPTQ): the proxy
// loss tr((Ŵ − W) H (Ŵ − W)ᵀ) of a rounding is the expected squared output error of the layer.
//
// A decoder block has four distinct linear inputs: q/k/v share the attention input, o_proj reads
// the attention output, gate/up share the MLP input, down_proj reads silu(gate)·up. Collection
// wraps the block's linears in recorders for one pass over the calibration activations.
#pragma once

#include <array>
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "worker/model/llama.h"

namespace qcal::calib {

// Sum of x xᵀ over rows and the number of rows, in fp64. Not thread-safe.
class HessianAccumulator {
 public:
  HessianAccumulator() : HessianAccumulator(0) {}
  explicit HessianAccumulator(int64_t n);
  // From stored sums ([n, n] double) and a row count (a cache or another rank's contribution).
  static HessianAccumulator FromSum(at::Tensor sum, int64_t count);
  // x: [..., n]; every row is one sample. Float inputs: x xᵀ of each sequence (x [seqs, seq, n],
  // or all rows of a 2-D x) in fp32, summed in fp64; double inputs: fp64 throughout.
  void Add(const at::Tensor& x);
  // Adds another accumulator's sums (reduction across data-parallel ranks or shards).
  void Merge(const HessianAccumulator& other);
  int64_t dim() const { return n_; }
  int64_t count() const { return count_; }
  const at::Tensor& sum() const { return sum_; }  // [n, n] double
  // (sum + sumᵀ) / (2 count) ([n, n] double, exactly symmetric); zeros when empty.
  at::Tensor Mean() const;

 private:
  int64_t n_;
  int64_t count_ = 0;
  at::Tensor sum_;
};

enum class HessianKind { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
inline constexpr HessianKind kAllHessianKinds[] = {HessianKind::kQkv, HessianKind::kO,
                                                   HessianKind::kGateUp, HessianKind::kDown};
// "qkv", "o", "gate_up", "down"
const char* HessianKindName(HessianKind kind);
// Which Hessian a linear's input belongs to.
HessianKind HessianKindOf(model::LinearKind linear);

struct BlockHessians {
  std::array<HessianAccumulator, 4> h;
  HessianAccumulator& at(HessianKind k) { return h[static_cast<int>(k)]; }
  const HessianAccumulator& at(HessianKind k) const { return h[static_cast<int>(k)]; }
};

// Runs x [num_seqs, seq, hidden] through `block` in chunks of `batch` sequences, accumulating the
// block's four input Hessians into *hessians (initialised to the right sizes when empty), and
// returns the block's outputs [num_seqs, seq, hidden]. The block is left as it was.
StatusOr<at::Tensor> ForwardCollectingHessians(model::DecoderBlock& block, const at::Tensor& x,
                                               const model::Rope& rope, int64_t batch,
                                               BlockHessians* hessians);

}  // namespace qcal::calib
