#include "kernels/block_forward_cuda.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/cuda_util.cuh"

namespace qcal::kernels {
namespace {

cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr int kAttnWarps = 8;    // queries (one warp each) per thread block
constexpr int kAttnKeys = 32;    // keys per shared-memory tile: one per lane for the scores
constexpr int kMaxHeadDim = 128;
constexpr int kDimsPerLane = kMaxHeadDim / 32;
// Tokens per pass through the block: bounds the work buffers (at a 70B shape 16384 tokens of
// the 28672-wide MLP are 1.9 GB per fp32 buffer).
constexpr int64_t kMaxTokensPerPass = 16384;

// out = x · rsqrt(mean(x²) + eps) · w for each row of x [rows, n]; one block per row.
__global__ void RmsNormKernel(const float* x, const float* w, int64_t n, float eps, float* out) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < static_cast<int>(blockDim.x >> 5) ? part[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) part[0] = s;
  }
  __syncthreads();
  const float r = rsqrtf(part[0] / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[row * n + i] = xr[i] * r * w[i];
}

// x [rows, heads, d] with row = s·t + p: each head's x ← RoPE_p(scale · x) (half-split
// rotate_half: x·cos + rot(x)·sin, rot = (−x₂, x₁)); cos/sin [t, d].
__global__ void RopeKernel(float* x, int64_t rows, int64_t t, int heads, int d, float scale,
                           const float* cos, const float* sin) {
  const int half = d / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads * half) return;
  const int c = static_cast<int>(i % half);
  const int64_t rh = i / half;
  const int64_t p = (rh / heads) % t;
  float* v = x + rh * d;
  const float x1 = v[c] * scale, x2 = v[c + half] * scale;
  v[c] = x1 * cos[p * d + c] + (-x2) * sin[p * d + c];
  v[c + half] = x2 * cos[p * d + c + half] + x1 * sin[p * d + c + half];
}

// Causal grouped-query attention with an online softmax. q [seqs, t, H, d] (already scaled by
// 1/√d), k, v [seqs, t, KV, d], out [seqs, t, H, d]. Grid (⌈t / 8⌉, H, seqs), 8 warps: warp w
// owns query q0 + w; lane j scores key k0 + j of each 32-key tile; lane l accumulates the
// output dims l, l + 32, ...
__global__ void AttentionKernel(const float* q, const float* k, const float* v, float* out,
                                int64_t t, int heads, int kv_heads, int d) {
  extern __shared__ float smem[];
  float* ks = smem;                        // [32][d + 1] (padded: lanes read different rows)
  float* vs = ks + kAttnKeys * (d + 1);    // [32][d]
  float* qs = vs + kAttnKeys * d;          // [8][d]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t seq = blockIdx.z;
  const int h = blockIdx.y;
  const int g = h / (heads / kv_heads);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kAttnWarps;
  const int64_t qi = q0 + warp;
  const bool active = qi < t;
  const int64_t qrow = (seq * t + qi) * heads + h;
  if (active) {
    for (int c = lane; c < d; c += 32) qs[warp * d + c] = q[qrow * d + c];
  }
  float acc[kDimsPerLane];
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  const int64_t last = min(t - 1, q0 + kAttnWarps - 1);
  for (int64_t k0 = 0; k0 <= last; k0 += kAttnKeys) {
    __syncthreads();  // the previous tile is consumed; qs is written
    for (int e = threadIdx.x; e < kAttnKeys * d; e += blockDim.x) {
      const int j = e / d, c = e % d;
      const int64_t key = k0 + j;
      float kv = 0.f, vv = 0.f;
      if (key < t) {
        const int64_t r = ((seq * t + key) * kv_heads + g) * d + c;
        kv = k[r];
        vv = v[r];
      }
      ks[j * (d + 1) + c] = kv;
      vs[j * d + c] = vv;
    }
    __syncthreads();
    if (!active || k0 > qi) continue;  // warp-uniform
    const int64_t key = k0 + lane;
    const bool valid = key <= qi;
    float s = -INFINITY;
    if (valid) {
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += qs[warp * d + c] * ks[lane * (d + 1) + c];
      s = dot;
    }
    float mt = s;
    for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
    const float m_new = fmaxf(m, mt);  // finite: key k0 <= qi is in this tile
    const float corr = expf(m - m_new);
    const float p = valid ? expf(s - m_new) : 0.f;
    float ps = p;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * corr + ps;
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= corr;
    const int jmax = qi - k0 + 1 < kAttnKeys ? static_cast<int>(qi - k0 + 1) : kAttnKeys;
    for (int j = 0; j < jmax; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < d) acc[i] += pj * vs[j * d + c];
      }
    }
    m = m_new;
  }
  if (active) {
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < d) out[qrow * d + c] = acc[i] / l;
    }
  }
}

// g ← silu(g) ⊙ u.
__global__ void SwiGluKernel(float* g, const float* u, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float x = g[i];
  g[i] = x / (1.f + expf(-x)) * u[i];
}

// a ← a + b.
__global__ void AddKernel(float* a, const float* b, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) a[i] += b[i];
}

__global__ void ToBf16Kernel(const float* x, __nv_bfloat16* y, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] = __float2bfloat16_rn(x[i]);
}

}  // namespace

struct BlockForwardCuda::Impl {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  DevicePtr<float> input_norm, post_norm;
  DevicePtr<void> w[7];  // fp32 or bf16 [out, in]
  int64_t out_features[7] = {}, in_features[7] = {};
  // Work buffers for `capacity` tokens.
  int64_t capacity = 0;
  DevicePtr<float> x, xn, q, kk, vv, attn, h, tmp, gate, up;
  DevicePtr<__nv_bfloat16> xb;  // a linear's input in bf16 (kBf16)
  int64_t bytes = 0;
  ~Impl() {
    if (cublas != nullptr) cublasDestroy(cublas);
  }
};

BlockForwardCuda::BlockForwardCuda(BlockForwardShape shape, BlockForwardPrecision precision,
                                   void* stream)
    : shape_(shape), precision_(precision), impl_(std::make_unique<Impl>()) {
  impl_->stream = AsStream(stream);
}

BlockForwardCuda::~BlockForwardCuda() = default;

int64_t BlockForwardCuda::device_bytes() const { return impl_->bytes; }

StatusOr<std::unique_ptr<BlockForwardCuda>> BlockForwardCuda::Create(
    const BlockForwardShape& shape, const BlockForwardWeights& weights,
    BlockForwardPrecision precision, void* stream) {
  QCAL_RETURN_IF_ERROR(CheckBlockForwardShape(shape));
  if (weights.input_norm == nullptr || weights.post_norm == nullptr) {
    return absl::InvalidArgumentError("block forward: null norm weights");
  }
  std::unique_ptr<BlockForwardCuda> b(new BlockForwardCuda(shape, precision, stream));
  Impl& im = *b->impl_;
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasCreate(&im.cublas));
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetStream(im.cublas, im.stream));
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(
      im.cublas, precision == BlockForwardPrecision::kFloat32 ? CUBLAS_PEDANTIC_MATH
                                                              : CUBLAS_DEFAULT_MATH));
  const int64_t hd = shape.heads * shape.head_dim, kvd = shape.kv_heads * shape.head_dim;
  const int64_t outs[7] = {hd, kvd, kvd, shape.hidden, shape.intermediate, shape.intermediate,
                           shape.hidden};
  const int64_t ins[7] = {shape.hidden, shape.hidden, shape.hidden, hd,
                          shape.hidden, shape.hidden, shape.intermediate};
  const int64_t n = shape.hidden;
  QCAL_ASSIGN_OR_RETURN(im.input_norm, Alloc<float>(n));
  QCAL_ASSIGN_OR_RETURN(im.post_norm, Alloc<float>(n));
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(im.input_norm.get(), weights.input_norm, n * 4,
                                       cudaMemcpyHostToDevice));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(im.post_norm.get(), weights.post_norm, n * 4, cudaMemcpyHostToDevice));
  im.bytes = 2 * n * 4;
  DevicePtr<float> staging;  // fp32 upload buffer for the bf16 conversion
  for (int k = 0; k < 7; ++k) {
    if (weights.linears[k] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("block forward: null weights of linear ", k));
    }
    im.out_features[k] = outs[k];
    im.in_features[k] = ins[k];
    const int64_t count = outs[k] * ins[k];
    if (precision == BlockForwardPrecision::kFloat32) {
      QCAL_ASSIGN_OR_RETURN(DevicePtr<float> w, Alloc<float>(count));
      QCAL_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(w.get(), weights.linears[k], count * 4, cudaMemcpyHostToDevice));
      im.w[k].reset(w.release());
      im.bytes += count * 4;
    } else {
      QCAL_ASSIGN_OR_RETURN(DevicePtr<__nv_bfloat16> w, Alloc<__nv_bfloat16>(count));
      QCAL_ASSIGN_OR_RETURN(staging, Alloc<float>(count));
      QCAL_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(staging.get(), weights.linears[k], count * 4, cudaMemcpyHostToDevice));
      ToBf16Kernel<<<Blocks(count, 256), 256, 0, im.stream>>>(staging.get(), w.get(), count);
      QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(im.stream));
      staging.reset();
      im.w[k].reset(w.release());
      im.bytes += count * 2;
    }
  }
  return b;
}

namespace {

// y [seqs·t, out] = x [seqs·t, in] · Wᵀ, W [out, in] row-major (column-major: y is [out, rows]),
// one GEMM of the same shape (out × t × in) per sequence. cuBLAS picks its kernel (tiles, split-K)
// by the problem's shape, so a single GEMM over all the pass's rows would sum a row's products in
// an order that depends on how many sequences share the pass; per sequence, every row of every
// chunking goes through the same kernel and gets the same bits (batch invariance: the forward,
// and the Hessians of its outputs, do not depend on the calibration batch or on the ranks).
Status LinearForward(cublasHandle_t handle, BlockForwardPrecision precision, const void* w,
                     int64_t out, int64_t in, const void* x, int64_t seqs, int64_t t, float* y) {
  const float one = 1.f, zero = 0.f;
  const int o = static_cast<int>(out), r = static_cast<int>(t), i = static_cast<int>(in);
  for (int64_t q = 0; q < seqs; ++q) {
    float* yq = y + q * t * out;
    if (precision == BlockForwardPrecision::kFloat32) {
      const float* xq = static_cast<const float*>(x) + q * t * in;
      QCAL_CUBLAS_RETURN_IF_ERROR(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, o, r, i, &one,
                                              static_cast<const float*>(w), i, xq, i, &zero, yq,
                                              o));
    } else {
      const __nv_bfloat16* xq = static_cast<const __nv_bfloat16*>(x) + q * t * in;
      QCAL_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, o, r, i, &one, w,
                                               CUDA_R_16BF, i, xq, CUDA_R_16BF, i, &zero, yq,
                                               CUDA_R_32F, o, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status BlockForwardCuda::Forward(const float* x, int64_t seqs, int64_t t, const float* cos,
                                 const float* sin, HessianAccumulatorCuda* const hessians[4],
                                 float* out) {
  const BlockForwardShape& s = shape_;
  if (seqs < 0 || t < 1 || x == nullptr || out == nullptr || cos == nullptr || sin == nullptr) {
    return absl::InvalidArgumentError("block forward: bad inputs");
  }
  const int64_t dims[4] = {s.hidden, s.heads * s.head_dim, s.hidden, s.intermediate};
  for (int k = 0; k < 4; ++k) {
    if (hessians[k] != nullptr && hessians[k]->dim() != dims[k]) {
      return absl::InvalidArgumentError(absl::StrCat("block forward: Hessian ", k, " has dim ",
                                                     hessians[k]->dim(), ", expected ", dims[k]));
    }
  }
  if (seqs == 0) return absl::OkStatus();
  Impl& im = *impl_;
  const int64_t per_pass = std::max<int64_t>(1, kMaxTokensPerPass / t);
  const int64_t tokens = std::min(seqs, per_pass) * t;
  const int64_t hd = s.heads * s.head_dim, kvd = s.kv_heads * s.head_dim;
  if (tokens > im.capacity) {
    im.capacity = 0;
    QCAL_ASSIGN_OR_RETURN(im.x, Alloc<float>(tokens * s.hidden));
    QCAL_ASSIGN_OR_RETURN(im.xn, Alloc<float>(tokens * s.hidden));
    QCAL_ASSIGN_OR_RETURN(im.q, Alloc<float>(tokens * hd));
    QCAL_ASSIGN_OR_RETURN(im.kk, Alloc<float>(tokens * kvd));
    QCAL_ASSIGN_OR_RETURN(im.vv, Alloc<float>(tokens * kvd));
    QCAL_ASSIGN_OR_RETURN(im.attn, Alloc<float>(tokens * hd));
    QCAL_ASSIGN_OR_RETURN(im.h, Alloc<float>(tokens * s.hidden));
    QCAL_ASSIGN_OR_RETURN(im.tmp, Alloc<float>(tokens * s.hidden));
    QCAL_ASSIGN_OR_RETURN(im.gate, Alloc<float>(tokens * s.intermediate));
    QCAL_ASSIGN_OR_RETURN(im.up, Alloc<float>(tokens * s.intermediate));
    const int64_t widest = std::max({s.hidden, hd, s.intermediate});
    if (precision_ == BlockForwardPrecision::kBf16) {
      QCAL_ASSIGN_OR_RETURN(im.xb, Alloc<__nv_bfloat16>(tokens * widest));
    }
    im.capacity = tokens;
  }
  QCAL_ASSIGN_OR_RETURN(DevicePtr<float> cos_d, Alloc<float>(t * s.head_dim));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<float> sin_d, Alloc<float>(t * s.head_dim));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(cos_d.get(), cos, t * s.head_dim * 4, cudaMemcpyHostToDevice));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(sin_d.get(), sin, t * s.head_dim * 4, cudaMemcpyHostToDevice));
  const bool bf16 = precision_ == BlockForwardPrecision::kBf16;
  const HessianInputType htype = bf16 ? HessianInputType::kBf16 : HessianInputType::kFloat32;
  cudaStream_t st = im.stream;

  for (int64_t s0 = 0; s0 < seqs; s0 += per_pass) {
    const int64_t ns = std::min(per_pass, seqs - s0), rows = ns * t;
    // A linear's input as the GEMM reads it (bf16 copy or the fp32 buffer itself), and its tap.
    auto input = [&](const float* a, int64_t width, int kind) -> StatusOr<const void*> {
      const void* in = a;
      if (bf16) {
        ToBf16Kernel<<<Blocks(rows * width, 256), 256, 0, st>>>(a, im.xb.get(), rows * width);
        QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        in = im.xb.get();
      }
      if (kind >= 0 && hessians[kind] != nullptr) {
        QCAL_RETURN_IF_ERROR(hessians[kind]->Add(in, htype, ns, t));
      }
      return in;
    };
    auto linear = [&](int k, const void* in, float* y) {
      return LinearForward(im.cublas, precision_, im.w[k].get(), im.out_features[k],
                           im.in_features[k], in, ns, t, y);
    };
    QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.x.get(), x + s0 * t * s.hidden,
                                              rows * s.hidden * 4, cudaMemcpyHostToDevice, st));
    // Attention half.
    RmsNormKernel<<<static_cast<unsigned>(rows), 256, 0, st>>>(
        im.x.get(), im.input_norm.get(), s.hidden, static_cast<float>(s.rms_eps), im.xn.get());
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    QCAL_ASSIGN_OR_RETURN(const void* xin, input(im.xn.get(), s.hidden, 0));
    QCAL_RETURN_IF_ERROR(linear(0, xin, im.q.get()));
    QCAL_RETURN_IF_ERROR(linear(1, xin, im.kk.get()));
    QCAL_RETURN_IF_ERROR(linear(2, xin, im.vv.get()));
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    const int half = static_cast<int>(s.head_dim / 2);
    RopeKernel<<<Blocks(rows * s.heads * half, 256), 256, 0, st>>>(
        im.q.get(), rows, t, static_cast<int>(s.heads), static_cast<int>(s.head_dim), scale,
        cos_d.get(), sin_d.get());
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    RopeKernel<<<Blocks(rows * s.kv_heads * half, 256), 256, 0, st>>>(
        im.kk.get(), rows, t, static_cast<int>(s.kv_heads), static_cast<int>(s.head_dim), 1.f,
        cos_d.get(), sin_d.get());
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid(static_cast<unsigned>((t + kAttnWarps - 1) / kAttnWarps),
                    static_cast<unsigned>(s.heads), static_cast<unsigned>(ns));
    const size_t smem = (kAttnKeys * (s.head_dim + 1) + kAttnKeys * s.head_dim +
                         kAttnWarps * s.head_dim) * sizeof(float);
    AttentionKernel<<<grid, kAttnWarps * 32, smem, st>>>(
        im.q.get(), im.kk.get(), im.vv.get(), im.attn.get(), t, static_cast<int>(s.heads),
        static_cast<int>(s.kv_heads), static_cast<int>(s.head_dim));
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    QCAL_ASSIGN_OR_RETURN(const void* ain, input(im.attn.get(), hd, 1));
    QCAL_RETURN_IF_ERROR(linear(3, ain, im.tmp.get()));
    QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(im.h.get(), im.x.get(), rows * s.hidden * 4,
                                              cudaMemcpyDeviceToDevice, st));
    AddKernel<<<Blocks(rows * s.hidden, 256), 256, 0, st>>>(im.h.get(), im.tmp.get(),
                                                            rows * s.hidden);
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    // MLP half.
    RmsNormKernel<<<static_cast<unsigned>(rows), 256, 0, st>>>(
        im.h.get(), im.post_norm.get(), s.hidden, static_cast<float>(s.rms_eps), im.xn.get());
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    QCAL_ASSIGN_OR_RETURN(const void* hin, input(im.xn.get(), s.hidden, 2));
    QCAL_RETURN_IF_ERROR(linear(4, hin, im.gate.get()));
    QCAL_RETURN_IF_ERROR(linear(5, hin, im.up.get()));
    SwiGluKernel<<<Blocks(rows * s.intermediate, 256), 256, 0, st>>>(
        im.gate.get(), im.up.get(), rows * s.intermediate);
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    QCAL_ASSIGN_OR_RETURN(const void* mlp_in, input(im.gate.get(), s.intermediate, 3));
    QCAL_RETURN_IF_ERROR(linear(6, mlp_in, im.tmp.get()));
    AddKernel<<<Blocks(rows * s.hidden, 256), 256, 0, st>>>(im.h.get(), im.tmp.get(),
                                                            rows * s.hidden);
    QCAL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + s0 * t * s.hidden, im.h.get(),
                                              rows * s.hidden * 4, cudaMemcpyDeviceToHost, st));
    // The next pass overwrites the buffers the Hessians read; they read on the same stream.
  }
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  for (int k = 0; k < 4; ++k) {
    if (hessians[k] != nullptr) QCAL_RETURN_IF_ERROR(hessians[k]->Sync());
  }
  return absl::OkStatus();
}

}  // namespace qcal::kernels
