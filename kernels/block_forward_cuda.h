// The calibration forward of one Llama decoder block on a CUDA device (the GPU counterpart of
// engine/model/llama.h's DecoderBlock::Forward without hooks), with each linear's input summed
// into exact device Hessians (kernels/hessian_cuda.h) where it is produced, so calibration
// activations stay on the device between the block's input and its output.
//
//   xn = RMSNorm(x)·w_in                      → Hessian qkv
//   q = xn W_qᵀ / √d, k = xn W_kᵀ, v = xn W_vᵀ; RoPE (half-split, the caller's cos/sin tables)
//   a = causal GQA attention(q, k, v)          → Hessian o   (query head h reads KV head h / rep)
//   h = x + a W_oᵀ
//   hn = RMSNorm(h)·w_post                     → Hessian gate_up
//   m = silu(hn W_gateᵀ) ⊙ (hn W_upᵀ)          → Hessian down
//   out = h + m W_downᵀ
//
// Linears run through cuBLAS: in fp32 (CUBLAS_PEDANTIC_MATH, no TF32: the CPU path's arithmetic
// up to summation order) or with bf16 weights and activations and fp32 accumulation on tensor
// cores (kBf16: a linear's input is rounded to bf16 before its product, and its Hessian is that of
// the bf16 values, whose products are exact in fp32). Each linear is one GEMM per sequence, all of
// the same shape, so a sequence's outputs do not depend on which sequences share its pass: the
// forward and its Hessians are the same bits for any chunking of the calibration set. RMSNorm, RoPE, SwiGLU and the residual adds
// are elementwise kernels in fp32. Attention is one tiled kernel: a thread block holds 8 queries
// of one head (a warp each) and streams the keys and values of their causal range through shared
// memory in tiles of 32, with an online softmax in fp32 (no [t, t] score matrix). head_dim at
// most 128 and even.
//
// No CUDA types in this header: streams are void* (a cudaStream_t; null = the default stream,
// which the Hessian accumulators use too). One object per stream; not thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/gpu_backend.h"  // BlockForwardShape, BlockForwardWeights, BlockForwardPrecision
#include "kernels/hessian_cuda.h"

namespace qcal::kernels {

class BlockForwardCuda {
 public:
  // Validates the shape and uploads the weights (converted to bf16 for kBf16) to the current
  // device. ResourceExhausted when they do not fit.
  static StatusOr<std::unique_ptr<BlockForwardCuda>> Create(const BlockForwardShape& shape,
                                                           const BlockForwardWeights& weights,
                                                           BlockForwardPrecision precision,
                                                           void* stream);
  ~BlockForwardCuda();
  BlockForwardCuda(const BlockForwardCuda&) = delete;
  BlockForwardCuda& operator=(const BlockForwardCuda&) = delete;

  // x, out: host fp32 [seqs, t, hidden]; cos, sin: host fp32 [t, head_dim], the RoPE tables of
  // positions 0..t-1 (engine/model/llama.h Rope). hessians[k] (HessianKind order qkv, o, gate_up,
  // down; each may be null), of dims hidden, heads·head_dim, hidden and intermediate, receive the
  // block's linear inputs. Synchronizes before returning.
  Status Forward(const float* x, int64_t seqs, int64_t t, const float* cos, const float* sin,
                 HessianAccumulatorCuda* const hessians[4], float* out);

  const BlockForwardShape& shape() const { return shape_; }
  BlockForwardPrecision precision() const { return precision_; }
  int64_t device_bytes() const;  // weights and work buffers held on the device now

 private:
  struct Impl;
  BlockForwardCuda(BlockForwardShape shape, BlockForwardPrecision precision, void* stream);
  BlockForwardShape shape_;
  BlockForwardPrecision precision_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qcal::kernels
