// Rounding on Hessians computed from stories260K's activations (QuIP# §4, issue "quantization
// core"): LDLQ beats RTN and BlockLDLQ-E8P beats nearest E8P rounding on every linear of every
// block, measured by the proxy loss tr((Ŵ − W) H (Ŵ − W)ᵀ); refinement sweeps (issue 13) lower
// that loss on every linear for QuIP# at 2, 3 and 4 bits (per-row and per-matrix scales) and
// for GPTQ.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/text.h"
#include "common/tokenizer.h"
#include "kernels/codebook.h"
#include "kernels/incoherence.h"
#include "kernels/rounding.h"
#include "methods/quip/quip_rounding.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/calib/hessian.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

using model::LinearKind;

std::vector<double> ToDoubleVector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

class RealHessianTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    const std::string dir = testing::RealModelDir("stories260K");
    auto m = model::LlamaModel::Load(dir);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
    auto tok = LoadTokenizerFromModelDir(dir);
    ASSERT_TRUE(tok.ok());
    auto text = ReadTextFile(testing::SharedDir() +
                             "/data/tinystories/TinyStories-valid.sample30k.txt");
    ASSERT_TRUE(text.ok());
    std::vector<int32_t> ids = (*tok)->Encode(*text);
    // 24 sequences of BOS + 127 tokens.
    constexpr int64_t kSeqs = 24, kLen = 128;
    ASSERT_GE(ids.size(), static_cast<size_t>(kSeqs * (kLen - 1)));
    at::Tensor tokens = at::empty({kSeqs, kLen}, at::kLong);
    auto acc = tokens.accessor<int64_t, 2>();
    for (int64_t s = 0; s < kSeqs; ++s) {
      acc[s][0] = 1;
      for (int64_t j = 1; j < kLen; ++j) acc[s][j] = ids[s * (kLen - 1) + j - 1];
    }
    hessians_ = new std::vector<calib::BlockHessians>(model_->num_blocks());
    at::Tensor x = model_->Embed(tokens);
    for (int64_t l = 0; l < model_->num_blocks(); ++l) {
      auto y = calib::ForwardCollectingHessians(model_->mutable_block(l), x, model_->rope(), 8,
                                                &(*hessians_)[l]);
      ASSERT_TRUE(y.ok()) << y.status();
      x = *y;
    }
  }
  static void TearDownTestSuite() {
    delete model_;
    delete hessians_;
  }
  static model::LlamaModel* model_;
  static std::vector<calib::BlockHessians>* hessians_;
};

model::LlamaModel* RealHessianTest::model_ = nullptr;
std::vector<calib::BlockHessians>* RealHessianTest::hessians_ = nullptr;

TEST_F(RealHessianTest, HessiansAreSymmetricPositiveAndCountTokens) {
  for (const auto& bh : *hessians_) {
    for (calib::HessianKind k : calib::kAllHessianKinds) {
      const auto& acc = bh.at(k);
      EXPECT_EQ(acc.count(), 24 * 128) << calib::HessianKindName(k);
      at::Tensor h = acc.Mean();
      EXPECT_TRUE(at::allclose(h, h.t())) << calib::HessianKindName(k);
      EXPECT_GT(h.diagonal().min().item<double>(), 0.0) << calib::HessianKindName(k);
    }
  }
  // Collecting left the model unchanged: same logits as a fresh forward.
  at::Tensor ids = at::arange(1, 40, at::kLong).unsqueeze(0);
  at::Tensor h = model_->Embed(ids);
  for (int64_t l = 0; l < model_->num_blocks(); ++l) h = model_->block(l).Forward(h, model_->rope());
  EXPECT_TRUE(at::equal(model_->Head(h), model_->Forward(ids)));
}

TEST_F(RealHessianTest, LdlqBeatsRtnAndBlockLdlqBeatsNearestE8p) {
  auto e8p = kernels::MakeCodebook("e8p");
  ASSERT_TRUE(e8p.ok()) << e8p.status();
  std::printf("%-6s %-18s %12s %12s %8s %12s %12s %8s\n", "block", "linear", "RTN-2b", "LDLQ-2b",
              "ratio", "near-E8P", "BlockLDLQ", "ratio");
  for (int64_t l = 0; l < model_->num_blocks(); ++l) {
    for (LinearKind k : model::kAllLinears) {
      at::Tensor wt = model_->block(l).weights().linear(k).DenseWeight();
      const int64_t rows = wt.size(0), cols = wt.size(1);
      std::vector<double> w = ToDoubleVector(wt);
      std::vector<double> h = ToDoubleVector((*hessians_)[l].at(calib::HessianKindOf(k)).Mean());

      kernels::ScalarRoundingConfig sc;
      sc.quant.bits = 2;
      sc.quant.granularity = kernels::QuantGranularity::kPerChannel;
      auto rtn = kernels::RoundToNearest(w.data(), rows, cols, sc.quant);
      auto ldlq = kernels::Ldlq(w.data(), rows, cols, h.data(), sc);
      ASSERT_TRUE(rtn.ok() && ldlq.ok()) << rtn.status() << ldlq.status();
      const double loss_rtn = kernels::ProxyLoss(w.data(), rtn->w_hat.data(), h.data(), rows, cols);
      const double loss_ldlq =
          kernels::ProxyLoss(w.data(), ldlq->w_hat.data(), h.data(), rows, cols);
      EXPECT_LT(loss_ldlq, loss_rtn) << "block " << l << " " << model::LinearName(k);

      // E8P on the incoherence-processed weights (QuIP#): cols must be a multiple of 8, so
      // down_proj (172 inputs) is left to the pipeline's padding.
      double loss_near = NAN, loss_block = NAN;
      if (cols % 8 == 0) {
        auto ip = kernels::IncoherenceProcess(w.data(), rows, cols, h.data(), 1000 + l, 2000 + l);
        ASSERT_TRUE(ip.ok()) << ip.status();
        kernels::VectorRoundingConfig vc;
        vc.num_threads = 1;
        auto near = kernels::NearestVectorRounding(ip->w_hat.data(), rows, cols, **e8p, vc);
        auto block = kernels::BlockLdlq(ip->w_hat.data(), rows, cols, ip->h_hat.data(), **e8p, vc);
        ASSERT_TRUE(near.ok() && block.ok()) << near.status() << block.status();
        loss_near = kernels::ProxyLoss(ip->w_hat.data(), near->w_hat.data(), ip->h_hat.data(),
                                       rows, cols);
        loss_block = kernels::ProxyLoss(ip->w_hat.data(), block->w_hat.data(), ip->h_hat.data(),
                                        rows, cols);
        EXPECT_LT(loss_block, loss_near) << "block " << l << " " << model::LinearName(k);
      }
      std::printf("%-6lld %-18s %12.5g %12.5g %8.3f %12.5g %12.5g %8.3f\n", (long long)l,
                  model::LinearName(k), loss_rtn, loss_ldlq, loss_ldlq / loss_rtn, loss_near,
                  loss_block, loss_block / loss_near);
    }
  }
}

// QuIP#'s rounding as the method runs it (padding, RHT or none, per-row or per-matrix scale) and GPTQ
// per channel, without and with 10 refinement sweeps (QCAL_REFINE_SWEEPS): every linear's relative proxy loss is
// lower with the sweeps (the mean reduction per codebook printed).
TEST_F(RealHessianTest, RefineSweepsLowerEveryLinearsProxyLoss) {
  // QCAL_REFINE_SWEEPS=N compares 0 with N sweeps instead (for choosing the default).
  const char* env = std::getenv("QCAL_REFINE_SWEEPS");
  const int kSweeps = env != nullptr ? std::max(1, std::atoi(env)) : 10;
  struct Case {
    const char* name;
    const char* codebook;  // null: GPTQ at `bits`
    int bits;
    bool per_row;
    bool incoherence = true;
  };
  const Case cases[] = {{"quip e8p row", "e8p", 2, true},
                        {"quip e8p matrix", "e8p", 2, false},
                        {"quip e8p no RHT", "e8p", 2, true, false},
                        {"quip rvq3 row", "rvq3_e8p_e8", 3, true},
                        {"quip rvq4 row", "rvq4_e8p_e8p", 4, true},
                        {"gptq 2-bit", nullptr, 2, true},
                        {"gptq 3-bit", nullptr, 3, true},
                        {"gptq 4-bit", nullptr, 4, true}};
  for (const Case& c : cases) {
    double sum_reduction = 0, worst = 1;
    int count = 0;
    for (int64_t l = 0; l < model_->num_blocks(); ++l) {
      for (LinearKind k : model::kAllLinears) {
        at::Tensor wt = model_->block(l).weights().linear(k).DenseWeight();
        const int64_t rows = wt.size(0), cols = wt.size(1);
        std::vector<double> w = ToDoubleVector(wt);
        std::vector<double> h =
            ToDoubleVector((*hessians_)[l].at(calib::HessianKindOf(k)).Mean());
        double rel[2];
        for (int sweeps : {0, kSweeps}) {
          if (c.codebook != nullptr) {
            methods::quip::QuipRoundingOptions o;
            o.codebook = c.codebook;
            o.per_row_scale = c.per_row;
            o.incoherence = c.incoherence;
            o.seed_u = 1000 + l;
            o.seed_v = 2000 + static_cast<int>(k);
            o.num_threads = 1;
            o.refine_sweeps = sweeps;
            auto r = methods::quip::RoundQuipLinear(w.data(), rows, cols, h.data(), o);
            ASSERT_TRUE(r.ok()) << r.status();
            rel[sweeps > 0] = r->relative;
          } else {
            kernels::ScalarRoundingConfig sc;
            sc.quant.bits = c.bits;
            sc.quant.granularity = kernels::QuantGranularity::kPerChannel;
            sc.refine_sweeps = sweeps;
            auto r = kernels::Gptq(w.data(), rows, cols, h.data(), sc);
            ASSERT_TRUE(r.ok()) << r.status();
            rel[sweeps > 0] = kernels::ProxyLoss(w.data(), r->w_hat.data(), h.data(), rows, cols) /
                              kernels::QuadraticForm(w.data(), h.data(), rows, cols);
          }
        }
        EXPECT_LT(rel[1], rel[0]) << c.name << ": block " << l << " " << model::LinearName(k);
        sum_reduction += 1 - rel[1] / rel[0];
        worst = std::min(worst, 1 - rel[1] / rel[0]);
        ++count;
      }
    }
    std::printf("%-16s mean reduction of the relative proxy loss %.2f%% (smallest %.2f%%) over "
                "%d linears\n",
                c.name, 100 * sum_reduction / count, 100 * worst, count);
  }
}

// QTIP's trellis (issue 41): with the pipeline's rounding (RHT, per-row scale, one refinement
// sweep, the same seeds), the relative proxy loss of the trellis codebook is at most 0.9× that of
// QuIP#'s lattice codebook at the same rate (E8P at 2 bits, RVQ E8P+E8 at 3, E8P+E8P at 4) on every
// linear of every block. QCAL_TRELLIS_CODES=all also prints the other codes (not asserted).
TEST_F(RealHessianTest, TrellisBeatsTheLatticeByTenPercentOnEveryLinear) {
  struct Case {
    int bits;
    const char* lattice;
    const char* trellis;  // asserted
  };
  const Case cases[] = {{2, "e8p", "qtip_1mad_l16_k2"},
                        {3, "rvq3_e8p_e8", "qtip_1mad_l16_k3"},
                        {4, "rvq4_e8p_e8p", "qtip_1mad_l16_k4"}};
  const char* env = std::getenv("QCAL_TRELLIS_CODES");
  const bool all = env != nullptr && std::string(env) == "all";
  std::printf("%-6s %-10s %-6s %10s %-18s %10s %7s\n", "block", "linear", "bits", "lattice",
              "trellis", "rel", "ratio");
  for (const Case& c : cases) {
    std::vector<std::string> codes = {c.trellis};
    if (all) {
      for (const char* code : {"1mad", "3inst", "hyb"}) {
        const std::string name = std::string("qtip_") + code + "_l16_k" + std::to_string(c.bits);
        if (name != c.trellis) codes.push_back(name);
      }
    }
    double worst = 0, sum = 0;
    int count = 0;
    for (int64_t l = 0; l < model_->num_blocks(); ++l) {
      for (LinearKind k : model::kAllLinears) {
        at::Tensor wt = model_->block(l).weights().linear(k).DenseWeight();
        const int64_t rows = wt.size(0), cols = wt.size(1);
        std::vector<double> w = ToDoubleVector(wt);
        std::vector<double> h =
            ToDoubleVector((*hessians_)[l].at(calib::HessianKindOf(k)).Mean());
        auto round = [&](const std::string& codebook) {
          methods::quip::QuipRoundingOptions o;
          o.codebook = codebook;
          o.seed_u = 1000 + l;
          o.seed_v = 2000 + static_cast<int>(k);
          o.num_threads = 2;
          o.refine_sweeps = 1;
          return methods::quip::RoundQuipLinear(w.data(), rows, cols, h.data(), o);
        };
        auto lattice = round(c.lattice);
        ASSERT_TRUE(lattice.ok()) << lattice.status();
        for (size_t i = 0; i < codes.size(); ++i) {
          auto trellis = round(codes[i]);
          ASSERT_TRUE(trellis.ok()) << trellis.status();
          const double ratio = trellis->relative / lattice->relative;
          std::printf("%-6lld %-10s %-6d %10.5f %-18s %10.5f %7.3f\n", (long long)l,
                      model::LinearName(k), c.bits, lattice->relative, codes[i].c_str(),
                      trellis->relative, ratio);
          if (i > 0) continue;
          EXPECT_LE(ratio, 0.9) << codes[i] << " vs " << c.lattice << ": block " << l << " "
                                << model::LinearName(k);
          EXPECT_EQ(trellis->code_bits, lattice->code_bits) << "same rate, same padding";
          worst = std::max(worst, ratio);
          sum += ratio;
          ++count;
        }
      }
    }
    std::printf("%s vs %s: mean ratio %.3f, worst %.3f over %d linears\n", c.trellis, c.lattice,
                sum / count, worst, count);
  }
}

}  // namespace
}  // namespace qcal
