// The task plan (every driver's): phases and block tasks from a recipe and the job directory's state.
#include "runner/task_plan.h"

#include <gtest/gtest.h>

#include "methods/registry.h"
#include "runner/job_dir.h"
#include "runner/journal.h"

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

// A MoE model's blocks split into expert-group tasks (issue 53, deliverable 4) for the methods
// that round experts on their own, in groups of the spec's size (default 8): not for a dense
// layer, a method that quantizes whole blocks (QuaRot) or tunes them (QuIP# with block
// fine-tuning), nor with experts_per_task -1 or a group as large as the block.
TEST(PlannerTest, MoeBlocksSplitIntoExpertGroupsForPerExpertMethods) {
  EXPECT_EQ(ExpertGroups(5, 2).size(), 3u);
  EXPECT_EQ(ExpertGroups(5, 2).back().begin, 4);
  EXPECT_EQ(ExpertGroups(5, 2).back().end, 5);
  EXPECT_EQ(ExpertGroups(16, 0).size(), 2u);  // kDefaultExpertsPerTask
  EXPECT_TRUE(ExpertGroups(8, 0).empty());     // one group: the block stays one task
  EXPECT_TRUE(ExpertGroups(16, -1).empty());
  EXPECT_TRUE(ExpertGroups(4, 4).empty());

  JobPlan p = FreshPlan(3);
  p.config.num_experts = 16;
  p.config.moe_layers = {true, false, true};  // a dense layer between two MoE layers
  TaskPlan t = MakeTaskPlan(Quip(), p);
  ASSERT_EQ(t.block_groups.size(), 2u);
  EXPECT_EQ(t.block_groups.count(1), 0u);
  ASSERT_EQ(t.block_groups[0].size(), 2u);
  EXPECT_EQ(t.block_groups[0][1].begin, 8);
  EXPECT_EQ(t.block_groups[0][1].end, 16);
  EXPECT_EQ(t.blocks, (std::vector<int64_t>{0, 1, 2}));

  p.experts_per_task = 5;
  t = MakeTaskPlan(Rtn(), p);
  ASSERT_EQ(t.block_groups[2].size(), 4u);
  EXPECT_EQ(t.block_groups[2][3].begin, 15);

  // A group an earlier run finished is matched to this plan's group of the same experts; one
  // of another split is not.
  v1::BlockResult done;
  done.set_layer(2);
  done.mutable_shard()->set_name(PartFileName(2, 5, 10));
  done.mutable_part()->set_index(7);
  done.mutable_part()->set_expert_begin(5);
  done.mutable_part()->set_expert_end(10);
  p.parts_done[2].push_back(BlockPartDoneEntry(done));
  done.mutable_part()->set_expert_begin(4);
  p.parts_done[2].push_back(BlockPartDoneEntry(done));
  t = MakeTaskPlan(Rtn(), p);
  ASSERT_EQ(t.parts_done[2].size(), 1u);
  EXPECT_EQ(t.parts_done[2].begin()->first, 2);  // part 2 = experts [5, 10)
  EXPECT_EQ(t.parts_done[2][2].part().index(), 2);
  EXPECT_EQ(t.parts_done[2][2].part().count(), 5);

  p.experts_per_task = -1;
  EXPECT_TRUE(MakeTaskPlan(Rtn(), p).block_groups.empty());
  p.experts_per_task = 0;
  EXPECT_TRUE(MakeTaskPlan(Parse("method: quip\nfinetune: {enabled: true}\n"), p)
                  .block_groups.empty());
  EXPECT_TRUE(MakeTaskPlan(Parse("method: quarot\nbits: 4\nweights: rtn\n"), p).block_groups.empty());
  p.block_finished[0] = true;  // a finished block is not split again
  EXPECT_EQ(MakeTaskPlan(Quip(), p).block_groups.count(0), 0u);
}

}  // namespace
}  // namespace qcal
