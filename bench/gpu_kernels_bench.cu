// GPU kernel throughput against cuBLAS measured in the same run (issue 15's goals):
//   * Hessian accumulation (kernels/hessian_cuda.h: triangle GEMMs + exact fixed-point sums)
//     against one full cuBLAS bf16 GEMM Xᵀ·X of the same shape (goal: ≥ 70% of its throughput,
//     counting the triangle's useful flops, t·n(n+1) per sequence);
//   * E8P exact encoding (kernels/e8p_cuda.h) in vectors/s, beside the CPU encoder on one thread;
//   * fp64 Cholesky (cuSOLVER) ÷ one fp64 GEMM and one bf16 GEMM of the same n.
// Shapes are Llama-2-7B's (4096, 11008) and Llama-2/3-70B's (8192, 28672) linear inputs, with
// random data (bf16 Gaussian activations; diagonally dominant SPD matrices). Prints a table and
// one JSON object per measurement ("bench": ...).
// Usage: bench_gpu_kernels [--quick] [--only=hessian,e8p,cholesky,blockldlq,gptq]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_status.h"
#include "kernels/e8p.h"
#include "kernels/e8p_cuda.h"
#include "kernels/gptq_cuda.h"
#include "kernels/hessian_cuda.h"
#include "kernels/ldlq_cuda.h"
#include "kernels/linalg_cuda.h"

namespace {

using qcal::Status;

#define CHECK_OK(expr)                                                                  \
  do {                                                                                  \
    const ::qcal::Status st_ = (expr);                                                  \
    if (!st_.ok()) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, st_.ToString().c_str()); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)
#define CHECK_CUDA(expr) CHECK_OK(::qcal::CudaStatus((expr), #expr, __FILE__, __LINE__))
#define CHECK_CUBLAS(expr) CHECK_OK(::qcal::CublasStatus((expr), #expr, __FILE__, __LINE__))

__device__ uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Approximately N(0, 1) from a hash (sum of 4 uniforms, rescaled): enough for timing.
__device__ float Gauss(uint64_t i, uint64_t seed) {
  const uint64_t h = Mix(i ^ (seed << 40));
  float s = 0;
  for (int k = 0; k < 4; ++k) s += static_cast<float>((h >> (16 * k)) & 0xFFFF) / 65535.0f;
  return (s - 2.0f) * 1.7320508f;
}
__global__ void FillBf16(__nv_bfloat16* x, int64_t count, uint64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] = __float2bfloat16(Gauss(i, seed));
}
__global__ void FillFloat(float* x, int64_t count, uint64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] = 1.03f * Gauss(i, seed);
}
// Symmetric, diagonally dominant (so positive definite): off-diagonal in ±0.5/n, diagonal 1.
__global__ void FillSpd(double* a, int64_t n, uint64_t seed) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n * n) return;
  const int64_t i = e / n, j = e % n;
  const int64_t lo = i < j ? i : j, hi = i < j ? j : i;
  const double u = static_cast<double>(Mix(static_cast<uint64_t>(lo * n + hi) ^ seed) >> 11) *
                   0x1p-53;
  a[e] = i == j ? 1.0 : (u - 0.5) / static_cast<double>(n);
}

unsigned Blocks(int64_t count) { return static_cast<unsigned>((count + 255) / 256); }

class Timer {
 public:
  Timer() {
    cudaEventCreate(&a_);
    cudaEventCreate(&b_);
  }
  ~Timer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  void Start() { cudaEventRecord(a_); }
  double StopMs() {
    cudaEventRecord(b_);
    cudaEventSynchronize(b_);
    float ms = 0;
    cudaEventElapsedTime(&ms, a_, b_);
    return ms;
  }

 private:
  cudaEvent_t a_, b_;
};

void Json(const std::string& body) { std::printf("{\"bench\": %s}\n", body.c_str()); }

// cuBLAS bf16 GEMM C[n, n] (fp32) = Xᵀ X for one sequence X [t, n], ms per call.
double GemmBf16Ms(cublasHandle_t h, const __nv_bfloat16* x, float* c, int64_t n, int64_t t,
                  int reps) {
  const float alpha = 1, beta = 0;
  auto call = [&] {
    CHECK_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n),
                              static_cast<int>(n), static_cast<int>(t), &alpha, x, CUDA_R_16BF,
                              static_cast<int>(n), x, CUDA_R_16BF, static_cast<int>(n), &beta, c,
                              CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  };
  call();
  Timer tm;
  tm.Start();
  for (int r = 0; r < reps; ++r) call();
  return tm.StopMs() / reps;
}

void BenchHessian(int64_t n, int64_t t, int64_t seqs, int64_t strip, int64_t group) {
  cublasHandle_t h;
  CHECK_CUBLAS(cublasCreate(&h));
  __nv_bfloat16* x = nullptr;
  float* c = nullptr;
  CHECK_CUDA(cudaMalloc(&x, seqs * t * n * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&c, n * n * sizeof(float)));
  FillBf16<<<Blocks(seqs * t * n), 256>>>(x, seqs * t * n, 1);
  CHECK_CUDA(cudaDeviceSynchronize());
  const double gemm_ms = GemmBf16Ms(h, x, c, n, t, 3);
  CHECK_CUDA(cudaFree(c));
  const double gemm_tflops = 2.0 * n * n * t / (gemm_ms * 1e-3) / 1e12;
  qcal::kernels::HessianCudaOptions o;
  o.strip = strip;
  o.max_group = group;
  o.workspace_bytes = int64_t{8} << 30;
  double acc_ms = 0;
  {
  auto acc = qcal::kernels::HessianAccumulatorCuda::Create(n, nullptr, o);
  CHECK_OK(acc.status());
  CHECK_OK(acc->Add(x, qcal::kernels::HessianInputType::kBf16, std::min<int64_t>(seqs, 2), t));
  CHECK_OK(acc->Sync());
  Timer tm;
  tm.Start();
  CHECK_OK(acc->Add(x, qcal::kernels::HessianInputType::kBf16, seqs, t));
  acc_ms = tm.StopMs();
  CHECK_OK(acc->Sync());
  }  // frees the accumulator
  const double useful_tflops = static_cast<double>(seqs) * t * n * (n + 1) / (acc_ms * 1e-3) / 1e12;
  const double ratio = useful_tflops / gemm_tflops;
  std::printf("hessian n=%-6lld t=%lld seqs=%lld strip=%lld group=%lld: %.2f ms (%.1f useful TFLOP/s) | "
              "cuBLAS bf16 GEMM XᵀX %.3f ms/seq (%.1f TFLOP/s) | ratio %.2f\n",
              (long long)n, (long long)t, (long long)seqs, (long long)strip, (long long)group,
              acc_ms, useful_tflops, gemm_ms, gemm_tflops, ratio);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "\"hessian\", \"n\": %lld, \"t\": %lld, \"seqs\": %lld, \"strip\": %lld, \"group\": %lld, "
                "\"ms\": %.3f, \"useful_tflops\": %.2f, \"gemm_ms_per_seq\": %.4f, "
                "\"gemm_tflops\": %.2f, \"ratio\": %.3f",
                (long long)n, (long long)t, (long long)seqs, (long long)strip, (long long)group,
                acc_ms, useful_tflops, gemm_ms, gemm_tflops, ratio);
  Json(std::string("{\"kind\": ") + buf + "}");
  CHECK_CUDA(cudaFree(x));
  cublasDestroy(h);
}

void BenchE8p(int64_t count) {
  float* x = nullptr;
  uint32_t* codes = nullptr;
  CHECK_CUDA(cudaMalloc(&x, count * 8 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&codes, count * sizeof(uint32_t)));
  FillFloat<<<Blocks(count * 8), 256>>>(x, count * 8, 2);
  CHECK_OK(qcal::kernels::E8pEncodeCuda(x, 1024, codes, nullptr, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  Timer tm;
  tm.Start();
  CHECK_OK(qcal::kernels::E8pEncodeCuda(x, count, codes, nullptr, nullptr));
  const double ms = tm.StopMs();
  // The CPU encoder on one thread, on the first 2^16 of the same vectors.
  const int64_t cpu_count = 1 << 16;
  std::vector<float> host(cpu_count * 8);
  CHECK_CUDA(cudaMemcpy(host.data(), x, host.size() * 4, cudaMemcpyDeviceToHost));
  qcal::kernels::E8pCodebook cb;
  std::vector<uint32_t> cpu_codes(cpu_count);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t v = 0; v < cpu_count; ++v) cpu_codes[v] = cb.EncodeOne(&host[8 * v], nullptr).bits;
  const double cpu_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<uint32_t> gpu_codes(cpu_count);
  CHECK_CUDA(cudaMemcpy(gpu_codes.data(), codes, cpu_count * 4, cudaMemcpyDeviceToHost));
  const bool same = gpu_codes == cpu_codes;
  std::printf("e8p encode: %lld vectors in %.2f ms = %.3g vectors/s (CPU one thread: %.3g "
              "vectors/s; ratio %.0f; codes equal on the first %lld: %s)\n",
              (long long)count, ms, count / (ms * 1e-3), cpu_count / cpu_s,
              (count / (ms * 1e-3)) / (cpu_count / cpu_s), (long long)cpu_count,
              same ? "yes" : "NO");
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "{\"kind\": \"e8p\", \"vectors\": %lld, \"ms\": %.3f, \"vectors_per_s\": %.4g, "
                "\"cpu_one_thread_vectors_per_s\": %.4g, \"codes_equal\": %s}",
                (long long)count, ms, count / (ms * 1e-3), cpu_count / cpu_s,
                same ? "true" : "false");
  Json(buf);
  CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(codes));
}

void BenchCholesky(int64_t n) {
  cublasHandle_t h;
  CHECK_CUBLAS(cublasCreate(&h));
  double* a = nullptr;
  CHECK_CUDA(cudaMalloc(&a, n * n * sizeof(double)));
  FillSpd<<<Blocks(n * n), 256>>>(a, n, 3);
  CHECK_CUDA(cudaDeviceSynchronize());
  Timer tm;
  tm.Start();
  CHECK_OK(qcal::kernels::CholeskyCuda(a, n, nullptr));
  const double chol_ms = tm.StopMs();
  // One fp64 GEMM and one bf16 GEMM of the same n (C = A·A).
  double* c = nullptr;
  CHECK_CUDA(cudaMalloc(&c, n * n * sizeof(double)));
  const double one = 1, zero = 0;
  auto dgemm = [&] {
    CHECK_CUBLAS(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &one, a, (int)n,
                             a, (int)n, &zero, c, (int)n));
  };
  dgemm();
  tm.Start();
  dgemm();
  const double dgemm_ms = tm.StopMs();
  CHECK_CUDA(cudaFree(c));
  __nv_bfloat16* xb = nullptr;
  float* cf = nullptr;
  CHECK_CUDA(cudaMalloc(&xb, n * n * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&cf, n * n * sizeof(float)));
  FillBf16<<<Blocks(n * n), 256>>>(xb, n * n, 4);
  const double bgemm_ms = GemmBf16Ms(h, xb, cf, n, n, 2);
  CHECK_CUDA(cudaFree(xb));
  CHECK_CUDA(cudaFree(cf));
  CHECK_CUDA(cudaFree(a));
  std::printf("cholesky fp64 n=%-6lld: %.2f ms | fp64 GEMM %.2f ms (ratio %.2f) | bf16 GEMM %.2f "
              "ms (ratio %.1f)\n",
              (long long)n, chol_ms, dgemm_ms, chol_ms / dgemm_ms, bgemm_ms, chol_ms / bgemm_ms);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "{\"kind\": \"cholesky\", \"n\": %lld, \"ms\": %.3f, \"dgemm_ms\": %.3f, "
                "\"bf16_gemm_ms\": %.3f}",
                (long long)n, chol_ms, dgemm_ms, bgemm_ms);
  Json(buf);
  cublasDestroy(h);
}

// A random linear layer for the rounding benchmarks: weights W [m, n] (about N(0, 0.02²): a sum
// of three uniforms) and a symmetric, diagonally dominant Hessian H [n, n] (diagonal 1 plus
// `diag_spread`·U(0, 1), off-diagonal U(−0.5, 0.5)/n), from xorshift64*.
void RandomLinear(int64_t m, int64_t n, uint64_t seed, double diag_spread, std::vector<double>* w,
                  std::vector<double>* h) {
  uint64_t state = seed ^ static_cast<uint64_t>(m * n);
  auto uniform = [&] {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return static_cast<double>((state * 0x2545F4914F6CDD1Dull) >> 11) * 0x1p-53;
  };
  w->resize(m * n);
  h->resize(n * n);
  for (double& v : *w) v = 0.02 * (uniform() + uniform() + uniform() - 1.5);
  for (int64_t i = 0; i < n; ++i) {
    (*h)[i * n + i] = 1.0 + diag_spread * uniform();
    for (int64_t j = 0; j < i; ++j) (*h)[i * n + j] = (*h)[j * n + i] = (uniform() - 0.5) / n;
  }
}

// BlockLDLQ (E8P) of one linear W [m, n] with a random SPD Hessian [n, n]: device phases, beside
// one fp32 GEMM W·H and one bf16 GEMM of the same shape (m × n × n) in the same run.
void BenchBlockLdlq(int64_t m, int64_t n, const char* name) {
  std::vector<double> w, h;
  RandomLinear(m, n, 0x2545F4914F6CDD1Dull, /*diag_spread=*/0.0, &w, &h);
  qcal::kernels::VectorRoundingConfig config;
  qcal::kernels::BlockLdlqCudaTimes t;
  auto res = qcal::kernels::BlockLdlqE8pCuda(w.data(), m, n, h.data(), config, nullptr, &t);
  CHECK_OK(res.status());
  // GEMMs of the same shape.
  cublasHandle_t hd;
  CHECK_CUBLAS(cublasCreate(&hd));
  CHECK_CUBLAS(cublasSetMathMode(hd, CUBLAS_PEDANTIC_MATH));
  float *a = nullptr, *b = nullptr, *c = nullptr;
  CHECK_CUDA(cudaMalloc(&a, m * n * 4));
  CHECK_CUDA(cudaMalloc(&b, n * n * 4));
  CHECK_CUDA(cudaMalloc(&c, m * n * 4));
  FillFloat<<<Blocks(m * n), 256>>>(a, m * n, 6);
  FillFloat<<<Blocks(n * n), 256>>>(b, n * n, 7);
  const float one = 1, zero = 0;
  auto sgemm = [&] {
    CHECK_CUBLAS(cublasSgemm(hd, CUBLAS_OP_N, CUBLAS_OP_N, (int)m, (int)n, (int)n, &one, a, (int)m,
                             b, (int)n, &zero, c, (int)m));
  };
  sgemm();
  Timer tm;
  tm.Start();
  sgemm();
  const double sgemm_ms = tm.StopMs();
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  cublasDestroy(hd);
  const double device_ms = t.factor_ms + t.sweep_ms;
  std::printf("blockldlq e8p %-10s %lldx%lld: factor %.1f ms + sweep %.1f ms = %.1f ms on the "
              "device (upload %.0f ms, download+decode %.0f ms) | fp32 GEMM m·n·n %.2f ms "
              "(ratio %.1f)\n",
              name, (long long)m, (long long)n, t.factor_ms, t.sweep_ms, device_ms, t.upload_ms,
              t.download_ms, sgemm_ms, device_ms / sgemm_ms);
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "{\"kind\": \"blockldlq_e8p\", \"linear\": \"%s\", \"m\": %lld, \"n\": %lld, "
                "\"factor_ms\": %.2f, \"sweep_ms\": %.2f, \"upload_ms\": %.1f, "
                "\"download_ms\": %.1f, \"fp32_gemm_ms\": %.3f}",
                name, (long long)m, (long long)n, t.factor_ms, t.sweep_ms, t.upload_ms,
                t.download_ms, sgemm_ms);
  Json(buf);
}

// GPTQ (4-bit per channel, act order; gptq-4bit's grid without its clip search) of one linear W [m, n] with
// a random SPD Hessian: device phases beside one fp64 GEMM W·H of the same shape.
void BenchGptq(int64_t m, int64_t n, const char* name) {
  std::vector<double> w, h;
  RandomLinear(m, n, 0x9E3779B97F4A7C15ull, /*diag_spread=*/1.0, &w, &h);
  // No clip search: its per-channel search runs on the host (single-threaded in
  // InitScalarResult, pow() per grid point and weight) and would dominate: at 8192 × 28672 it
  // ran for minutes on the GPU machine's CPU before this bench was changed.
  qcal::kernels::ScalarRoundingConfig config;
  config.quant.bits = 4;
  config.act_order = true;
  qcal::kernels::GptqCudaTimes t;
  const auto t0 = std::chrono::steady_clock::now();
  auto res = qcal::kernels::GptqCuda(w.data(), m, n, h.data(), config, nullptr, &t);
  const double total_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK_OK(res.status());
  cublasHandle_t hd;
  CHECK_CUBLAS(cublasCreate(&hd));
  double *a = nullptr, *b = nullptr, *c = nullptr;
  CHECK_CUDA(cudaMalloc(&a, m * n * 8));
  CHECK_CUDA(cudaMalloc(&b, n * n * 8));
  CHECK_CUDA(cudaMalloc(&c, m * n * 8));
  CHECK_CUDA(cudaMemset(a, 0, m * n * 8));
  CHECK_CUDA(cudaMemset(b, 0, n * n * 8));
  const double one = 1, zero = 0;
  auto dgemm = [&] {
    CHECK_CUBLAS(cublasDgemm(hd, CUBLAS_OP_N, CUBLAS_OP_N, (int)m, (int)n, (int)n, &one, a, (int)m,
                             b, (int)n, &zero, c, (int)m));
  };
  dgemm();
  Timer tm;
  tm.Start();
  dgemm();
  const double dgemm_ms = tm.StopMs();
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  cublasDestroy(hd);
  std::printf("gptq 4-bit act-order %-10s %lldx%lld: factor %.1f ms + sweep %.1f ms (whole call "
              "with host preparation %.0f ms) | fp64 GEMM m·n·n %.2f ms (device ratio %.1f)\n",
              name, (long long)m, (long long)n, t.factor_ms, t.sweep_ms, total_ms, dgemm_ms,
              (t.factor_ms + t.sweep_ms) / dgemm_ms);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "{\"kind\": \"gptq\", \"linear\": \"%s\", \"m\": %lld, \"n\": %lld, "
                "\"factor_ms\": %.2f, \"sweep_ms\": %.2f, \"total_ms\": %.1f, "
                "\"fp64_gemm_ms\": %.3f}",
                name, (long long)m, (long long)n, t.factor_ms, t.sweep_ms, total_ms, dgemm_ms);
  Json(buf);
}

}  // namespace

int main(int argc, char** argv) {
  // [--quick] [--only=hessian,e8p,cholesky,blockldlq,gptq]
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = argv[i] + 7;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // line-buffered: a run stopped at a time limit
                                              // keeps the lines it printed
  auto want = [&](const char* part) {
    return only.empty() || ("," + only + ",").find(std::string(",") + part + ",") != std::string::npos;
  };
  std::string why;
  if (!qcal::CudaDeviceAvailable(&why)) {
    std::printf("SKIPPED: no CUDA device: %s\n", why.c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %.1f GiB, %d SMs\n", prop.name,
              prop.totalGlobalMem / double(1ull << 30), prop.multiProcessorCount);
  Json(std::string("{\"kind\": \"device\", \"name\": \"") + prop.name + "\"}");
  {  // Warm-up: library loading and first-call costs stay out of the timings.
    double* w = nullptr;
    CHECK_CUDA(cudaMalloc(&w, 256 * 256 * sizeof(double)));
    FillSpd<<<Blocks(256 * 256), 256>>>(w, 256, 5);
    CHECK_OK(qcal::kernels::CholeskyCuda(w, 256, nullptr));
    CHECK_CUDA(cudaFree(w));
  }
  // The calibration shapes: 4096-token sequences (QuIP#'s 6144 × 4096 devset), 32 per call.
  if (!want("hessian")) {
  } else if (quick) {
    BenchHessian(4096, 2048, 2, 1024, 16);
  } else {
    for (int64_t n : {4096, 8192, 11008, 28672}) BenchHessian(n, 4096, 32, 1024, 16);
    for (int64_t group : {8, 32}) BenchHessian(8192, 4096, 32, 1024, group);
    BenchHessian(8192, 4096, 32, 512, 16);
    BenchHessian(8192, 2048, 32, 1024, 16);
  }
  if (want("e8p")) BenchE8p(quick ? (1 << 20) : (1 << 24));
  for (int64_t n : {4096, 8192, 14336, 28672}) {
    if (!want("cholesky") || (quick && n > 4096)) break;
    BenchCholesky(n);
  }
  if (want("blockldlq")) BenchBlockLdlq(4096, 4096, "7b.q_proj");
  if (!quick && want("blockldlq")) {
    BenchBlockLdlq(4096, 11008, "7b.down");
    BenchBlockLdlq(8192, 8192, "70b.q_proj");
    BenchBlockLdlq(8192, 28672, "70b.down");
  }
  if (want("gptq")) BenchGptq(4096, 4096, "7b.q_proj");
  if (!quick && want("gptq")) {
    BenchGptq(4096, 11008, "7b.down");
    BenchGptq(8192, 8192, "70b.q_proj");
    BenchGptq(8192, 28672, "70b.down");
  }
  return 0;
}
