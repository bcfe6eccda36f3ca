// The calibration forward of a decoder block on the device (kernels/block_forward_cuda.h)
// against its CPU reference (engine/model DecoderBlock::Forward, with the exact CPU Hessian
// accumulators on each linear's input), in the style of ggml's test-backend-ops:
//   * fp32 mode (pedantic cuBLAS, no TF32): outputs within 1e-4 of the reference's largest
//     output (fp32 with another summation order; attention with an online softmax), and each
//     Hessian mean within 1e-4 relative (max-norm) of the CPU's;
//   * bf16 mode (tensor cores, fp32 accumulation): every linear's input is rounded to bf16
//     (relative 2^-9), so the outputs are within 3e-2 and the Hessians within 2e-2 relative;
//   * inputs and outputs non-zero; the sequences longer than the attention kernel's 32-key tiles
//     and not a multiple of them; GQA (4 query heads per KV head); fresh random weights and
//     inputs, the seed printed (QCAL_TEST_SEED=... reproduces a run);
//   * the device sums are bit-identical whether the sequences go through in one call or split
//     over two (what makes a GPU calibration independent of the rank count).
// Without a CUDA device every test skips visibly (ctest label gpu).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "kernels/block_forward_cuda.h"
#include "kernels/cuda_status.h"
#include "kernels/hessian_cuda.h"
#include "tests/test_util.h"
#include "engine/calib/hessian.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

LlamaConfig SmallConfig() {
  LlamaConfig c;
  c.hidden_size = 256;
  c.intermediate_size = 688;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.vocab_size = 1000;
  c.max_position_embeddings = 512;
  return c;
}

model::BlockWeights RandomBlock(const LlamaConfig& c) {
  model::BlockWeights w;
  const int64_t h = c.hidden_size, ff = c.intermediate_size;
  w.input_norm = 1.0 + 0.1 * at::randn({h});
  w.post_norm = 1.0 + 0.1 * at::randn({h});
  const int64_t outs[7] = {c.q_dim(), c.kv_dim(), c.kv_dim(), h, ff, ff, h};
  const int64_t ins[7] = {h, h, h, c.q_dim(), h, h, ff};
  for (int k = 0; k < 7; ++k) {
    w.linears[k] = std::make_unique<model::DenseLinear>(
        (at::randn({outs[k], ins[k]}) / std::sqrt(static_cast<double>(ins[k]))).contiguous());
  }
  return w;
}

double RelMax(const at::Tensor& got, const at::Tensor& ref) {
  return (got - ref).abs().max().item<double>() / ref.abs().max().item<double>();
}

class GpuBlockForwardTest : public ::testing::TestWithParam<kernels::BlockForwardPrecision> {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }
};

TEST_P(GpuBlockForwardTest, MatchesTheCpuBlockAndItsHessians) {
  const bool bf16 = GetParam() == kernels::BlockForwardPrecision::kBf16;
  const uint64_t seed = testing::TestSeed();
  at::manual_seed(seed);
  model::SetComputeThreads(2);
  const LlamaConfig c = SmallConfig();
  model::DecoderBlock block(c, RandomBlock(c));
  const model::Rope rope(c);
  const int64_t seqs = 3, t = 300;
  at::Tensor x = at::randn({seqs, t, c.hidden_size});
  x.select(2, 7).mul_(20.0);  // an outlier channel, as in real activations

  // CPU reference: the block forward and exact Hessian sums of its four inputs.
  calib::BlockHessians cpu;
  auto ref = calib::ForwardCollectingHessians(block, x, rope, seqs, &cpu);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_GT(ref->abs().max().item<double>(), 0.0);

  // Device: the same weights uploaded, the same inputs.
  kernels::BlockForwardShape shape;
  shape.hidden = c.hidden_size;
  shape.intermediate = c.intermediate_size;
  shape.heads = c.num_attention_heads;
  shape.kv_heads = c.num_key_value_heads;
  shape.head_dim = c.head_dim;
  shape.rms_eps = c.rms_norm_eps;
  kernels::BlockForwardWeights bw;
  const model::BlockWeights& w = block.weights();
  bw.input_norm = w.input_norm.data_ptr<float>();
  bw.post_norm = w.post_norm.data_ptr<float>();
  for (int k = 0; k < 7; ++k) {
    bw.linears[k] = w.linears[k]->DenseWeight().data_ptr<float>();
  }
  auto dev = kernels::BlockForwardCuda::Create(shape, bw, GetParam(), nullptr);
  ASSERT_TRUE(dev.ok()) << dev.status();
  const int64_t dims[4] = {c.hidden_size, c.q_dim(), c.hidden_size, c.intermediate_size};
  auto run = [&](const std::vector<int64_t>& splits, std::vector<std::vector<calib::Fixed128>>* sums,
                 int64_t* count) -> at::Tensor {
    std::vector<kernels::HessianAccumulatorCuda> accs;
    for (int k = 0; k < 4; ++k) {
      auto a = kernels::HessianAccumulatorCuda::Create(dims[k], nullptr);
      EXPECT_TRUE(a.ok()) << a.status();
      if (!a.ok()) return at::Tensor();
      accs.push_back(std::move(*a));
    }
    kernels::HessianAccumulatorCuda* taps[4] = {&accs[0], &accs[1], &accs[2], &accs[3]};
    const at::Tensor cos = rope.cos_table().narrow(0, 0, t).contiguous();
    const at::Tensor sin = rope.sin_table().narrow(0, 0, t).contiguous();
    at::Tensor out = at::empty_like(x);
    int64_t s0 = 0;
    for (int64_t n : splits) {
      const Status st = (*dev)->Forward(x.data_ptr<float>() + s0 * t * c.hidden_size, n, t,
                                        cos.data_ptr<float>(), sin.data_ptr<float>(), taps,
                                        out.data_ptr<float>() + s0 * t * c.hidden_size);
      EXPECT_TRUE(st.ok()) << st;
      s0 += n;
    }
    sums->clear();
    for (int k = 0; k < 4; ++k) {
      auto d = accs[k].Download();
      EXPECT_TRUE(d.ok()) << d.status();
      sums->push_back(d.ok() ? *d : std::vector<calib::Fixed128>());
      *count = accs[k].count();
    }
    return out;
  };
  std::vector<std::vector<calib::Fixed128>> whole, split;
  int64_t count = 0, count_split = 0;
  const at::Tensor got = run({seqs}, &whole, &count);
  const at::Tensor got_split = run({1, seqs - 1}, &split, &count_split);
  ASSERT_TRUE(got.defined() && got_split.defined());
  EXPECT_EQ(count, seqs * t);
  EXPECT_EQ(count_split, seqs * t);
  EXPECT_TRUE(at::equal(got, got_split)) << "outputs depend on how the sequences are batched";

  const double out_err = RelMax(got, *ref);
  std::printf("seed %llu, %s: output max-norm relative error %.3g\n",
              static_cast<unsigned long long>(seed), bf16 ? "bf16" : "fp32", out_err);
  EXPECT_LT(out_err, bf16 ? 3e-2 : 1e-4);
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(whole[k] == split[k]) << "kind " << k << ": sums depend on the split";
    auto dev_h = calib::HessianAccumulator::FromFixed(dims[k], whole[k], count);
    ASSERT_TRUE(dev_h.ok()) << dev_h.status();
    const at::Tensor ref_mean = cpu.h[k].Mean();
    ASSERT_GT(ref_mean.abs().max().item<double>(), 0.0);
    const double h_err = RelMax(dev_h->Mean(), ref_mean);
    std::printf("  Hessian %s: max-norm relative difference %.3g\n",
                calib::HessianKindName(calib::kAllHessianKinds[k]), h_err);
    EXPECT_LT(h_err, bf16 ? 2e-2 : 1e-4) << calib::HessianKindName(calib::kAllHessianKinds[k]);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, GpuBlockForwardTest,
                         ::testing::Values(kernels::BlockForwardPrecision::kFloat32,
                                           kernels::BlockForwardPrecision::kBf16));

}  // namespace
}  // namespace qcal
