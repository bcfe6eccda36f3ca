// One run of a job as both drivers wrap it (runner/job_run.h): the finished blocks seeded from
// the plan and grown by each recorded block, end-to-end fine-tuning handed every finished block,
// finalize when due, duplicates retired without a second record.
#include "runner/job_run.h"

#include <gtest/gtest.h>

#include "methods/registry.h"
#include "runner/journal.h"

namespace qcal::job {
namespace {

Recipe QuipWithEndToEnd() {
  StatusOr<Recipe> r = ParseRecipe(
      "method: quip\nfinetune: {enabled: true, end_to_end: {enabled: true}}\n", "job_run.yaml");
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Recipe();
}

v1::BlockResult Block(int64_t layer) {
  v1::BlockResult b;
  b.set_layer(layer);
  b.mutable_shard()->set_name("model-0000" + std::to_string(layer + 1) + "-of-00004.safetensors");
  b.mutable_shard()->set_checksum("sum" + std::to_string(layer));
  b.set_seconds(1.5);
  return b;
}

v1::CompleteTaskRequest Done(const v1::Task& task) {
  v1::CompleteTaskRequest r;
  r.set_task_id(task.task_id());
  if (task.kind() == v1::TASK_KIND_QUANTIZE_BLOCK) *r.mutable_block() = Block(task.block());
  return r;
}

TEST(JobRunTest, RunsTheResumedJobToFinalizeAndHandsFineTuningEveryBlock) {
  JobPlan plan;
  plan.num_blocks = 3;
  plan.block_finished = {false, true, false};
  plan.block_done[1] = BlockDoneEntry(Block(1));
  plan.e2e_enabled = true;
  JobRun run("job", /*world_size=*/1, QuipWithEndToEnd(), plan, {}, /*max_attempts=*/1, 0);
  ASSERT_EQ(run.finished().size(), 1u);  // the resumed block, as its journal entry reads
  EXPECT_EQ(run.finished().at(1).shard().checksum(), "sum1");
  EXPECT_EQ(run.tasks().blocks, (std::vector<int64_t>{0, 2}));

  std::vector<v1::TaskKind> kinds;
  std::vector<int64_t> blocks;
  while (!run.finalize_due()) {
    const v1::Task task = run.Next("w", 0);
    ASSERT_TRUE(run.scheduler().error().empty()) << run.scheduler().error();
    ASSERT_NE(task.kind(), v1::TASK_KIND_WAIT);
    kinds.push_back(task.kind());
    if (task.kind() == v1::TASK_KIND_QUANTIZE_BLOCK) blocks.push_back(task.block());
    if (task.kind() == v1::TASK_KIND_FINETUNE_E2E) {
      ASSERT_EQ(task.finished_blocks_size(), 3);  // resumed and recorded, in layer order
      for (int64_t l = 0; l < 3; ++l) {
        EXPECT_EQ(task.finished_blocks(l).layer(), l);
        EXPECT_EQ(task.finished_blocks(l).shard().checksum(), "sum" + std::to_string(l));
      }
    }
    auto c = run.Record("w", 0, Done(task));
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_FALSE(c->duplicate);
    // A second report of the same task is a duplicate: retired, nothing recorded twice.
    auto again = run.Record("w", 0, Done(task));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->duplicate);
  }
  EXPECT_EQ(kinds, (std::vector<v1::TaskKind>{v1::TASK_KIND_CALIBRATE,
                                              v1::TASK_KIND_QUANTIZE_BLOCK,
                                              v1::TASK_KIND_QUANTIZE_BLOCK,
                                              v1::TASK_KIND_FINETUNE_E2E}));
  EXPECT_EQ(blocks, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(run.finished().size(), 3u);
  EXPECT_FALSE(run.done());
  run.FinalizeDone();
  EXPECT_TRUE(run.done());
}

}  // namespace
}  // namespace qcal::job
