// The task plan (every driver's): phases and block tasks from a recipe and the job directory's state.
#include "runner/task_plan.h"

#include <gtest/gtest.h>

#include "methods/registry.h"

namespace qcal {
namespace {

JobPlan FreshPlan(int64_t blocks) {
  JobPlan p;
  p.num_blocks = blocks;
  p.block_finished.assign(blocks, false);
  return p;
}

Recipe Parse(const std::string& yaml) {
  StatusOr<Recipe> r = ParseRecipe(yaml, "task_plan_test.yaml");
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Recipe();
}

Recipe Quip() { return Parse("method: quip\n"); }
Recipe Rtn() { return Parse("method: rtn\nbits: 4\n"); }

TEST(PlannerTest, FreshQuipJobCalibratesThenQuantizesEveryBlock) {
  const TaskPlan t = MakeTaskPlan(Quip(), FreshPlan(5));
  EXPECT_TRUE(t.calibrate);
  EXPECT_EQ(t.blocks, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(t.resumed.empty());
  EXPECT_FALSE(t.finetune_e2e);
  EXPECT_TRUE(t.needs_workers());
  EXPECT_TRUE(t.calibrate_params.hessians());      // what the method needs, and no more
  EXPECT_FALSE(t.calibrate_params.activations());
  EXPECT_EQ(t.phases,
            (std::vector<std::string>{"plan", "calibrate", "quantize", "finalize", "done"}));
}

TEST(PlannerTest, EvaluationIsAPhaseAfterFinalize) {
  v1::EvalParams e;
  e.set_model("float");
  e.set_label("wikitext2");
  const TaskPlan t = MakeTaskPlan(Rtn(), FreshPlan(2), {e, e});
  EXPECT_EQ(t.evals.size(), 2u);
  EXPECT_EQ(t.phases, (std::vector<std::string>{"plan", "quantize", "finalize", "evaluate",
                                                "done"}));
  // A finished job that is evaluated still needs its workers.
  JobPlan done = FreshPlan(2);
  done.block_finished.assign(2, true);
  EXPECT_TRUE(MakeTaskPlan(Rtn(), done, {e}).needs_workers());
}

TEST(PlannerTest, ResumeSkipsFinishedBlocks) {
  JobPlan p = FreshPlan(5);
  p.block_finished[0] = p.block_finished[3] = true;
  const TaskPlan t = MakeTaskPlan(Quip(), p);
  EXPECT_EQ(t.blocks, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(t.resumed, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(t.calibrate);  // pending blocks still need Hessians
}

TEST(PlannerTest, RtnNeedsNoCalibration) {
  const TaskPlan t = MakeTaskPlan(Rtn(), FreshPlan(3));
  EXPECT_FALSE(t.calibrate);
  EXPECT_EQ(t.blocks.size(), 3u);
  EXPECT_EQ(t.phases, (std::vector<std::string>{"plan", "quantize", "finalize", "done"}));
}

TEST(PlannerTest, QuarotCalibratesInsideItsBlockTasksInOrderWhenSequential) {
  TaskPlan t = MakeTaskPlan(Parse("method: quarot\nbits: 4\nweights: gptq\n"), FreshPlan(4));
  EXPECT_FALSE(t.calibrate);  // no float-model calibration phase
  EXPECT_TRUE(t.sequential_blocks);
  EXPECT_EQ(t.phases, (std::vector<std::string>{"plan", "quantize", "finalize", "done"}));
  // Dynamic activations, no static ranges: blocks are independent.
  t = MakeTaskPlan(Parse("method: quarot\nbits: 4\nweights: rtn\n"), FreshPlan(4));
  EXPECT_FALSE(t.sequential_blocks);
  t = MakeTaskPlan(Parse("method: quarot\nbits: 4\nweights: rtn\nactivations: {bits: 8, "
                         "granularity: per_tensor, static: true}\n"),
                   FreshPlan(4));
  EXPECT_TRUE(t.sequential_blocks);
}

TEST(PlannerTest, FinishedJobGoesStraightToFinalizeWithoutWorkers) {
  JobPlan p = FreshPlan(3);
  p.block_finished.assign(3, true);
  const TaskPlan t = MakeTaskPlan(Quip(), p);
  EXPECT_FALSE(t.calibrate);
  EXPECT_TRUE(t.blocks.empty());
  EXPECT_FALSE(t.needs_workers());
  EXPECT_EQ(t.phases, (std::vector<std::string>{"plan", "finalize", "done"}));
}

TEST(PlannerTest, EndToEndFinetuneAfterTheBlocksAndRedoneWhenABlockIsRedone) {
  const Recipe r = Parse("method: quip\nfinetune: {enabled: true, end_to_end: {enabled: true}}\n");
  JobPlan p = FreshPlan(2);
  p.e2e_enabled = true;
  TaskPlan t = MakeTaskPlan(r, p);
  EXPECT_TRUE(t.finetune_e2e);
  EXPECT_TRUE(t.calibrate_params.hessians() && t.calibrate_params.activations());
  EXPECT_EQ(t.phases, (std::vector<std::string>{"plan", "calibrate", "quantize", "finetune",
                                                "finalize", "done"}));
  // Every block done but e2e not: only the e2e task (it needs the calibration products).
  p.block_finished.assign(2, true);
  t = MakeTaskPlan(r, p);
  EXPECT_TRUE(t.blocks.empty());
  EXPECT_TRUE(t.finetune_e2e);
  EXPECT_TRUE(t.calibrate);
  EXPECT_FALSE(t.calibrate_params.hessians() || t.calibrate_params.activations());
  // e2e done and valid: nothing left.
  p.e2e_finished = true;
  t = MakeTaskPlan(r, p);
  EXPECT_FALSE(t.finetune_e2e);
  EXPECT_FALSE(t.needs_workers());
  // A redone block invalidates e2e (it rewrites every shard).
  p.block_finished[1] = false;
  t = MakeTaskPlan(r, p);
  EXPECT_TRUE(t.finetune_e2e);
  EXPECT_EQ(t.blocks, (std::vector<int64_t>{1}));
}

}  // namespace
}  // namespace qcal
