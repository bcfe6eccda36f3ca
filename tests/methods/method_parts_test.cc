// A method is the parts it has (methods/parts.h): a toy method written here, in one file, from a
// block quantizer alone, runs through the job runner (the same QuantizeBlockStep the service's
// workers and `qcal quantize` run), is written by the standard block format and read back
// through the layer formats by name; nothing outside this file knows it. And Method::Create
// refuses a method without a part its needs require.
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/hf_config.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/job_plan.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "methods/method.h"
#include "methods/per_linear.h"
#include "methods/registry.h"
#include "runner/job_steps.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

// The toy: every weight rounded to the nearest multiple of its row's mean |w| / 4, kept dense.
at::Tensor ToyRound(const at::Tensor& w) {
  const at::Tensor step = w.abs().mean(1, /*keepdim=*/true) / 4;
  return (at::round(w / step) * step).contiguous();
}

class ToyQuantizer final : public methods::BlockQuantizer {
 public:
  StatusOr<quant::BlockTaskResult> QuantizeBlock(model::BlockWeights w,
                                                 const methods::BlockInputs& in) const override {
    quant::BlockTaskResult r;
    r.layer = in.layer;
    r.weights.input_norm = w.input_norm;
    r.weights.post_norm = w.post_norm;
    for (model::LinearKind k : model::kAllLinears) {
      r.weights.linears[static_cast<int>(k)] =
          std::make_unique<model::DenseLinear>(ToyRound(w.linear(k).DenseWeight()));
      quant::LinearMetrics m;
      m.name = model::LinearName(k);
      m.proxy_loss = m.relative = std::nan("");
      r.linears.push_back(m);
    }
    return r;
  }
};

class ToySequential final : public methods::SequentialForward {
 public:
  StatusOr<at::Tensor> PropagateFinishedBlock(model::BlockWeights, int64_t, const at::Tensor& x,
                                              const model::Rope&, int64_t) const override {
    return x;
  }
};

// A recipe whose needs are none (rtn's: no calibration, independent blocks), run by the toy.
Recipe ToyRecipe() {
  auto r = ParseRecipe("name: toy\nmethod: rtn\nbits: 4\n", "toy recipe");
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(MethodPartsTest, AToyMethodOfOnePartRunsThroughTheJobRunner) {
  const std::string model_dir = testing::RealModelDir("stories260K");
  const std::string dir = testing::MakeTempDir("method_parts");
  const Recipe recipe = ToyRecipe();
  v1::JobSpec opt;
  opt.set_model_dir(model_dir);
  opt.set_out_dir(dir + "/out");
  opt.set_data_root(testing::SharedDir());
  opt.set_threads_per_worker(1);
  ASSERT_TRUE(PlanJob(recipe, opt.model_dir(), opt.out_dir(), opt.out_dir() + ".job", opt.data_root())
                  .ok());
  auto ctx = job::OpenJob(recipe, opt);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  methods::Method::Parts parts;
  parts.quantizer = std::make_shared<ToyQuantizer>();
  auto toy = methods::Method::Create(recipe, (*ctx)->config, std::move(parts));
  ASSERT_TRUE(toy.ok()) << toy.status();
  (*ctx)->method = std::move(*toy);

  const int64_t layer = 2;
  auto result = job::QuantizeBlockStep(ctx->get(), layer, "toy-attempt");
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->metrics_size(), 7);
  ASSERT_TRUE(CommitFiles(opt.out_dir(), FilesOf(*result)).ok());

  // Read back through the method's block format: the toy's rounding of the float block.
  auto ckpt = CheckpointReader::OpenShards(opt.out_dir(), {result->shard().name()});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto back = (*ctx)->method->block_format().LoadBlock(**ckpt, layer);
  ASSERT_TRUE(back.ok()) << back.status();
  auto source = model::OpenFloatCheckpoint(model_dir);
  ASSERT_TRUE(source.ok());
  auto flt = (*source)->LoadBlockWeights(layer);
  ASSERT_TRUE(flt.ok());
  for (model::LinearKind k : model::kAllLinears) {
    EXPECT_STREQ(back->linear(k).layer_format(), "dense");
    EXPECT_TRUE(at::equal(back->linear(k).DenseWeight(), ToyRound(flt->linear(k).DenseWeight())))
        << model::LinearName(k);
  }
  EXPECT_TRUE(at::equal(back->input_norm, flt->input_norm));
}

TEST(MethodPartsTest, CreateRefusesAMethodWithoutThePartsItsNeedsRequire) {
  LlamaConfig config;
  const Recipe recipe = ToyRecipe();
  auto none = methods::Method::Create(recipe, config, methods::Method::Parts());
  EXPECT_TRUE(absl::IsInvalidArgument(none.status())) << none.status();
  EXPECT_NE(std::string(none.status().message()).find("no block quantizer"), std::string::npos);

  // A sequential recipe (QuaRot with GPTQ weights) needs its sequential forward; one with a
  // global phase (PrefixQuant's prefix) needs a part that runs it.
  auto quarot = LoadRecipe(testing::SourceDir() + "/jobs/quarot-w4a4kv4.yaml");
  ASSERT_TRUE(quarot.ok()) << quarot.status();
  ASSERT_TRUE(quarot->needs().sequential);
  methods::Method::Parts parts;
  parts.quantizer = std::make_shared<ToyQuantizer>();
  auto seq = methods::Method::Create(*quarot, config, parts);
  EXPECT_TRUE(absl::IsInvalidArgument(seq.status())) << seq.status();
  EXPECT_NE(std::string(seq.status().message()).find("sequential"), std::string::npos);
  auto prefix = LoadRecipe(testing::SourceDir() + "/jobs/prefixquant-w4a4kv4-ft.yaml");
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  ASSERT_FALSE(prefix->needs().global_phases.empty());
  parts.sequential = std::make_shared<ToySequential>();
  auto phased = methods::Method::Create(*prefix, config, parts);
  EXPECT_TRUE(absl::IsInvalidArgument(phased.status())) << phased.status();
  EXPECT_NE(std::string(phased.status().message()).find("phase prefix"), std::string::npos);
}

TEST(MethodPartsTest, TheRunnerChecksWhatTheNeedsAskForBeforeTheQuantizerRuns) {
  methods::BlockInputs in;
  in.layer = 3;
  MethodNeeds needs;
  EXPECT_FALSE(methods::CheckBlockInputs(in, needs).ok());  // no RoPE tables
  auto config = LoadLlamaConfig(testing::RealModelDir("stories260K"));
  ASSERT_TRUE(config.ok()) << config.status();
  const model::Rope rope(*config);
  in.rope = &rope;
  EXPECT_TRUE(methods::CheckBlockInputs(in, needs).ok());
  needs.float_hessians = true;
  needs.float_activations = true;
  const Status s = methods::CheckBlockInputs(in, needs);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("block 3"), std::string::npos) << s;
  EXPECT_NE(s.message().find("Hessians"), std::string::npos) << s;
  EXPECT_NE(s.message().find("inputs and outputs"), std::string::npos) << s;
}

// PerLinearQuantizer passes a linear's rounding notes up as the block's progress ("rounding
// <linear>: <note>" at the count of linears done so far), at most one per note interval: with
// the interval at 0 every note arrives, with the default (10 s) a fast linear adds none.
class NotingRounding final : public methods::LinearRounding {
 public:
  StatusOr<quant::QuantizedLinear> Round(int64_t, model::LinearKind, int64_t,
                                         const at::Tensor& weight, const at::Tensor&,
                                         kernels::GpuBackend*,
                                         const methods::LinearProgressFn& progress) const override {
    for (const char* note : {"half", "all"}) {
      if (progress) progress(note);
    }
    quant::QuantizedLinear q;
    q.layer = std::make_unique<model::DenseLinear>(weight.clone());
    return q;
  }
};

TEST(MethodPartsTest, PerLinearQuantizerForwardsRoundingNotesAtMostOncePerInterval) {
  auto m = testing::LoadModelOrDie(testing::RealModelDir("stories260K"));
  for (int every_ms : {0, -1}) {
    methods::PerLinearQuantizer quantizer(m->config(), /*finetune=*/false, {},
                                          std::make_shared<NotingRounding>());
    if (every_ms >= 0) quantizer.set_note_interval(std::chrono::milliseconds(every_ms));
    std::vector<std::string> events;
    methods::BlockInputs in;
    in.rope = &m->rope();
    in.progress = [&events](int64_t done, int64_t total, const std::string& step) {
      events.push_back(absl::StrCat(done, "/", total, " ", step));
    };
    auto r = quantizer.QuantizeBlock(testing::CopyBlock(m->block(0).weights()), in);
    ASSERT_TRUE(r.ok()) << r.status();
    if (every_ms < 0) {  // the default interval: only the seven linears' own steps
      ASSERT_EQ(events.size(), 7u);
      EXPECT_EQ(events[0], "1/7 self_attn.q_proj");
      continue;
    }
    ASSERT_EQ(events.size(), 21u);
    EXPECT_EQ(events[0], "0/7 rounding self_attn.q_proj: half");
    EXPECT_EQ(events[1], "0/7 rounding self_attn.q_proj: all");
    EXPECT_EQ(events[2], "1/7 self_attn.q_proj");
    EXPECT_EQ(events[18], "6/7 rounding mlp.down_proj: half");
  }
}

}  // namespace
}  // namespace qcal
