// QuIP# 4-bit (RVQ4 = E8P + E8P residual) with fine-tuning, exactly as jobs/quip-e8p-4bit-ft.yaml
// specifies it, lands within 5% of the float perplexity of stories260K on the TinyStories sample
// (--bos-per-window, ctx 512: the golden 14.823). Without fine-tuning QuIP# 4-bit is ~18% above
// float on this 64-wide model (docs/results.md explains why); this test pins the recipe users run.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/llama2c.h"
#include "common/recipe.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "tests/test_util.h"
#include "worker/eval/perplexity.h"
#include "worker/model/llama.h"
#include "worker/quant/quantize_job.h"
#include "worker/quant/quantized_checkpoint.h"

namespace qcal {
namespace {

double TinyStoriesPerplexity(const std::string& dir, const std::vector<int32_t>& tokens) {
  auto m = quant::LoadAnyModel(dir);
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
  const std::string src = testing::SharedDir() + "/models/stories260K";
  auto imported = ImportLlama2c(src + "/stories260K.bin", src + "/tok512.bin", root + "/float");
  ASSERT_TRUE(imported.ok()) << imported.status();
  auto tok = LoadTokenizerFromModelDir(root + "/float");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto text = ReadTextFile(testing::SharedDir() +
                           "/data/tinystories/TinyStories-valid.sample30k.txt");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<int32_t> tokens = (*tok)->Encode(*text);

  auto recipe = LoadRecipe(testing::SourceDir() + "/jobs/quip-e8p-4bit-ft.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  ASSERT_EQ(recipe->bits, 4);
  ASSERT_TRUE(recipe->finetune.enabled);
  quant::QuantizeJobOptions o;
  o.model_dir = root + "/float";
  o.out_dir = root + "/q4";
  o.data_root = testing::SharedDir();
  o.threads = 1;
  auto job = quant::RunQuantizeJob(*recipe, o);
  ASSERT_TRUE(job.ok()) << job.status();

  const double fp = TinyStoriesPerplexity(root + "/float", tokens);
  const double q4 = TinyStoriesPerplexity(root + "/q4", tokens);
  RecordProperty("float_ppl", std::to_string(fp));
  RecordProperty("quip4_ft_ppl", std::to_string(q4));
  std::printf("float %.4f  quip-e8p-4bit-ft %.4f  (+%.2f%%)\n", fp, q4, 100.0 * (q4 / fp - 1));
  EXPECT_NEAR(fp, 14.823, 0.001);
  EXPECT_LT(q4, 1.05 * fp);
}

}  // namespace
}  // namespace qcal
