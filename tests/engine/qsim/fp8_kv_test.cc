// The FP8 E4M3 KV cache (engine/qsim/fp8_kv.h) against an independent E4M3 table: all 256 codes
// decoded from their bit fields, the nearest finite one chosen by search with ties to the even
// code, saturation at ±448.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/quant_specs.h"
#include "engine/qsim/fp8_kv.h"
#include "engine/qsim/kv_quantizer.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

// The finite E4M3 values with their codes' low bit, ascending (negative ones included).
struct Code {
  double value;
  int lsb;
};
std::vector<Code> E4M3Table() {
  std::vector<Code> t;
  for (int bits = 0; bits < 256; ++bits) {
    const int sign = bits >> 7, e = (bits >> 3) & 15, m = bits & 7;
    if (e == 15 && m == 7) continue;  // NaN
    const double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
    if (sign && mag == 0) continue;  // -0: the same value as +0
    t.push_back({sign ? -mag : mag, bits & 1});
  }
  std::sort(t.begin(), t.end(), [](const Code& a, const Code& b) { return a.value < b.value; });
  return t;
}

double NearestE4M3(const std::vector<Code>& t, double y) {
  if (y >= 448) return 448;
  if (y <= -448) return -448;
  const Code* best = &t[0];
  for (const Code& c : t) {
    const double d = std::abs(c.value - y), b = std::abs(best->value - y);
    if (d < b || (d == b && c.lsb == 0 && best->lsb == 1)) best = &c;
  }
  return best->value;
}

TEST(Fp8E4M3Test, RoundsAsTheTableWithTiesToEvenAndSaturates) {
  const std::vector<Code> table = E4M3Table();
  ASSERT_EQ(table.size(), 253u);  // 254 finite codes, ±0 counted once
  EXPECT_EQ(table.back().value, 448.0);
  EXPECT_EQ(table[table.size() / 2].value, 0.0);
  std::vector<float> y;
  // Every value, every midpoint between neighbours (ties), and points just off them.
  for (size_t i = 0; i + 1 < table.size(); ++i) {
    const double a = table[i].value, b = table[i + 1].value, mid = (a + b) / 2;
    for (double v : {a, mid}) {
      const float f = static_cast<float>(v);
      y.push_back(f);
      y.push_back(std::nextafter(f, 1e9f));
      y.push_back(std::nextafter(f, -1e9f));
    }
  }
  for (float v : {448.0f, 463.9f, 464.0f, 1e6f, -500.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), 1e-12f, -1e-12f}) {
    y.push_back(v);
  }
  std::mt19937_64 rng(testing::TestSeed());
  std::normal_distribution<float> normal(0, 30);
  for (int i = 0; i < 4000; ++i) y.push_back(normal(rng) * std::ldexp(1.0f, (int)(rng() % 24) - 16));
  const at::Tensor in = at::from_blob(y.data(), {static_cast<int64_t>(y.size())}, at::kFloat).clone();
  const at::Tensor out = qsim::RoundToFp8E4M3(in);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_EQ(out[i].item<float>(), static_cast<float>(NearestE4M3(table, y[i]))) << y[i];
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(qsim::RoundToFp8E4M3(at::full({1}, nan))[0].item<float>()));
}

TEST(Fp8KvQuantizerTest, StaticScalesFromTheRangesAndQueriesPass) {
  EXPECT_EQ(qsim::Fp8StaticScale(-3.5, 2.0), static_cast<float>(3.5 / 448));
  EXPECT_EQ(qsim::Fp8StaticScale(0, 0), 1.0f);
  qsim::KvStaticRanges r;
  r.lo[0] = -8.96;
  r.hi[0] = 4.0;
  r.lo[1] = -1.0;
  r.hi[1] = 44.8;
  auto q = qsim::Fp8KvQuantizer::FromRanges(r);
  ASSERT_TRUE(q.ok()) << q.status();
  const float sk = static_cast<float>(8.96 / 448), sv = static_cast<float>(44.8 / 448);
  EXPECT_EQ((*q)->scale(qsim::KvRole::kKey), sk);
  EXPECT_EQ((*q)->scale(qsim::KvRole::kValue), sv);
  at::manual_seed(testing::TestSeed());
  const at::Tensor k = at::randn({2, 3, 5, 16}) * 3;
  // Per element: e4m3(k / s) · s with the float32 quotient and product.
  const at::Tensor got = (*q)->Apply(k, qsim::KvRole::kKey);
  const std::vector<Code> table = E4M3Table();
  const at::Tensor kf = k.contiguous().view({-1}), gf = got.contiguous().view({-1});
  for (int64_t i = 0; i < kf.numel(); ++i) {
    volatile float quotient = kf[i].item<float>() / sk;
    const float want = static_cast<float>(NearestE4M3(table, quotient)) * sk;
    ASSERT_EQ(gf[i].item<float>(), want) << i;
  }
  // Beyond the calibrated range: saturated at 448 · s.
  EXPECT_EQ((*q)->Apply(at::full({1}, 100.0f), qsim::KvRole::kKey)[0].item<float>(), 448 * sk);
  const at::Tensor query = at::randn({2, 4});
  EXPECT_TRUE((*q)->Apply(query, qsim::KvRole::kQuery).is_same(query));
  EXPECT_FALSE(qsim::Fp8KvQuantizer::Create(0.0f, 1.0f).ok());
  // The recipe path: format fp8 needs its calibrated ranges.
  KvCacheSpec spec;
  spec.bits = 8;
  spec.format = "fp8";
  spec.granularity = "per_tensor";
  spec.is_static = true;
  LlamaConfig config;
  config.hidden_size = 64;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 16;
  EXPECT_FALSE(qsim::MakeKvQuantizer(spec, config, 0, nullptr).ok());
  auto made = qsim::MakeKvQuantizer(spec, config, 0, &r);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_TRUE(at::equal((*made)->Apply(k, qsim::KvRole::kKey), got));
}

}  // namespace
}  // namespace qcal
