// Prefixed K/V (model::PrefixKv): a sequence run behind an installed prefix computes what the
// prefix tokens followed by the sequence compute in one pass (at the sequence's positions), with
// and without online transforms; the KV-cache hook never sees the prefix; bad prefixes are
// refused with messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "tests/model_fixtures.h"
#include "engine/eval/perplexity.h"
#include "engine/model/llama.h"

namespace qcal::model {
namespace {

using testing::LoadModelOrDie;
using testing::RealModelDir;
using testing::RelMaxDiff;
using testing::StoryTokens;

at::Tensor Ids(const std::vector<int32_t>& t) {
  std::vector<int64_t> ids(t.begin(), t.end());
  return at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong).clone();
}

// Logits of `text` behind `prefix` (installed) against those of prefix + text in one pass.
void ExpectPrefixEqualsPrepending(LlamaModel& m, const std::vector<int32_t>& prefix,
                                  const std::vector<int32_t>& text) {
  std::vector<int32_t> all = prefix;
  all.insert(all.end(), text.begin(), text.end());
  const at::Tensor full = m.Forward(Ids(all));
  auto kv = ComputePrefixKv(m, prefix);
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_TRUE(InstallPrefixKv(m, *kv).ok());
  EXPECT_EQ(PrefixLength(m), static_cast<int64_t>(prefix.size()));
  const at::Tensor behind = m.Forward(Ids(text));
  const int64_t o = static_cast<int64_t>(prefix.size());
  const at::Tensor want = full.narrow(1, o, static_cast<int64_t>(text.size()));
  EXPECT_GT(want.abs().max().item<double>(), 0);
  EXPECT_LT(RelMaxDiff(want, behind), 2e-5);
}

void RemovePrefix(LlamaModel& m) {
  for (int64_t i = 0; i < m.num_blocks(); ++i) {
    BlockHooks h = m.block(i).hooks();
    h.prefix.reset();
    m.mutable_block(i).set_hooks(h);
  }
}

TEST(PrefixKv, EqualsRunningThePrefixTokensFirst) {
  for (const char* name : {"stories260K", "aidreams260K"}) {
    SCOPED_TRACE(name);
    const std::string dir = RealModelDir(name);
    auto m = LoadModelOrDie(dir);
    std::vector<int32_t> text = StoryTokens(dir, 100);
    ASSERT_EQ(text.size(), 100u);
    // A full-length sequence behind the prefix (positions past the model's context are covered).
    std::vector<int32_t> longer = StoryTokens(dir, m->config().max_position_embeddings);
    ExpectPrefixEqualsPrepending(*m, {text[5], text[9], 1}, longer);
    RemovePrefix(*m);
    ExpectPrefixEqualsPrepending(*m, {1}, text);
  }
}

TEST(PrefixKv, EqualsRunningThePrefixTokensFirstWithOnlineTransforms) {
  const std::string dir = RealModelDir("stories260K");
  auto m = LoadModelOrDie(dir);
  // An orthogonal R3-style rotation on q and k after RoPE: the prefix's keys must carry it.
  at::Tensor q = std::get<0>(at::linalg_qr(at::randn({m->config().head_dim, m->config().head_dim},
                                                     at::TensorOptions().dtype(at::kDouble))));
  for (int64_t i = 0; i < m->num_blocks(); ++i) {
    BlockHooks h;
    h.qk_rotation = q.to(at::kFloat);
    m->mutable_block(i).set_hooks(h);
  }
  std::vector<int32_t> text = StoryTokens(dir, 64);
  ExpectPrefixEqualsPrepending(*m, {text[3], 1}, text);
}

// Records the sequence lengths it is applied to and returns x unchanged.
class LengthRecorder final : public KvCacheHook {
 public:
  at::Tensor Apply(const at::Tensor& x, KvRole) const override {
    lengths->push_back(x.size(2));
    return x;
  }
  std::string Describe() const override { return "recorder"; }
  std::shared_ptr<std::vector<int64_t>> lengths = std::make_shared<std::vector<int64_t>>();
};

TEST(PrefixKv, TheKvCacheHookNeverSeesThePrefix) {
  const std::string dir = RealModelDir("stories260K");
  auto m = LoadModelOrDie(dir);
  auto kv = ComputePrefixKv(*m, {13, 1});
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(InstallPrefixKv(*m, *kv).ok());
  auto hook = std::make_shared<LengthRecorder>();
  for (int64_t i = 0; i < m->num_blocks(); ++i) {
    BlockHooks h = m->block(i).hooks();
    h.kv_cache = hook;
    m->mutable_block(i).set_hooks(h);
  }
  m->Forward(Ids(StoryTokens(dir, 20)));
  ASSERT_EQ(hook->lengths->size(), static_cast<size_t>(3 * m->num_blocks()));
  for (int64_t n : *hook->lengths) EXPECT_EQ(n, 20);
}

TEST(PrefixKv, GreedyDecodingDropsThePromptsBosBehindAPrefixEndingWithIt) {
  const std::string dir = RealModelDir("stories260K");
  auto m = LoadModelOrDie(dir);
  const std::vector<int32_t> prefix = {13, 1};
  std::vector<int32_t> prompt = {1};
  for (int32_t t : StoryTokens(dir, 6)) prompt.push_back(t);
  // Reference: decode after the prefix tokens themselves, then strip them.
  std::vector<int32_t> joined = {13};
  joined.insert(joined.end(), prompt.begin(), prompt.end());
  std::vector<int32_t> want = GenerateGreedy(*m, joined, 12, -1);
  want.erase(want.begin());
  auto kv = ComputePrefixKv(*m, prefix);
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(InstallPrefixKv(*m, *kv).ok());
  EXPECT_EQ(GenerateGreedy(*m, prompt, 12, -1), want);
}

// Perplexity behind a prefix ending with BOS: each window runs without its leading BOS, and the
// NLL is that of the window's tokens behind the prefix, computed here window by window.
TEST(PrefixKv, PerplexityScoresTheWindowsBehindThePrefix) {
  const std::string dir = RealModelDir("stories260K");
  auto m = LoadModelOrDie(dir);
  const std::vector<int32_t> text = StoryTokens(dir, 700);
  auto kv = ComputePrefixKv(*m, {13, 1});
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(InstallPrefixKv(*m, *kv).ok());
  for (bool bos_per_window : {false, true}) {
    SCOPED_TRACE(bos_per_window ? "bos_per_window" : "default");
    eval::PerplexityOptions o;
    o.ctx = 64;
    o.batch = 3;
    o.bos_per_window = bos_per_window;
    auto r = eval::EvaluatePerplexity(*m, text, o);
    ASSERT_TRUE(r.ok()) << r.status();
    // The reference: the windows' token lists, BOS dropped, scored after their first token.
    std::vector<std::vector<int32_t>> windows;
    if (bos_per_window) {
      for (size_t s = 0; s < text.size(); s += 63) {
        windows.emplace_back(text.begin() + s, text.begin() + std::min(text.size(), s + 63));
      }
    } else {
      std::vector<int32_t> stream = {1};
      stream.insert(stream.end(), text.begin(), text.end());
      for (size_t s = 0; s + 64 <= stream.size(); s += 64) {
        windows.emplace_back(stream.begin() + s + (s == 0 ? 1 : 0), stream.begin() + s + 64);
      }
    }
    double nll = 0;
    int64_t scored = 0;
    for (const auto& w : windows) {
      if (w.size() < 2) continue;
      const at::Tensor logp = at::log_softmax(m->Forward(Ids(w)), -1)[0];
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        nll -= logp[i][w[i + 1]].item<double>();
        ++scored;
      }
    }
    EXPECT_EQ(r->tokens_scored, scored);
    EXPECT_NEAR(r->mean_nll, nll / scored, 1e-6 * nll / scored);
  }
}

TEST(PrefixKv, BadPrefixesAreRefused) {
  const std::string dir = RealModelDir("stories260K");
  auto m = LoadModelOrDie(dir);
  EXPECT_FALSE(ComputePrefixKv(*m, {}).ok());
  EXPECT_FALSE(ComputePrefixKv(*m, {600}).ok());
  EXPECT_FALSE(ComputePrefixKv(*m, std::vector<int32_t>(kMaxPrefixTokens + 1, 1)).ok());
  auto kv = ComputePrefixKv(*m, {13, 1});
  ASSERT_TRUE(kv.ok());
  auto fewer = *kv;
  fewer.pop_back();
  auto s = InstallPrefixKv(*m, fewer);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("blocks"), std::string::npos) << s;
  auto bad = *kv;
  auto p = std::make_shared<PrefixKv>(*bad[1]);
  p->v = p->v.narrow(1, 0, 1);
  bad[1] = p;
  EXPECT_FALSE(InstallPrefixKv(*m, bad).ok());
  ASSERT_TRUE(InstallPrefixKv(*m, *kv).ok());
  EXPECT_FALSE(ComputePrefixKv(*m, {13, 1}).ok());  // already installed
}

}  // namespace
}  // namespace qcal::model
