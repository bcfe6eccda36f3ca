// Tests for methods/quip/transforms_torch.h and the quantized layers: methods/quip/quip_linear.h
// (the "quip" layer format) and engine/quant/scalar_linear.h (the "scalar" format).
//
// Random inputs are fresh per run; the seed is printed and can be pinned with QCAL_TEST_SEED.
// Tolerances, all relative to the reference's largest entry (max|diff| / max|ref|):
//   * LibTorch transforms vs kernels' CPU transforms: 1e-5 in fp32, 1e-12 in fp64;
//   * QuipLinear (one scale per matrix, and one per row: BlockLDLQ on D⁻¹W at scale 1, Ŵ = D·Q):
//     DenseWeight vs kernels::RecoverWeights(Ŵ) (fp64) 1e-5; Forward vs x @ DenseWeight()ᵀ 1e-5
//     (both float32);
//   * ScalarQuantLinear: DenseWeight vs w_hat 1e-6 (float32 rounding of scale·(code − zero));
//     Forward vs x @ w_hatᵀ 1e-5;
//   * checkpoint round trips: bit-identical (at::equal);
//   * gradients: analytic vs central finite difference 1e-6 (the loss is quadratic in each single
//     coordinate of su and sv, so the central difference is exact up to rounding).
#include "methods/quip/quip_linear.h"
#include "engine/quant/scalar_linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "kernels/codebook.h"
#include "kernels/hadamard.h"
#include "kernels/incoherence.h"
#include "kernels/rounding.h"
#include "tests/test_util.h"
#include "methods/quip/transforms_torch.h"

namespace qcal::quant {
namespace {

using methods::quip::OrthogonalTransformOp;
using methods::quip::QuipLinear;
using methods::quip::QuipLinearData;

uint64_t Seed() { return qcal::testing::ProcessSeed(); }
std::mt19937_64 Rng(uint64_t salt) { return qcal::testing::SeededRng(salt); }

std::vector<double> Gaussian(int64_t size, uint64_t salt, double sigma = 1.0) {
  std::mt19937_64 rng = Rng(salt);
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<double> v(size);
  for (double& x : v) x = normal(rng);
  return v;
}

at::Tensor GaussianTensor(std::vector<int64_t> shape, uint64_t salt, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<double> v = Gaussian(n, salt);
  return at::from_blob(v.data(), shape, at::kDouble).clone().to(dtype);
}

at::Tensor ToTensor(const std::vector<double>& v, std::vector<int64_t> shape) {
  return at::from_blob(const_cast<double*>(v.data()), shape, at::kDouble).clone();
}

// max|a − ref| / max|ref|, computed in double. Asserts the reference is not all zero.
double RelErr(const at::Tensor& a, const at::Tensor& ref) {
  at::Tensor r = ref.detach().to(at::kDouble);
  const double scale = r.abs().max().item<double>();
  EXPECT_GT(scale, 0) << "reference is all zero";
  return (a.detach().to(at::kDouble) - r).abs().max().item<double>() / scale;
}

template <typename T>
std::vector<T> ToVec(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

// ---------------------------------------------------------------------------------------------
// Transforms
// ---------------------------------------------------------------------------------------------

class TransformTest : public ::testing::TestWithParam<int64_t> {};

// U x = T·diag(s)·x (Hadamard sizes) or F·diag(p)·x (RFFT) from kernels::ApplyTransform vs the
// LibTorch op on s ⊙ x; and the inverse diag(s)·Tᵀ·x.
template <typename T>
void CheckAgainstKernels(int64_t d, const kernels::RandomizedTransform& t, bool signs_all_plus,
                         double tol) {
  const at::ScalarType dtype = std::is_same<T, double>::value ? at::kDouble : at::kFloat;
  StatusOr<OrthogonalTransformOp> op = OrthogonalTransformOp::FixedPart(t);
  ASSERT_TRUE(op.ok()) << op.status();
  ASSERT_EQ(op->dim(), d);
  const int64_t batch = 3 * 5;
  at::Tensor x = GaussianTensor({3, 5, d}, 10 + d, dtype);
  at::Tensor s = at::ones({d}, dtype);
  if (t.plan.IsHadamard()) {
    for (int64_t i = 0; i < d; ++i) s[i] = static_cast<double>(t.signs[i]);
  }
  for (auto dir : {TransformDirection::kForward, TransformDirection::kInverse}) {
    std::vector<T> ref = ToVec<T>(x);
    ASSERT_TRUE(kernels::ApplyTransform(t, ref.data(), batch, dir).ok());
    at::Tensor ref_t = at::from_blob(ref.data(), {3, 5, d}, dtype).clone();
    at::Tensor got = dir == TransformDirection::kForward ? op->Forward(x * s) : op->Inverse(x) * s;
    ASSERT_EQ(got.scalar_type(), dtype);
    ASSERT_EQ(got.sizes(), x.sizes());
    const double err = RelErr(got, ref_t);
    std::printf("[ info     ] d=%lld %s %s%s: rel err %.3g\n", static_cast<long long>(d),
                dir == TransformDirection::kForward ? "forward" : "inverse",
                dtype == at::kDouble ? "fp64" : "fp32", signs_all_plus ? " (signs +1)" : "", err);
    EXPECT_LE(err, tol) << "d=" << d << " dir=" << (dir == TransformDirection::kForward ? "fwd" : "inv")
                        << " dtype=" << dtype << " plus_signs=" << signs_all_plus;
  }
  // Inverse ∘ Forward = identity.
  EXPECT_LE(RelErr(op->Inverse(op->Forward(x)), x), tol);
}

TEST_P(TransformTest, MatchesKernelsCpuTransform) {
  QCAL_SEED_TRACE();
  const int64_t d = GetParam();
  StatusOr<kernels::RandomizedTransform> t = kernels::MakeRandomizedTransform(d, Rng(d)());
  ASSERT_TRUE(t.ok()) << t.status();
  CheckAgainstKernels<float>(d, *t, false, 1e-5);
  CheckAgainstKernels<double>(d, *t, false, 1e-12);
  if (t->plan.IsHadamard()) {
    // Signs all +1: the op alone equals the kernels' transform.
    StatusOr<kernels::RandomizedTransform> plus =
        kernels::RandomizedTransformFromSigns(std::vector<int8_t>(d, 1));
    ASSERT_TRUE(plus.ok());
    CheckAgainstKernels<float>(d, *plus, true, 1e-5);
    CheckAgainstKernels<double>(d, *plus, true, 1e-12);
  }
}

TEST_P(TransformTest, PlanKindIsCovered) {
  const int64_t d = GetParam();
  const HadamardPlan plan = PlanHadamard(d);
  StatusOr<kernels::RandomizedTransform> t = kernels::MakeRandomizedTransform(d, 1);
  ASSERT_TRUE(t.ok());
  StatusOr<OrthogonalTransformOp> op = OrthogonalTransformOp::FixedPart(*t);
  ASSERT_TRUE(op.ok());
  EXPECT_EQ(op->kind(), plan.kind == HadamardKind::kRfft ? OrthogonalTransformOp::Kind::kRfft
                                                         : OrthogonalTransformOp::Kind::kHadamard);
}

// pow2 (64, 256, 4096 = two 64-blocks), pow2·m (172 = 1·172, 688 = 4·172, 192 = 16·12), RFFT
// (176 = 2^4·11, 202 = 2·101).
INSTANTIATE_TEST_SUITE_P(Sizes, TransformTest,
                         ::testing::Values(64, 256, 4096, 172, 688, 192, 176, 202),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return absl::StrCat("d", info.param, "_",
                                               HadamardKindName(PlanHadamard(info.param).kind));
                         });

TEST(TransformTest, PlansAsExpected) {
  EXPECT_EQ(PlanHadamard(172).kind, HadamardKind::kPow2TimesM);
  EXPECT_EQ(PlanHadamard(688).kind, HadamardKind::kPow2TimesM);
  EXPECT_EQ(PlanHadamard(192).m, 12);
  EXPECT_EQ(PlanHadamard(176).kind, HadamardKind::kRfft);
  EXPECT_EQ(PlanHadamard(202).kind, HadamardKind::kRfft);
}

TEST(TransformTest, IdentityAndErrors) {
  OrthogonalTransformOp id = OrthogonalTransformOp::Identity(10);
  at::Tensor x = at::randn({4, 10});
  EXPECT_TRUE(at::equal(id.Forward(x), x));
  EXPECT_TRUE(at::equal(id.Inverse(x), x));
  EXPECT_FALSE(OrthogonalTransformOp::Hadamard(176).ok());  // RFFT size
  EXPECT_FALSE(OrthogonalTransformOp::Rfft(7, {}).ok());
  EXPECT_FALSE(OrthogonalTransformOp::Rfft(8, std::vector<std::complex<double>>(3)).ok());
  StatusOr<OrthogonalTransformOp> h = OrthogonalTransformOp::Hadamard(64);
  ASSERT_TRUE(h.ok());
  EXPECT_THROW(h->Forward(at::randn({2, 63})), c10::Error);
}

// ---------------------------------------------------------------------------------------------
// QuipLinear from a real quantization
// ---------------------------------------------------------------------------------------------

struct QuipCase {
  int64_t out, in;
  std::string codebook;
  bool incoherence;
  bool row_scales = false;  // one scale per row of the rotated weight (QuipLinearData::row_scales)
};

std::string CaseName(const ::testing::TestParamInfo<QuipCase>& info) {
  return absl::StrCat(info.param.out, "x", info.param.in, "_", info.param.codebook,
                      info.param.incoherence ? "_ip" : "_noip",
                      info.param.row_scales ? "_rowscale" : "");
}

// Per-row scales for `w` [rows, cols] (RMS(row) / ρ, as float; rows of very different size so the
// scales differ) and w divided by them row by row.
std::vector<float> RowScales(const std::vector<double>& w, int64_t rows, int64_t cols, double rho,
                             std::vector<double>* w_unit) {
  std::vector<float> s(rows);
  w_unit->resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j) ss += w[r * cols + j] * w[r * cols + j];
    s[r] = static_cast<float>(std::sqrt(ss / cols) / rho);
    for (int64_t j = 0; j < cols; ++j) (*w_unit)[r * cols + j] = w[r * cols + j] / s[r];
  }
  return s;
}

// Row-scaled rounding: BlockLDLQ on D⁻¹W at scale 1, then Ŵ = D·result (D = diag(row scales)).
StatusOr<kernels::VectorRoundingResult> RowScaledLdlq(const std::vector<double>& w, int64_t rows,
                                                      int64_t cols, const double* h,
                                                      const kernels::VectorCodebook& cb,
                                                      kernels::VectorRoundingConfig vcfg,
                                                      std::vector<float>* scales) {
  std::vector<double> w_unit;
  *scales = RowScales(w, rows, cols, cb.default_scale(), &w_unit);
  vcfg.scale = 1.0;
  QCAL_ASSIGN_OR_RETURN(kernels::VectorRoundingResult q,
                        kernels::BlockLdlq(w_unit.data(), rows, cols, h, cb, vcfg));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) q.w_hat[r * cols + j] *= (*scales)[r];
  }
  return q;
}

struct BuiltQuip {
  std::unique_ptr<QuipLinear> layer;
  at::Tensor expected;  // [out, in] float64: kernels' W-space quantized weights
};

// Random W [out, in] and SPD H [in, in]; pads in to a multiple of the codebook dimension (zero
// columns of W, zero rows/columns of H), runs IncoherenceProcess (optional) and BlockLDLQ, and
// builds the layer from the result.
void BuildQuip(const QuipCase& c, uint64_t salt, BuiltQuip* built) {
  StatusOr<std::unique_ptr<kernels::VectorCodebook>> cb = kernels::MakeCodebook(c.codebook);
  ASSERT_TRUE(cb.ok()) << cb.status();
  const int dim = (*cb)->dim();
  const int64_t out = c.out, in = c.in;
  const int64_t in_pad = (in + dim - 1) / dim * dim, out_pad = out;
  std::vector<double> w = Gaussian(out * in, salt + 1, 0.05);
  if (c.row_scales) {
    // Rows of very different norms (as in the nearly rank-1 q/k_proj), so the scales differ.
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t j = 0; j < in; ++j) w[r * in + j] *= 1.0 + 9.0 * (r % 7) / 6.0;
    }
  }
  std::vector<double> a = Gaussian(in * (in + 8), salt + 2);
  std::vector<double> w_pad(out * in_pad, 0.0), h_pad(in_pad * in_pad, 0.0);
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t j = 0; j < in; ++j) w_pad[r * in_pad + j] = w[r * in + j];
  }
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t j = 0; j < in; ++j) {
      double s = 0;
      for (int64_t k = 0; k < in + 8; ++k) s += a[i * (in + 8) + k] * a[j * (in + 8) + k];
      h_pad[i * in_pad + j] = s / (in + 8) + (i == j ? 0.1 : 0.0);
    }
  }
  kernels::VectorRoundingConfig vcfg;
  vcfg.num_threads = 1;
  QuipLinearData data;
  data.in_features = in;
  data.out_features = out;
  data.in_pad = in_pad;
  data.out_pad = out_pad;
  data.codebook = c.codebook;
  data.incoherence = c.incoherence;
  std::vector<double> expected;
  if (c.incoherence) {
    StatusOr<kernels::IncoherenceResult> ip = kernels::IncoherenceProcess(
        w_pad.data(), out_pad, in_pad, h_pad.data(), Rng(salt + 3)(), Rng(salt + 4)());
    ASSERT_TRUE(ip.ok()) << ip.status();
    StatusOr<kernels::VectorRoundingResult> q =
        c.row_scales ? RowScaledLdlq(ip->w_hat, out_pad, in_pad, ip->h_hat.data(), **cb, vcfg,
                                     &data.row_scales)
                     : kernels::BlockLdlq(ip->w_hat.data(), out_pad, in_pad, ip->h_hat.data(),
                                          **cb, vcfg);
    ASSERT_TRUE(q.ok()) << q.status();
    StatusOr<std::vector<double>> rec = kernels::RecoverWeights(ip->transforms, q->w_hat.data());
    ASSERT_TRUE(rec.ok()) << rec.status();
    expected = *std::move(rec);
    data.codes = q->codes;
    data.scale = c.row_scales ? 1.0 : q->scale;
    data.t_u = ip->transforms.u;
    data.t_v = ip->transforms.v;
  } else {
    StatusOr<kernels::VectorRoundingResult> q =
        c.row_scales
            ? RowScaledLdlq(w_pad, out_pad, in_pad, h_pad.data(), **cb, vcfg, &data.row_scales)
            : kernels::BlockLdlq(w_pad.data(), out_pad, in_pad, h_pad.data(), **cb, vcfg);
    ASSERT_TRUE(q.ok()) << q.status();
    expected = q->w_hat;
    data.codes = q->codes;
    data.scale = c.row_scales ? 1.0 : q->scale;
  }
  StatusOr<std::unique_ptr<QuipLinear>> layer = QuipLinear::Create(std::move(data));
  ASSERT_TRUE(layer.ok()) << layer.status();
  built->layer = *std::move(layer);
  built->expected = ToTensor(expected, {out_pad, in_pad}).narrow(1, 0, in).narrow(0, 0, out);
}

class QuipLinearTest : public ::testing::TestWithParam<QuipCase> {};

TEST_P(QuipLinearTest, ComputesTheQuantizedWeights) {
  QCAL_SEED_TRACE();
  const QuipCase& c = GetParam();
  BuiltQuip b;
  BuildQuip(c, 100, &b);
  if (HasFatalFailure()) return;
  QuipLinear& layer = *b.layer;
  EXPECT_EQ(layer.in_features(), c.in);
  EXPECT_EQ(layer.out_features(), c.out);
  at::Tensor dense = layer.DenseWeight();
  ASSERT_EQ(dense.sizes(), (std::vector<int64_t>{c.out, c.in}));
  ASSERT_EQ(dense.scalar_type(), at::kFloat);
  const double werr = RelErr(dense, b.expected);
  std::printf("[ info     ] %s: DenseWeight vs RecoverWeights rel err %.3g\n",
              CaseName({c, 0}).c_str(), werr);
  EXPECT_LE(werr, 1e-5);

  at::Tensor x = GaussianTensor({2, 7, c.in}, 200, at::kFloat);
  at::Tensor y = layer.Forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 7, c.out}));
  const double ferr = RelErr(y, at::matmul(x, dense.t()));
  std::printf("[ info     ] %s: Forward vs x@DenseWeightT rel err %.3g\n",
              CaseName({c, 0}).c_str(), ferr);
  EXPECT_LE(ferr, 1e-5);
  // Against the fp64 reference too.
  EXPECT_LE(RelErr(y, at::matmul(x.to(at::kDouble), b.expected.t())), 1e-5);
  // float64 inputs compute in float64.
  at::Tensor yd = layer.Forward(x.to(at::kDouble));
  EXPECT_EQ(yd.scalar_type(), at::kDouble);
  EXPECT_LE(RelErr(yd, at::matmul(x.to(at::kDouble), b.expected.t())), 1e-5);
}

TEST_P(QuipLinearTest, CheckpointRoundTripIsBitIdentical) {
  QCAL_SEED_TRACE();
  const QuipCase& c = GetParam();
  BuiltQuip b;
  BuildQuip(c, 300, &b);
  if (HasFatalFailure()) return;
  QuipLinear& layer = *b.layer;
  const std::string prefix = "model.layers.0.mlp.down_proj";
  at::Tensor x = GaussianTensor({5, c.in}, 301, at::kFloat);

  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      // Simulated fine-tuning: real-valued sign vectors.
      layer.su() = layer.su() * (1 + 0.1 * GaussianTensor({layer.data().out_pad}, 302, at::kFloat));
      layer.sv() = layer.sv() * (1 + 0.1 * GaussianTensor({layer.data().in_pad}, 303, at::kFloat));
    }
    const std::string dir = qcal::testing::MakeTempDir("quip_ckpt");
    SafetensorsWriter writer;
    ASSERT_TRUE(layer.AppendTensors(prefix, &writer).ok());
    ASSERT_TRUE(writer.Write(dir + "/model.safetensors").ok());
    StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    // Tensor dtypes.
    auto dtype_of = [&](const std::string& name) {
      auto f = (*ckpt)->Find(name);
      EXPECT_TRUE(f.ok()) << name;
      return f.ok() ? f->second->dtype : DType::kBool;
    };
    EXPECT_EQ(dtype_of(prefix + ".su"), DType::kF32);
    EXPECT_EQ(dtype_of(prefix + ".sv"), DType::kF32);
    EXPECT_EQ(dtype_of(prefix + ".scale"), DType::kF32);
    {
      auto f = (*ckpt)->Find(prefix + ".scale");
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(f->second->shape, c.row_scales ? std::vector<int64_t>{layer.data().out_pad}
                                               : std::vector<int64_t>{});
    }
    EXPECT_EQ(dtype_of(prefix + ".shape"), DType::kI64);
    const DType code_dtype = dtype_of(prefix + ".codes");
    const uint32_t max_code =
        *std::max_element(layer.data().codes.begin(), layer.data().codes.end());
    EXPECT_EQ(code_dtype, max_code > 255 ? DType::kU16 : DType::kU8);
    const bool rfft_v = c.incoherence && PlanHadamard(layer.data().in_pad).kind == HadamardKind::kRfft;
    EXPECT_EQ((*ckpt)->Has(prefix + ".phase_v"), rfft_v);
    if (rfft_v) {
      EXPECT_EQ(dtype_of(prefix + ".phase_v"), DType::kF64);
    }

    StatusOr<std::unique_ptr<QuipLinear>> loaded =
        QuipLinear::Load(**ckpt, prefix, c.codebook, c.incoherence);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_TRUE(at::equal((*loaded)->su(), layer.su()));
    EXPECT_TRUE(at::equal((*loaded)->sv(), layer.sv()));
    EXPECT_EQ((*loaded)->data().codes, layer.data().codes);
    EXPECT_EQ((*loaded)->data().row_scales, layer.data().row_scales);
    EXPECT_TRUE(at::equal((*loaded)->RotatedWeight(), layer.RotatedWeight()));
    EXPECT_TRUE(at::equal((*loaded)->Forward(x), layer.Forward(x))) << "round " << round;
    EXPECT_TRUE(at::equal((*loaded)->DenseWeight(), layer.DenseWeight())) << "round " << round;
    if (round == 0 && c.incoherence) {
      EXPECT_EQ((*loaded)->data().t_u.signs, layer.data().t_u.signs);
      EXPECT_EQ((*loaded)->data().t_v.signs, layer.data().t_v.signs);
      EXPECT_EQ((*loaded)->data().t_v.phases, layer.data().t_v.phases);
    }
    if (round == 1) {
      // The fine-tuned values changed the layer (the test is not vacuous).
      BuiltQuip fresh;
      BuildQuip(c, 300, &fresh);
      if (HasFatalFailure()) return;
      EXPECT_FALSE(at::equal(fresh.layer->Forward(x), (*loaded)->Forward(x)));
    }
  }
}

TEST_P(QuipLinearTest, GradientsReachSignVectors) {
  QCAL_SEED_TRACE();
  const QuipCase& c = GetParam();
  BuiltQuip b;
  BuildQuip(c, 400, &b);
  if (HasFatalFailure()) return;
  QuipLinear& layer = *b.layer;
  at::Tensor x = GaussianTensor({6, c.in}, 401, at::kDouble);  // fp64 for the finite difference
  const at::Tensor su0 = layer.su().clone(), sv0 = layer.sv().clone();
  layer.su().set_requires_grad(true);
  layer.sv().set_requires_grad(true);
  at::Tensor loss = layer.Forward(x).pow(2).sum();
  loss.backward();
  ASSERT_TRUE(layer.su().grad().defined());
  ASSERT_TRUE(layer.sv().grad().defined());
  const at::Tensor gsu = layer.su().grad().clone(), gsv = layer.sv().grad().clone();
  EXPECT_TRUE(at::isfinite(gsu).all().item<bool>());
  EXPECT_TRUE(at::isfinite(gsv).all().item<bool>());
  EXPECT_GT(gsu.narrow(0, 0, c.out).abs().max().item<double>(), 0);
  EXPECT_GT(gsv.narrow(0, 0, c.in).abs().max().item<double>(), 0);
  // Padded input coordinates multiply zeros: no gradient.
  if (layer.data().in_pad > c.in) {
    EXPECT_EQ(gsv.narrow(0, c.in, layer.data().in_pad - c.in).abs().max().item<double>(), 0);
  }

  // Central differences (exact for a loss quadratic in the coordinate) with h = 2^-8.
  const double h = 1.0 / 256;
  auto loss_at = [&](bool is_u, int64_t i, double delta) {
    at::Tensor su = su0.clone(), sv = sv0.clone();
    (is_u ? su : sv)[i] += delta;
    layer.su() = su;
    layer.sv() = sv;
    return layer.Forward(x).pow(2).sum().item<double>();
  };
  std::mt19937_64 rng = Rng(402);
  for (int k = 0; k < 3; ++k) {
    const int64_t iu = static_cast<int64_t>(rng() % c.out);
    const int64_t iv = static_cast<int64_t>(rng() % c.in);
    const double fd_u = (loss_at(true, iu, h) - loss_at(true, iu, -h)) / (2 * h);
    const double fd_v = (loss_at(false, iv, h) - loss_at(false, iv, -h)) / (2 * h);
    const double g_u = gsu[iu].item<double>(), g_v = gsv[iv].item<double>();
    const double scale = std::max(1.0, loss.item<double>());
    EXPECT_NEAR(g_u, fd_u, 1e-6 * scale) << "su[" << iu << "]";
    EXPECT_NEAR(g_v, fd_v, 1e-6 * scale) << "sv[" << iv << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuipLinearTest,
    ::testing::Values(QuipCase{64, 172, "e8p", true},            // in_pad 176: RFFT on V
                      QuipCase{172, 64, "e8p", true},            // out 172: H_172 on U
                      QuipCase{64, 64, "e8p", true},             // pow2 both sides
                      QuipCase{64, 172, "rvq4_e8p_e8p", true},   // two code words
                      QuipCase{172, 64, "rvq4_e8p_e8p", true},
                      QuipCase{64, 172, "halfint2", true},       // dim 1: in_pad 172 = H_172
                      QuipCase{64, 64, "halfint2", true},
                      QuipCase{64, 172, "e8p", false},           // identity transforms
                      QuipCase{172, 64, "halfint2", false},
                      // One scale per row of the rotated weight.
                      QuipCase{64, 172, "e8p", true, true},
                      QuipCase{172, 64, "e8p", true, true},
                      QuipCase{172, 64, "rvq4_e8p_e8p", true, true},
                      QuipCase{64, 172, "halfint2", true, true},
                      QuipCase{172, 64, "rvq3_e8p_e8", false, true}),
    CaseName);

// ---------------------------------------------------------------------------------------------
// QuipLinear: bad data
// ---------------------------------------------------------------------------------------------

void ExpectError(const Status& s, absl::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(std::string(s.message()).find(fragment), std::string::npos)
      << "message '" << s.message() << "' lacks '" << fragment << "'";
}

QuipLinearData ValidQuipData() {
  QuipLinearData d;
  d.in_features = 60;
  d.out_features = 30;
  d.in_pad = 64;
  d.out_pad = 32;
  d.codebook = "e8p";
  d.codes.assign(32 * 8, 0x1234);
  d.scale = 0.5;
  d.t_u = *kernels::MakeRandomizedTransform(32, 1);
  d.t_v = *kernels::MakeRandomizedTransform(64, 2);
  return d;
}

TEST(QuipLinearErrors, RejectsBadData) {
  ASSERT_TRUE(QuipLinear::Create(ValidQuipData()).ok());
  {
    QuipLinearData d = ValidQuipData();
    d.codes.pop_back();
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "255 code words given, expected 256");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.codebook = "e9q";
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "unknown codebook 'e9q'");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.in_pad = 60;
    d.in_features = 60;
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "not a multiple of codebook 'e8p' dimension 8");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.in_pad = 56;
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "smaller than the features");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.t_v = *kernels::MakeRandomizedTransform(128, 2);
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "transform V has dimension 128, expected 64");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.codes[3] = 70000;
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "does not fit 16 bits");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.scale = 0;
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument, "scale");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.row_scales.assign(31, 0.5f);
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "31 row scales given, expected 32");
    d.row_scales.assign(32, 0.5f);
    EXPECT_TRUE(QuipLinear::Create(d).ok());
    d.row_scales[7] = 0;
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "row scale 7 = 0");
    d.row_scales[7] = std::nanf("");
    ExpectError(QuipLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "row scale 7");
  }
  {
    QuipLinearData d = ValidQuipData();
    d.incoherence = false;
    d.t_u = {};
    d.t_v = {};
    EXPECT_TRUE(QuipLinear::Create(d).ok());
  }
}

// Copies every tensor of `src` except `drop` into dir/model.safetensors.
void CopyWithout(const std::string& src, const std::string& dir, const std::string& drop) {
  StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(src);
  ASSERT_TRUE(f.ok()) << f.status();
  SafetensorsWriter w;
  for (const TensorInfo& t : (*f)->tensors()) {
    if (t.name == drop) continue;
    ASSERT_TRUE(w.Add(t.name, t.dtype, t.shape, (*f)->Data(t), t.nbytes()).ok());
  }
  ASSERT_TRUE(w.Write(dir + "/model.safetensors").ok());
}

TEST(QuipLinearErrors, MissingTensorIsNamed) {
  StatusOr<std::unique_ptr<QuipLinear>> layer = QuipLinear::Create(ValidQuipData());
  ASSERT_TRUE(layer.ok());
  const std::string full = qcal::testing::MakeTempDir("quip_full");
  SafetensorsWriter w;
  ASSERT_TRUE((*layer)->AppendTensors("blk.q", &w).ok());
  ASSERT_TRUE(w.Write(full + "/model.safetensors").ok());
  for (const char* name : {"codes", "su", "sv", "scale", "shape"}) {
    const std::string dir = qcal::testing::MakeTempDir("quip_missing");
    CopyWithout(full + "/model.safetensors", dir, std::string("blk.q.") + name);
    StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(dir);
    ASSERT_TRUE(ckpt.ok());
    StatusOr<std::unique_ptr<QuipLinear>> loaded = QuipLinear::Load(**ckpt, "blk.q", "e8p", true);
    ExpectError(loaded.status(), absl::StatusCode::kNotFound, std::string("blk.q.") + name);
  }
  // Wrong codebook for the stored codes: a shape mismatch naming the tensor.
  StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(full);
  ASSERT_TRUE(ckpt.ok());
  ExpectError(QuipLinear::Load(**ckpt, "blk.q", "rvq4_e8p_e8p", true).status(),
              absl::StatusCode::kInvalidArgument, "tensor 'blk.q.codes' has shape");
  ExpectError(QuipLinear::Load(**ckpt, "blk.q", "nope", true).status(),
              absl::StatusCode::kInvalidArgument, "unknown codebook 'nope'");
}

TEST(QuipLinearErrors, MissingPhasesAreNamed) {
  QuipLinearData d = ValidQuipData();
  d.in_features = 170;
  d.in_pad = 176;  // RFFT
  d.codes.assign(32 * 22, 7);
  d.t_v = *kernels::MakeRandomizedTransform(176, 3);
  StatusOr<std::unique_ptr<QuipLinear>> layer = QuipLinear::Create(d);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const std::string full = qcal::testing::MakeTempDir("quip_full");
  SafetensorsWriter w;
  ASSERT_TRUE((*layer)->AppendTensors("blk.k", &w).ok());
  ASSERT_TRUE(w.Write(full + "/model.safetensors").ok());
  const std::string dir = qcal::testing::MakeTempDir("quip_missing");
  CopyWithout(full + "/model.safetensors", dir, "blk.k.phase_v");
  StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  ExpectError(QuipLinear::Load(**ckpt, "blk.k", "e8p", true).status(), absl::StatusCode::kNotFound,
              "blk.k.phase_v");
  // Without incoherence the phases are not needed.
  EXPECT_TRUE(QuipLinear::Load(**ckpt, "blk.k", "e8p", false).ok());
}

// ---------------------------------------------------------------------------------------------
// ScalarQuantLinear
// ---------------------------------------------------------------------------------------------

struct ScalarCase {
  const char* name;
  bool gptq;  // else RTN
  int bits;
  bool symmetric;
  int64_t group_size;  // -1 per channel
  bool act_order;
};

class ScalarQuantLinearTest : public ::testing::TestWithParam<ScalarCase> {};

constexpr int64_t kOut = 64, kIn = 128;

ScalarLinearData FromResult(const kernels::ScalarRoundingResult& r, const ScalarCase& c) {
  ScalarLinearData d;
  d.in_features = r.cols;
  d.out_features = r.rows;
  d.bits = c.bits;
  d.symmetric = c.symmetric;
  d.group_size = c.group_size;
  d.codes = r.codes;
  d.scales.assign(r.scales.begin(), r.scales.end());
  d.zeros = r.zeros;
  d.g_idx = r.g_idx;
  return d;
}

void Quantize(const ScalarCase& c, kernels::ScalarRoundingResult* out) {
  std::vector<double> w = Gaussian(kOut * kIn, 500 + c.bits, 0.02);
  // Some outlier columns so act-order matters.
  for (int64_t r = 0; r < kOut; ++r) w[r * kIn + 5] *= 8;
  kernels::ScalarQuantConfig q;
  q.bits = c.bits;
  q.symmetric = c.symmetric;
  q.granularity =
      c.group_size == -1 ? kernels::QuantGranularity::kPerChannel : kernels::QuantGranularity::kPerGroup;
  if (c.group_size > 0) q.group_size = c.group_size;
  StatusOr<kernels::ScalarRoundingResult> r;
  if (c.gptq) {
    std::vector<double> a = Gaussian(kIn * (kIn + 16), 600);
    std::vector<double> h(kIn * kIn);
    for (int64_t i = 0; i < kIn; ++i) {
      for (int64_t j = 0; j < kIn; ++j) {
        double s = 0;
        for (int64_t k = 0; k < kIn + 16; ++k) s += a[i * (kIn + 16) + k] * a[j * (kIn + 16) + k];
        h[i * kIn + j] = s * (1.0 + (i == 7 && j == 7 ? 10 : 0));
      }
    }
    kernels::ScalarRoundingConfig cfg;
    cfg.quant = q;
    cfg.act_order = c.act_order;
    r = kernels::Gptq(w.data(), kOut, kIn, h.data(), cfg);
  } else {
    r = kernels::RoundToNearest(w.data(), kOut, kIn, q);
  }
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->param_rows, kOut);
  *out = *std::move(r);
}

// Reads raw little-endian values of a tensor.
template <typename T>
std::vector<T> RawTensor(CheckpointReader& ckpt, const std::string& name, DType dtype,
                         std::vector<int64_t> shape) {
  auto f = ckpt.Find(name);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  EXPECT_EQ(f->second->dtype, dtype) << name;
  EXPECT_EQ(f->second->shape, shape) << name;
  std::vector<T> v(f->second->numel());
  std::memcpy(v.data(), f->first->Data(*f->second), v.size() * sizeof(T));
  return v;
}

// AutoGPTQ's QuantLinear.pack (qlinear_cuda_old.py), ported literally for one column of
// `values` (stride 1) into `nwords` words: 2/4/8 bits pack 32/bits values per word; 3 bits use
// the three-word pattern with values straddling words 0/1 and 1/2.
std::vector<uint32_t> AutoGptqPack(const std::vector<uint32_t>& v, int bits) {
  std::vector<uint32_t> q(v.size() * bits / 32, 0);
  size_t i = 0, row = 0;
  while (row < q.size()) {
    if (bits == 2 || bits == 4 || bits == 8) {
      for (size_t j = i; j < i + 32 / bits; ++j) q[row] |= v[j] << (bits * (j - i));
      i += 32 / bits;
      row += 1;
    } else {  // bits == 3
      for (size_t j = i; j < i + 10; ++j) q[row] |= v[j] << (3 * (j - i));
      i += 10;
      q[row] |= v[i] << 30;
      row += 1;
      q[row] |= (v[i] >> 2) & 1;
      i += 1;
      for (size_t j = i; j < i + 10; ++j) q[row] |= v[j] << (3 * (j - i) + 1);
      i += 10;
      q[row] |= v[i] << 31;
      row += 1;
      q[row] |= (v[i] >> 1) & 0x3;
      i += 1;
      for (size_t j = i; j < i + 10; ++j) q[row] |= v[j] << (3 * (j - i) + 2);
      i += 10;
      row += 1;
    }
  }
  return q;
}

// Value j of a little-endian bit stream of `bits`-bit values.
uint32_t Unpack(const std::vector<uint32_t>& words, int64_t j, int bits) {
  const int64_t bit = j * bits, w = bit / 32, shift = bit % 32;
  uint64_t v = words[w] >> shift;
  if (shift + bits > 32) v |= static_cast<uint64_t>(words[w + 1]) << (32 - shift);
  return static_cast<uint32_t>(v & ((1u << bits) - 1));
}

TEST_P(ScalarQuantLinearTest, MatchesRoundingResultAndRoundTrips) {
  QCAL_SEED_TRACE();
  const ScalarCase& c = GetParam();
  kernels::ScalarRoundingResult r;
  Quantize(c, &r);
  if (HasFatalFailure()) return;
  StatusOr<std::unique_ptr<ScalarQuantLinear>> layer = ScalarQuantLinear::Create(FromResult(r, c));
  ASSERT_TRUE(layer.ok()) << layer.status();
  const at::Tensor w_hat = ToTensor(r.w_hat, {kOut, kIn});
  EXPECT_LE(RelErr((*layer)->DenseWeight(), w_hat), 1e-6);
  at::Tensor x = GaussianTensor({3, 4, kIn}, 700, at::kFloat);
  at::Tensor y = (*layer)->Forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 4, kOut}));
  EXPECT_LE(RelErr(y, at::matmul(x.to(at::kDouble), w_hat.t())), 1e-5);
  EXPECT_TRUE(at::equal(y, at::matmul(x, (*layer)->DenseWeight().t())));

  // Round trip.
  const std::string dir = qcal::testing::MakeTempDir("scalar_ckpt");
  const std::string prefix = "model.layers.1.self_attn.o_proj";
  SafetensorsWriter writer;
  ASSERT_TRUE((*layer)->AppendTensors(prefix, &writer).ok());
  ASSERT_TRUE(writer.Write(dir + "/model.safetensors").ok());
  StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  StatusOr<std::unique_ptr<ScalarQuantLinear>> loaded = ScalarQuantLinear::Load(**ckpt, prefix);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(at::equal((*loaded)->Forward(x), y));
  EXPECT_TRUE(at::equal((*loaded)->DenseWeight(), (*layer)->DenseWeight()));
  EXPECT_EQ((*loaded)->data().codes, r.codes);
  EXPECT_EQ((*loaded)->data().g_idx, r.g_idx);
  EXPECT_EQ((*loaded)->data().zeros, r.zeros);
  EXPECT_EQ((*loaded)->data().bits, c.bits);
  EXPECT_EQ((*loaded)->data().symmetric, c.symmetric);
  EXPECT_EQ((*loaded)->data().group_size, c.group_size);
  const int64_t groups = r.param_cols;
  EXPECT_EQ(groups, c.group_size == -1 ? 1 : kIn / c.group_size);

  // GPTQ layout: unpack and compare with the codes; compare the packing with AutoGPTQ's.
  const int b = c.bits;
  ASSERT_TRUE((*layer)->GptqExportable());
  std::vector<int32_t> qweight =
      RawTensor<int32_t>(**ckpt, prefix + ".qweight", DType::kI32, {kIn * b / 32, kOut});
  std::vector<int32_t> qzeros =
      RawTensor<int32_t>(**ckpt, prefix + ".qzeros", DType::kI32, {groups, kOut * b / 32});
  std::vector<uint16_t> scales16 =
      RawTensor<uint16_t>(**ckpt, prefix + ".scales_gptq", DType::kF16, {groups, kOut});
  std::vector<int32_t> g_idx = RawTensor<int32_t>(**ckpt, prefix + ".g_idx", DType::kI32, {kIn});
  ASSERT_FALSE(qweight.empty() || qzeros.empty() || scales16.empty());
  EXPECT_EQ(g_idx, r.g_idx);
  const uint32_t offset = c.symmetric ? (1u << (b - 1)) : 0u;
  const uint32_t mask = (1u << b) - 1;
  const int64_t wrows = kIn * b / 32, zcols = kOut * b / 32;
  int64_t mismatches = 0, pack_mismatches = 0;
  double max_w_err = 0, max_w = 0;
  for (int64_t col = 0; col < kOut; ++col) {
    std::vector<uint32_t> words(wrows), u(kIn);
    for (int64_t w = 0; w < wrows; ++w) words[w] = static_cast<uint32_t>(qweight[w * kOut + col]);
    for (int64_t j = 0; j < kIn; ++j) {
      u[j] = static_cast<uint32_t>(r.codes[col * kIn + j]) + offset;
      if (static_cast<int64_t>(Unpack(words, j, b)) - static_cast<int64_t>(offset) !=
          r.codes[col * kIn + j]) {
        ++mismatches;
      }
    }
    if (AutoGptqPack(u, b) != words) ++pack_mismatches;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(pack_mismatches, 0);
  // Zeros: stored zero − 1 (AutoGPTQ v1); the kernels add 1 back.
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<uint32_t> words(zcols), zm1(kOut);
    for (int64_t w = 0; w < zcols; ++w) words[w] = static_cast<uint32_t>(qzeros[g * zcols + w]);
    for (int64_t col = 0; col < kOut; ++col) {
      const uint32_t zero = c.symmetric ? offset : static_cast<uint32_t>(r.zeros[col * groups + g]);
      zm1[col] = (zero - 1) & mask;
      EXPECT_EQ((Unpack(words, col, b) + 1) & mask, zero & mask) << "group " << g << " col " << col;
    }
    EXPECT_EQ(AutoGptqPack(zm1, b), words) << "qzeros group " << g;
  }
  // Dequantize the GPTQ tensors as an engine would: scale16 · (u − (stored_zero + 1)).
  for (int64_t col = 0; col < kOut; ++col) {
    std::vector<uint32_t> words(wrows);
    for (int64_t w = 0; w < wrows; ++w) words[w] = static_cast<uint32_t>(qweight[w * kOut + col]);
    for (int64_t j = 0; j < kIn; ++j) {
      const int64_t g = g_idx[j];
      std::vector<uint32_t> zw(zcols);
      for (int64_t w = 0; w < zcols; ++w) zw[w] = static_cast<uint32_t>(qzeros[g * zcols + w]);
      const double z = Unpack(zw, col, b) + 1.0;
      if (!c.symmetric && r.zeros[col * groups + g] == 0) continue;  // the v1 format's wrap
      const double wq = HalfToFloat(scales16[g * kOut + col]) * (Unpack(words, j, b) - z);
      max_w_err = std::max(max_w_err, std::abs(wq - r.w_hat[col * kIn + j]));
      max_w = std::max(max_w, std::abs(r.w_hat[col * kIn + j]));
    }
  }
  EXPECT_LE(max_w_err, 1e-3 * max_w);  // fp16 scales
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ScalarQuantLinearTest,
    ::testing::Values(ScalarCase{"rtn_sym4_channel", false, 4, true, -1, false},
                      ScalarCase{"rtn_asym4_g32", false, 4, false, 32, false},
                      ScalarCase{"gptq_sym4_g32_actorder", true, 4, true, 32, true},
                      ScalarCase{"gptq_asym4_channel", true, 4, false, -1, false},
                      ScalarCase{"gptq_asym3_g32_actorder", true, 3, false, 32, true},
                      ScalarCase{"gptq_sym3_channel", true, 3, true, -1, false},
                      ScalarCase{"gptq_sym2_g32", true, 2, true, 32, false},
                      ScalarCase{"gptq_asym8_g32_actorder", true, 8, false, 32, true}),
    [](const ::testing::TestParamInfo<ScalarCase>& info) { return std::string(info.param.name); });

ScalarLinearData ValidScalarData() {
  ScalarLinearData d;
  d.in_features = 8;
  d.out_features = 2;
  d.bits = 4;
  d.symmetric = true;
  d.group_size = 4;
  d.codes = {-8, -1, 0, 7, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7, -8};
  d.scales = {0.5f, 0.25f, 1.0f, 2.0f};
  d.zeros = {0, 0, 0, 0};
  return d;
}

TEST(ScalarQuantLinearErrors, RejectsBadData) {
  StatusOr<std::unique_ptr<ScalarQuantLinear>> ok = ScalarQuantLinear::Create(ValidScalarData());
  ASSERT_TRUE(ok.ok()) << ok.status();
  // Hand-checked dequantization: row 0, column 3 = 0.5 · 7; row 1, column 7 = 2 · (−8).
  EXPECT_EQ((*ok)->DenseWeight()[0][3].item<float>(), 3.5f);
  EXPECT_EQ((*ok)->DenseWeight()[1][7].item<float>(), -16.0f);
  EXPECT_EQ((*ok)->data().g_idx, (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  {
    ScalarLinearData d = ValidScalarData();
    d.codes.pop_back();
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "15 codes given, expected 16");
  }
  {
    ScalarLinearData d = ValidScalarData();
    d.codes[2] = 8;
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "outside the 4-bit grid [-8, 7]");
  }
  {
    ScalarLinearData d = ValidScalarData();
    d.scales.pop_back();
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "3 scales and 4 zeros given, expected 4");
  }
  {
    ScalarLinearData d = ValidScalarData();
    d.g_idx = {0, 0, 0, 0, 1, 1, 1, 2};
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "g_idx[7] = 2 outside [0, 2)");
  }
  {
    ScalarLinearData d = ValidScalarData();
    d.bits = 1;
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "bits = 1");
  }
  {
    ScalarLinearData d = ValidScalarData();
    d.scales[1] = -1;
    ExpectError(ScalarQuantLinear::Create(d).status(), absl::StatusCode::kInvalidArgument,
                "not positive");
  }
  // GPTQ export: 5 bits is not an AutoGPTQ packing; 2x8 at 4 bits does not fill whole words.
  {
    ScalarLinearData d = ValidScalarData();
    d.bits = 5;
    StatusOr<std::unique_ptr<ScalarQuantLinear>> l = ScalarQuantLinear::Create(d);
    ASSERT_TRUE(l.ok());
    EXPECT_FALSE((*l)->GptqExportable());
    ExpectError((*l)->ExportGptq().status(), absl::StatusCode::kInvalidArgument,
                "supports 2, 3, 4 and 8 bits");
    SafetensorsWriter w;  // the qcal tensors are still written
    EXPECT_TRUE((*l)->AppendTensors("x", &w).ok());
  }
  ExpectError((*ok)->ExportGptq().status(), absl::StatusCode::kInvalidArgument,
              "multiples of 32");
}

TEST(ScalarQuantLinearErrors, MissingTensorIsNamed) {
  StatusOr<std::unique_ptr<ScalarQuantLinear>> layer = ScalarQuantLinear::Create(ValidScalarData());
  ASSERT_TRUE(layer.ok());
  const std::string full = qcal::testing::MakeTempDir("scalar_full");
  SafetensorsWriter w;
  ASSERT_TRUE((*layer)->AppendTensors("blk.o", &w).ok());
  ASSERT_TRUE(w.Write(full + "/model.safetensors").ok());
  for (const char* name : {"codes", "scales", "zeros", "g_idx", "qconfig"}) {
    const std::string dir = qcal::testing::MakeTempDir("scalar_missing");
    CopyWithout(full + "/model.safetensors", dir, std::string("blk.o.") + name);
    StatusOr<std::unique_ptr<CheckpointReader>> ckpt = CheckpointReader::Open(dir);
    ASSERT_TRUE(ckpt.ok());
    ExpectError(ScalarQuantLinear::Load(**ckpt, "blk.o").status(), absl::StatusCode::kNotFound,
                std::string("blk.o.") + name);
  }
}

}  // namespace
}  // namespace qcal::quant
