// QuIP# 4-bit (RVQ4 = E8P + E8P residual) with fine-tuning, exactly as jobs/quip-e8p-4bit-ft.yaml
// specifies it, lands within 5% of the float perplexity of stories260K on the TinyStories sample
// (--bos-per-window, ctx 512: the golden 14.823). Without fine-tuning QuIP# 4-bit is ~18% above
// float on this 64-wide model (docs/results.md explains why); this test pins the recipe users run.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "methods/registry.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/eval/perplexity.h"
#include "engine/model/llama.h"
#include "runner/quantize_job.h"
#include "methods/method_factory.h"

namespace qcal {
namespace {

double TinyStoriesPerplexity(const std::string& dir, const std::vector<int32_t>& tokens) {
  auto m = methods::LoadModel(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return 0;
  eval::PerplexityOptions opt;
  opt.ctx = 512;
  opt.bos_per_window = true;
  auto r = eval::EvaluatePerplexity(**m, tokens, opt);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->perplexity : 0;
}

TEST(Quip4BitTest, FineTunedRecipeIsWithinFivePercentOfFloat) {
  model::SetComputeThreads(1);
  const std::string root = testing::MakeTempDir("quip4");
  auto tok = LoadTokenizerFromModelDir(testing::RealModelDir("stories260K"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto text = ReadTextFile(testing::SharedDir() +
                           "/data/tinystories/TinyStories-valid.sample30k.txt");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<int32_t> tokens = (*tok)->Encode(*text);

  auto recipe = LoadRecipe(testing::SourceDir() + "/jobs/quip-e8p-4bit-ft.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  ASSERT_EQ(recipe->bits(), 4);
  ASSERT_TRUE(recipe->finetune.enabled);
  v1::JobSpec o;
  o.set_model_dir(testing::RealModelDir("stories260K"));
  o.set_out_dir(root + "/q4");
  o.set_data_root(testing::SharedDir());
  o.set_threads_per_worker(1);
  auto job = job::RunQuantizeJob(*recipe, o);
  ASSERT_TRUE(job.ok()) << job.status();

  const double fp = TinyStoriesPerplexity(testing::RealModelDir("stories260K"), tokens);
  const double q4 = TinyStoriesPerplexity(root + "/q4", tokens);
  RecordProperty("float_ppl", std::to_string(fp));
  RecordProperty("quip4_ft_ppl", std::to_string(q4));
  std::printf("float %.4f  quip-e8p-4bit-ft %.4f  (+%.2f%%)\n", fp, q4, 100.0 * (q4 / fp - 1));
  EXPECT_NEAR(fp, 14.823, 0.001);
  EXPECT_LT(q4, 1.05 * fp);
}

}  // namespace
}  // namespace qcal
