// GPTQ on the GPU (kernels/gptq_cuda.h).
#include "kernels/gptq_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/cuda_util.cuh"
#include "kernels/linalg_cuda.h"

namespace qcal::kernels {
namespace {


// One span [c0, c1) of a lazy block [i1, i2) (a whole block, or one group of it), one thread per
// row: W column-major (W[j·m + r]); scale/zero: the row's parameters for this span; err
// column-major over the block (err[(i − i1)·m + r]); codes row-major [m, n] (processing order).
__global__ void GptqSpanKernel(double* w, const double* r_inv, const double* scale,
                               const int32_t* zero, int32_t cmin, int32_t cmax, int64_t m,
                               int64_t n, int64_t i1, int64_t i2, int64_t c0, int64_t c1,
                               double* err, int32_t* codes) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= m) return;
  const double s = scale[r];
  const int32_t z = zero[r];
  for (int64_t i = c0; i < c1; ++i) {
    const double wv = w[i * m + r];
    // ScalarQuantizeCode / ScalarDequantizeCode (kernels/scalar_quant.h).
    double q = rint(__ddiv_rn(wv, s)) + z;
    q = q < cmin ? cmin : (q > cmax ? cmax : q);
    const int32_t code = static_cast<int32_t>(q);
    codes[r * n + i] = code;
    const double deq = __dmul_rn(static_cast<double>(code - z), s);
    const double e = __ddiv_rn(__dsub_rn(wv, deq), r_inv[i * n + i]);
    err[(i - i1) * m + r] = e;
    for (int64_t j = i + 1; j < i2; ++j) w[j * m + r] -= e * r_inv[i * n + j];
  }
}


}  // namespace

StatusOr<ScalarRoundingResult> GptqCuda(const double* w, int64_t m, int64_t n, const double* h,
                                        const ScalarRoundingConfig& config, void* stream,
                                        GptqCudaTimes* times) {
  QCAL_ASSIGN_OR_RETURN(GptqPlan plan, PrepareGptq(w, m, n, h, config));
  const ScalarQuantConfig& qc = config.quant;
  ScalarRoundingResult& res = plan.res;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  GptqCudaTimes t;

  auto t0 = std::chrono::steady_clock::now();
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> dr, Alloc<double>(n * n));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dr.get(), plan.h.data(), n * n * sizeof(double), cudaMemcpyHostToDevice, s));
  plan.h = std::vector<double>();
  {
    Status f = InverseCholeskyUpperCuda(dr.get(), n, stream);
    if (!f.ok()) return Status(f.code(), absl::StrCat("gptq (cuda): ", f.message()));
  }
  t.factor_ms = MsSince(t0);

  t0 = std::chrono::steady_clock::now();
  // W column-major on the device.
  std::vector<double> wt(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < n; ++k) wt[k * m + r] = plan.w[r * n + k];
  }
  const int64_t B = plan.lazy_block;
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> dw, Alloc<double>(m * n));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> derr, Alloc<double>(m * B));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<int32_t> dcodes, Alloc<int32_t>(m * n));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<double> dscale, Alloc<double>(m));
  QCAL_ASSIGN_OR_RETURN(DevicePtr<int32_t> dzero, Alloc<int32_t>(m));
  QCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dw.get(), wt.data(), m * n * sizeof(double), cudaMemcpyHostToDevice, s));
  const bool grouped = qc.granularity == QuantGranularity::kPerGroup;
  const int64_t g = grouped ? std::min(qc.group_size, n) : n;
  std::vector<double> scale(m);
  std::vector<int32_t> zero(m);
  auto upload_params = [&](int64_t group) -> Status {
    for (int64_t r = 0; r < m; ++r) {
      const ScalarQuantParams<double> p = res.params(r, res.perm[group * g]);
      scale[r] = p.scale;
      zero[r] = p.zero;
    }
    QCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dscale.get(), scale.data(), m * sizeof(double), cudaMemcpyHostToDevice, s));
    QCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dzero.get(), zero.data(), m * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    return absl::OkStatus();
  };
  if (!grouped) QCAL_RETURN_IF_ERROR(upload_params(0));
  cublasHandle_t raw = nullptr;
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasCreate(&raw));
  std::unique_ptr<cublasContext, decltype(&cublasDestroy)> handle(raw, &cublasDestroy);
  QCAL_CUBLAS_RETURN_IF_ERROR(cublasSetStream(raw, s));
  const int32_t cmin = ScalarCodeMin(qc), cmax = ScalarCodeMax(qc);
  const unsigned row_blocks = static_cast<unsigned>((m + 63) / 64);
  std::vector<double> span(static_cast<size_t>(m * g));
  for (int64_t i1 = 0; i1 < n; i1 += B) {
    const int64_t i2 = std::min(i1 + B, n), bw = i2 - i1;
    for (int64_t c0 = i1; c0 < i2; c0 += g) {
      const int64_t c1 = std::min(c0 + g, i2);
      if (grouped) {
        // The group's parameters from its running weights (as the CPU sweep computes them).
        const int64_t len = std::min(g, n - c0);
        QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(span.data(), dw.get() + c0 * m,
                                                  m * len * sizeof(double),
                                                  cudaMemcpyDeviceToHost, s));
        QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
        std::vector<double> row(len);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t j = 0; j < len; ++j) row[j] = span[j * m + r];
          SetScalarParams(&res, r, c0 / g, ComputeScalarQuantParams(row.data(), len, qc));
        }
        QCAL_RETURN_IF_ERROR(upload_params(c0 / g));
      }
      GptqSpanKernel<<<row_blocks, 64, 0, s>>>(dw.get(), dr.get(), dscale.get(), dzero.get(),
                                               cmin, cmax, m, n, i1, i2, c0, c1, derr.get(),
                                               dcodes.get());
      QCAL_CUDA_RETURN_IF_LAUNCH_ERROR("GptqSpanKernel");
    }
    if (i2 < n) {  // W[:, i2:] −= Err · R[i1:i2, i2:]
      const double minus_one = -1.0, one = 1.0;
      QCAL_CUBLAS_RETURN_IF_ERROR(cublasDgemm(
          raw, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(m), static_cast<int>(n - i2),
          static_cast<int>(bw), &minus_one, derr.get(), static_cast<int>(m),
          dr.get() + i1 * n + i2, static_cast<int>(n), &one, dw.get() + i2 * m,
          static_cast<int>(m)));
    }
  }
  std::vector<int32_t> codes(static_cast<size_t>(m * n));
  QCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(codes.data(), dcodes.get(),
                                            codes.size() * sizeof(int32_t),
                                            cudaMemcpyDeviceToHost, s));
  QCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  t.sweep_ms = MsSince(t0);
  FinishGptqCodes(codes, &res);
  if (config.refine_sweeps > 0) {
    auto refined = RefineRounding(w, h, config.refine_sweeps, config.damp, config.lazy_block,
                                  config.num_threads, qc, &res);
    if (!refined.ok()) {
      return Status(refined.status().code(), absl::StrCat("gptq: ", refined.status().message()));
    }
  }
  if (times != nullptr) *times = t;
  return std::move(res);
}

}  // namespace qcal::kernels
