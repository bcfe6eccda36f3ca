// BlockLDLQ (E8P) and the g-block LDL on the GPU (kernels/ldlq_cuda.h).
#include "kernels/ldlq_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/cuda_util.cuh"
#include "kernels/e8p_device.cuh"
#include "kernels/linalg_cuda.h"

namespace qcal::kernels {
namespace {

constexpr int kG = 8;  // E8P's dimension



// The diagonal g×g blocks of C' (lower triangular), copied out: diag[b][k][t] = C'[b·g+k][b·g+t].
__global__ void CopyDiagonalBlocksKernel(const double* c, int64_t n, double* diag) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n * kG) return;
  const int64_t b = e / (kG * kG), k = (e / kG) % kG, t = e % kG;
  diag[e] = c[(b * kG + k) * n + b * kG + t];
}

// L'[i][b-block] = C'[i][b-block] · inv(C'_b) for rows i ≥ (b+1)·g, in place, and the diagonal
// blocks set to exactly I (as the CPU's construction gives). One thread per (i, b).
__global__ void BlockScaleKernel(double* c, int64_t n, const double* diag) {
  const int64_t b = blockIdx.y;
  const int64_t b0 = b * kG;
  const int64_t i = b0 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (i < b0 + kG) {
    for (int k = 0; k < kG; ++k) c[i * n + b0 + k] = (i - b0 == k) ? 1.0 : 0.0;
    return;
  }
  const double* cb = diag + b * kG * kG;  // cb[k·g + t] = C'_b[k][t]
  // x · C_b = row (solve from the right): x_k = (row_k − Σ_{t>k} x_t C_b[t][k]) / C_b[k][k].
  double row[kG], x[kG];
  for (int k = 0; k < kG; ++k) row[k] = c[i * n + b0 + k];
  for (int k = kG - 1; k >= 0; --k) {
    double acc = row[k];
    for (int t = k + 1; t < kG; ++t) acc -= x[t] * cb[t * kG + k];
    x[k] = acc / cb[k * kG + k];
  }
  for (int k = 0; k < kG; ++k) c[i * n + b0 + k] = x[k];
}

// a[i][j] <-> a[n−1−j][n−1−i]: the reflection across the anti-diagonal (P Aᵀ P).
__global__ void AntiTransposeKernel(double* a, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (i >= n || j >= n || i + j >= n - 1) return;  // each pair once; the anti-diagonal stays
  const int64_t e = i * n + j, f = (n - 1 - j) * n + (n - 1 - i);
  const double t = a[e];
  a[e] = a[f];
  a[f] = t;
}

// Dead columns (diagonal 0 → 1) and damping (+add on the diagonal).
__global__ void FixDiagonalKernel(double* h, int64_t n, const unsigned char* dead, double add) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  double d = h[i * n + i];
  if (dead[i]) d = 1.0;
  h[i * n + i] = d + add;
}

// Lf (fp32, column-major n×n: Lf[k·n + j] = L[j][k]) from L (fp64 row-major), only k < j.
__global__ void LowerToFloatKernel(const double* l, float* lf, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t k = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (j >= n || k >= n) return;
  lf[k * n + j] = k < j ? static_cast<float>(l[j * n + k]) : 0.0f;
}

// One lazy block [b0, b1) of every row: X (column-major m×n, X[j·m + r]) holds the targets with
// all feedback from earlier lazy blocks; W (same layout) the weights. Each thread takes one row
// through the block's 8-column groups: encode float(x / scale), store the code, replace the
// targets by the errors E = float(W − scale·point) and feed them forward inside the block:
// X[r, k+8:b1] += E[r, k:k+8] · U[k:k+8, k+8:b1], U[t][j] = L[j][t] = Lf[t·n + j].
__global__ void InBlockKernel(float* x, const double* w_t, const float* lf, int64_t m, int64_t n,
                              int64_t b0, int64_t b1, double scale, uint32_t* codes) {
  __shared__ E8pTables tables;
  LoadE8pTables(&tables);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= m) return;
  for (int64_t k = b0; k < b1; k += kG) {
    float in[kG], out[kG], e[kG];
    for (int j = 0; j < kG; ++j) {
      in[j] = static_cast<float>(__ddiv_rn(static_cast<double>(x[(k + j) * m + r]), scale));
    }
    const uint32_t code = EncodeOne(tables, in);
    codes[r * (n / kG) + k / kG] = code;
    DecodeE8p(tables, code, out);
    for (int j = 0; j < kG; ++j) {
      const double q = __dmul_rn(scale, static_cast<double>(out[j]));
      e[j] = static_cast<float>(__dsub_rn(w_t[(k + j) * m + r], q));
      x[(k + j) * m + r] = e[j];
    }
    for (int64_t j = k + kG; j < b1; ++j) {
      float s = x[j * m + r];
      for (int t = 0; t < kG; ++t) s = fmaf(e[t], __ldg(&lf[(k + t) * n + j]), s);
      x[j * m + r] = s;
    }
  }
}

__global__ void ToFloatKernel(const double* a, float* b, int64_t count) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < count) b[e] = static_cast<float>(a[e]);
}


}  // namespace

Status BlockLdlCuda(double* h, int64_t n, int64_t g, void* stream) {
  if (g != kG) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockLdlCuda: only blocks of ", kG, " are implemented (got ", g, ")"));
  }
  if (n <= 0 || n % g != 0 || h == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BlockLdlCuda: n = ", n, " must be a positive multiple of the block ", g));
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // P H P = C' C'ᵀ, L' = C' blockdiag(C'_b)⁻¹, L = P L'ᵀ P (linalg.h's construction).
  Rotate180Kernel<<<Blocks(n * n / 2, 256), 256, 0, s>>>(h, n * n);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("Rotate180Kernel");
  Status chol = CholeskyCuda(h, n, stream);
  if (!chol.ok()) {
    // Pivots are counted in the reversed order: name the original index.
    if (chol.code() == absl::StatusCode::kFailedPrecondition) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block LDL: the matrix (n = ", n, ") is not positive definite (", chol.message(),
          ", in reversed order: original index n-1-pivot); damp the Hessian more"));
    }
    return chol;
  }
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> diag, Alloc<double>(n * g));
  CopyDiagonalBlocksKernel<<<Blocks(n * g, 256), 256, 0, s>>>(h, n, diag.get());
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("CopyDiagonalBlocksKernel");
  const dim3 scale_blocks(Blocks(n, 128), static_cast<unsigned>(n / g));
  BlockScaleKernel<<<scale_blocks, 128, 0, s>>>(h, n, diag.get());
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("BlockScaleKernel");
  const dim3 threads(32, 8);
  const dim3 blocks(Blocks(n, 32), Blocks(n, 8));
  AntiTransposeKernel<<<blocks, threads, 0, s>>>(h, n);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("AntiTransposeKernel");
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

StatusOr<VectorRoundingResult> BlockLdlqE8pCuda(const double* w, int64_t m, int64_t n,
                                                const double* h,
                                                const VectorRoundingConfig& config, void* stream,
                                                BlockLdlqCudaTimes* times) {
  const char* what = "block ldlq (cuda)";
  if (m <= 0 || n <= 0 || w == nullptr || h == nullptr || n % kG != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": need rows > 0 and cols a positive multiple of 8, got ", m, " x ", n));
  }
  if (config.refine_sweeps != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": refinement sweeps run on the CPU"));
  }
  if (!(config.damp >= 0.0) || !std::isfinite(config.damp)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": damp = ", config.damp, " must be >= 0"));
  }
  for (int64_t i = 0; i < m * n; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": non-finite weight at row ", i / n,
                                                     ", column ", i % n));
    }
  }
  BlockLdlqCudaTimes t{};
  auto t0 = std::chrono::steady_clock::now();
  double scale = config.scale;
  if (scale == 0.0) {  // ResolveScale (rounding.cc): RMS(W) / 1.03
    double s = 0.0;
    for (int64_t i = 0; i < m * n; ++i) s += w[i] * w[i];
    const double rms = std::sqrt(s / static_cast<double>(m * n));
    scale = rms > 0.0 ? rms / E8pCodebook::kDefaultScale : 1.0;
  }
  if (!(scale > 0.0) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": scale = ", scale, " must be positive and finite"));
  }
  // Dead columns and the damping amount, as Prepare + DampHessian compute them.
  std::vector<unsigned char> dead(n, 0);
  double mean = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = h[i * n + i];
    if (!std::isfinite(d)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": non-finite Hessian diagonal ", i));
    }
    dead[i] = d == 0.0;
    mean += dead[i] ? 1.0 : d;
  }
  mean /= static_cast<double>(n);
  const double add = config.damp * mean;
  // W column-major (W_t[j·m + r]) in fp64 for the errors E = float(W − Ŵ), as the CPU computes
  // them; the targets X start as float(W). Dead columns zeroed.
  std::vector<double> w_t(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) w_t[j * m + r] = dead[j] ? 0.0 : w[r * n + j];
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  QCAL_RETURN_IF_ERROR(UploadE8pTables(s));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> dh, Alloc<double>(n * n));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<unsigned char> ddead, Alloc<unsigned char>(n));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dh.get(), h, n * n * sizeof(double), cudaMemcpyHostToDevice, s));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(ddead.get(), dead.data(), n, cudaMemcpyHostToDevice, s));
  FixDiagonalKernel<<<Blocks(n, 256), 256, 0, s>>>(dh.get(), n, ddead.get(), add);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("FixDiagonalKernel");
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> dw, Alloc<double>(m * n));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<float> dx, Alloc<float>(m * n));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dw.get(), w_t.data(), m * n * sizeof(double), cudaMemcpyHostToDevice, s));
  ToFloatKernel<<<Blocks(m * n, 256), 256, 0, s>>>(dw.get(), dx.get(), m * n);
  QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("ToFloatKernel");
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  t.upload_ms = MsSince(t0);

  t0 = std::chrono::steady_clock::now();
  {
    Status ldl = BlockLdlCuda(dh.get(), n, kG, stream);
    if (!ldl.ok()) return Status(ldl.code(), absl::StrCat(what, ": ", ldl.message()));
  }
  QCAL_ASSIGN_OR_RETURN(DevicePtr<float> dlf, Alloc<float>(n * n));
  {
    const dim3 threads(32, 8);
    const dim3 blocks(Blocks(n, 32), Blocks(n, 8));
    LowerToFloatKernel<<<blocks, threads, 0, s>>>(dh.get(), dlf.get(), n);
    QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("LowerToFloatKernel");
  }
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  dh.reset();
  t.factor_ms = MsSince(t0);

  t0 = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(DevicePtr<uint32_t> dcodes, Alloc<uint32_t>(m * (n / kG)));
  cublasHandle_t raw = nullptr;
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasCreate(&raw));
  std::unique_ptr<cublasContext, decltype(&cublasDestroy)> handle(raw, &cublasDestroy);
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetStream(raw, s));
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(raw, CUBLAS_PEDANTIC_MATH));
  const int64_t B = ((std::max<int64_t>(1, config.lazy_block) + kG - 1) / kG) * kG;
  const float one = 1.0f;
  for (int64_t b0 = 0; b0 < n; b0 += B) {
    const int64_t b1 = std::min(b0 + B, n), bw = b1 - b0;
    if (b0 > 0) {
      // X[:, b0:b1] += E[:, 0:b0] · U[0:b0, b0:b1]; column-major X (ld m). Lf[k·n + j] = U[k][j]
      // is, column-major, Uᵀ: its rows b0..b1 (pointer + b0, ld n) transposed are the panel.
      QCAL_CUBLAS_RETURN_IF_ERROR(cublasSgemm(
          raw, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(m), static_cast<int>(bw),
          static_cast<int>(b0), &one, dx.get(), static_cast<int>(m), dlf.get() + b0,
          static_cast<int>(n), &one, dx.get() + b0 * m, static_cast<int>(m)));
    }
    InBlockKernel<<<Blocks(m, 32), 32, 0, s>>>(dx.get(), dw.get(), dlf.get(), m, n, b0, b1, scale,
                                              dcodes.get());
    QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("InBlockKernel");
  }
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  t.sweep_ms = MsSince(t0);

  t0 = std::chrono::steady_clock::now();
  VectorRoundingResult res;
  res.rows = m;
  res.cols = n;
  res.dim = kG;
  res.code_words = 1;
  res.scale = scale;
  res.codes.resize(m * (n / kG));
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(res.codes.data(), dcodes.get(),
                                       res.codes.size() * sizeof(uint32_t),
                                       cudaMemcpyDeviceToHost));
  const E8pCodebook cb;
  res.w_hat.resize(m * n);
  std::vector<float> points(n);
  for (int64_t r = 0; r < m; ++r) {
    cb.Decode(&res.codes[r * (n / kG)], n / kG, points.data());
    for (int64_t j = 0; j < n; ++j) res.w_hat[r * n + j] = scale * static_cast<double>(points[j]);
  }
  t.download_ms = MsSince(t0);
  if (times != nullptr) *times = t;
  return res;
}

}  // namespace qcal::kernels
