// The scheduler: collective calibration, pull-based block hand-out, requeue on failure or loss.
#include "runner/scheduler.h"

#include <gtest/gtest.h>

namespace qcal::job {
namespace {

TaskPlan Plan(int64_t blocks, bool calibrate, bool e2e = false) {
  TaskPlan t;
  t.num_blocks = blocks;
  t.calibrate = calibrate;
  for (int64_t l = 0; l < blocks; ++l) t.blocks.push_back(l);
  t.finetune_e2e = e2e;
  return t;
}

TEST(SchedulerTest, CalibrationIsCollectiveThenBlocksFlow) {
  JobScheduler s("job-1", 3, Plan(4, true));
  EXPECT_EQ(s.phase(), "calibrate");
  for (int r = 0; r < 3; ++r) {
    v1::Task t = s.Next("w" + std::to_string(r), r);
    EXPECT_EQ(t.kind(), v1::TASK_KIND_CALIBRATE) << "rank " << r;
    EXPECT_EQ(t.task_id(), "calibrate");
  }
  ASSERT_TRUE(s.Complete("w0", 0, "calibrate").ok());
  // Rank 0 finished its part but the collective is not over: it waits.
  EXPECT_EQ(s.Next("w0", 0).kind(), v1::TASK_KIND_WAIT);
  ASSERT_TRUE(s.Complete("w1", 1, "calibrate").ok());
  auto last = s.Complete("w2", 2, "calibrate");
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->phase_finished);
  EXPECT_EQ(s.phase(), "quantize");
  v1::Task t = s.Next("w1", 1);
  EXPECT_EQ(t.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(t.block(), 0);
  EXPECT_EQ(t.attempt(), 1);
  EXPECT_TRUE(s.error().empty());
}

TEST(SchedulerTest, FasterRanksPullMoreBlocks) {
  // Rank 0 finishes a block every tick, rank 1 every third tick: with pull-based hand-out
  // rank 0 ends up with about three quarters of the blocks (round-robin would give half).
  constexpr int kBlocks = 40;
  JobScheduler s("job-1", 2, Plan(kBlocks, false));
  std::map<int, v1::Task> holding;
  std::map<int, int> count;
  for (int tick = 0; !s.awaiting_finalize() && tick < 1000; ++tick) {
    for (int r = 0; r < 2; ++r) {
      if (holding.count(r) && (r == 0 || tick % 3 == 0)) {
        ASSERT_TRUE(s.Complete("w" + std::to_string(r), r, holding[r].task_id()).ok());
        holding.erase(r);
      }
      if (!holding.count(r)) {
        v1::Task t = s.Next("w" + std::to_string(r), r);
        if (t.kind() == v1::TASK_KIND_QUANTIZE_BLOCK) {
          holding[r] = t;
          ++count[r];
        }
      }
    }
  }
  EXPECT_TRUE(s.awaiting_finalize());
  EXPECT_EQ(count[0] + count[1], kBlocks);
  EXPECT_GE(count[0], 27) << "rank 0 took " << count[0] << ", rank 1 " << count[1];
  EXPECT_LE(count[1], 13);
}

// A MoE block split over tasks (issue 53): its expert groups go out to whichever ranks ask, in
// parallel; its assembly (part 0, carrying the block's part count) only once every group is
// done; a lost group is handed out again (attempt 2) before anything else; a group an earlier
// run finished is not handed out; the block is done when its assembly completes.
TEST(SchedulerTest, SplitMoeBlocksHandOutGroupsThenTheirAssembly) {
  TaskPlan plan = Plan(2, false);
  plan.block_groups[0] = {{0, 2}, {2, 4}, {4, 5}};
  plan.block_groups[1] = {{0, 2}, {2, 4}, {4, 5}};
  plan.parts_done[1][2] = v1::BlockResult();  // block 1 experts [2, 4): done by an earlier run
  JobScheduler s("job-1", 3, plan);
  ASSERT_EQ(s.phase(), "quantize");
  EXPECT_EQ(s.blocks_pending(), 2);
  v1::Task a = s.Next("w0", 0), b = s.Next("w1", 1), c = s.Next("w2", 2);
  for (const v1::Task* t : {&a, &b, &c}) {
    ASSERT_EQ(t->kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
    EXPECT_EQ(t->block(), 0);
    ASSERT_TRUE(t->has_part());
    EXPECT_EQ(t->part().count(), 4);
  }
  EXPECT_EQ(a.part().index(), 1);
  EXPECT_EQ(a.task_id(), "block-0.p1.a1");
  EXPECT_EQ(b.part().expert_begin(), 2);
  EXPECT_EQ(b.part().expert_end(), 4);
  EXPECT_EQ(c.part().index(), 3);
  EXPECT_EQ(c.part().expert_end(), 5);
  // Rank 0 finishes its group: the next unit that may run is block 1's first group, not block
  // 0's assembly.
  auto done = s.Complete("w0", 0, a.task_id());
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->block, 0);
  EXPECT_EQ(done->part, 1);
  EXPECT_FALSE(done->phase_finished);
  EXPECT_EQ(s.blocks_done(), 0);
  v1::Task d = s.Next("w0", 0);
  EXPECT_EQ(d.block(), 1);
  EXPECT_EQ(d.part().index(), 1);
  // Rank 1 dies holding block 0's second group: it comes back first, as attempt 2.
  auto requeued = s.WorkerLost("w1", 1);
  ASSERT_EQ(requeued.size(), 1u);
  EXPECT_EQ(requeued[0].what, "block 0 experts [2, 4)");
  v1::Task b2 = s.Next("w3", 1);
  EXPECT_EQ(b2.block(), 0);
  EXPECT_EQ(b2.part().index(), 2);
  EXPECT_EQ(b2.attempt(), 2);
  // The superseded attempt's result is a duplicate once the new one completed.
  ASSERT_TRUE(s.Complete("w3", 1, b2.task_id()).ok());
  auto late = s.Complete("w1", 1, b.task_id());
  ASSERT_TRUE(late.ok());
  EXPECT_TRUE(late->duplicate);
  // Block 0's third group is still out: its assembly waits; block 1's last group goes (its
  // finished group [2, 4) is skipped).
  v1::Task e = s.Next("w3", 1);
  EXPECT_EQ(e.block(), 1);
  EXPECT_EQ(e.part().index(), 3);
  EXPECT_EQ(s.Next("w4", 3).kind(), v1::TASK_KIND_WAIT);
  ASSERT_TRUE(s.Complete("w2", 2, c.task_id()).ok());
  v1::Task assemble0 = s.Next("w2", 2);
  EXPECT_EQ(assemble0.block(), 0);
  EXPECT_EQ(assemble0.part().index(), 0);
  EXPECT_EQ(assemble0.part().count(), 4);
  EXPECT_EQ(assemble0.task_id(), "block-0.p0.a1");
  auto info = s.Lookup(assemble0.task_id());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->part, 0);
  EXPECT_FALSE(info->done);
  ASSERT_TRUE(s.Complete("w2", 2, assemble0.task_id()).ok());
  EXPECT_EQ(s.blocks_done(), 1);
  ASSERT_TRUE(s.Complete("w0", 0, d.task_id()).ok());
  ASSERT_TRUE(s.Complete("w3", 1, e.task_id()).ok());
  v1::Task assemble1 = s.Next("w0", 0);
  EXPECT_EQ(assemble1.block(), 1);
  EXPECT_EQ(assemble1.part().index(), 0);
  auto last = s.Complete("w0", 0, assemble1.task_id());
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->phase_finished);
  EXPECT_TRUE(s.awaiting_finalize());
  EXPECT_TRUE(s.error().empty());
}

// A split block whose whole worker group is lost: the groups it held go back before its
// assembly, lowest block first.
TEST(SchedulerTest, AGroupLostRequeuesSplitBlocksGroupsBeforeTheirAssembly) {
  TaskPlan plan = Plan(1, false);
  plan.block_groups[0] = {{0, 1}, {1, 2}};
  JobScheduler s("job-1", 2, plan);
  v1::Task a = s.Next("w0", 0), b = s.Next("w1", 1);
  ASSERT_EQ(a.part().index(), 1);
  ASSERT_EQ(b.part().index(), 2);
  EXPECT_EQ(s.GroupLost("mpirun died").size(), 2u);
  v1::Task first = s.Next("v0", 0), second = s.Next("v1", 1);
  EXPECT_EQ(first.part().index(), 1);
  EXPECT_EQ(second.part().index(), 2);
  EXPECT_EQ(first.attempt(), 2);
  EXPECT_EQ(s.Next("v2", 2).kind(), v1::TASK_KIND_WAIT);  // the assembly waits for both
}

TEST(SchedulerTest, SequentialBlocksGoOutOneAtATimeInOrder) {
  TaskPlan plan = Plan(3, false);
  plan.sequential_blocks = true;
  JobScheduler s("job-1", 2, plan);
  v1::Task a = s.Next("w0", 0);
  ASSERT_EQ(a.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(a.block(), 0);
  EXPECT_EQ(s.Next("w1", 1).kind(), v1::TASK_KIND_WAIT);  // block 1 needs block 0's outputs
  // A lost rank's block is handed out again before any later block.
  s.WorkerLost("w0", 0);
  v1::Task again = s.Next("w1", 1);
  ASSERT_EQ(again.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(again.block(), 0);
  EXPECT_EQ(again.attempt(), 2);
  ASSERT_TRUE(s.Complete("w1", 1, again.task_id()).ok());
  v1::Task b = s.Next("w0", 0);
  ASSERT_EQ(b.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(b.block(), 1);
  EXPECT_EQ(s.Next("w1", 1).kind(), v1::TASK_KIND_WAIT);
  ASSERT_TRUE(s.Complete("w0", 0, b.task_id()).ok());
  v1::Task c = s.Next("w1", 1);
  EXPECT_EQ(c.block(), 2);
  ASSERT_TRUE(s.Complete("w1", 1, c.task_id()).ok());
  EXPECT_TRUE(s.awaiting_finalize());
}

TEST(SchedulerTest, LostWorkersBlockReturnsToTheQueueForAnotherRank) {
  JobScheduler s("job-1", 2, Plan(3, false));
  v1::Task a = s.Next("w0", 0);
  v1::Task b = s.Next("w1", 1);
  EXPECT_EQ(a.block(), 0);
  EXPECT_EQ(b.block(), 1);
  auto requeued = s.WorkerLost("w1", 1);
  ASSERT_EQ(requeued.size(), 1u);
  EXPECT_EQ(requeued[0].what, "block 1");
  EXPECT_EQ(requeued[0].next_attempt, 2);
  ASSERT_TRUE(s.Complete("w0", 0, a.task_id()).ok());
  v1::Task again = s.Next("w0", 0);
  EXPECT_EQ(again.block(), 1);  // the requeued block goes first
  EXPECT_EQ(again.attempt(), 2);
  EXPECT_EQ(again.task_id(), "block-1.a2");
  // The lost rank was only slow and completes its old attempt: counted once.
  auto late = s.Complete("w1", 1, b.task_id());
  ASSERT_TRUE(late.ok());
  EXPECT_FALSE(late->duplicate);
  auto dup = s.Complete("w0", 0, again.task_id());
  ASSERT_TRUE(dup.ok());
  EXPECT_TRUE(dup->duplicate);
  EXPECT_EQ(s.blocks_done(), 2);
  v1::Task c = s.Next("w0", 0);
  EXPECT_EQ(c.block(), 2);
  ASSERT_TRUE(s.Complete("w0", 0, c.task_id()).ok());
  EXPECT_TRUE(s.awaiting_finalize());
}

TEST(SchedulerTest, LossDuringCalibrationAsksForANewGroupWhichCalibratesAgain) {
  JobScheduler s("job-1", 2, Plan(3, true));
  s.Next("w0", 0);
  s.Next("w1", 1);
  ASSERT_TRUE(s.Complete("w0", 0, "calibrate").ok());
  EXPECT_TRUE(s.WorkerLost("w1", 1).empty());
  EXPECT_TRUE(s.error().empty()) << s.error();
  EXPECT_TRUE(s.needs_new_group());
  EXPECT_TRUE(s.GroupLost("rank 1 was lost").empty());
  EXPECT_FALSE(s.needs_new_group());
  // The new world (new worker ids) calibrates from the start: rank 0's part of the old world
  // does not count.
  EXPECT_EQ(s.phase(), "calibrate");
  EXPECT_EQ(s.Next("v0", 0).kind(), v1::TASK_KIND_CALIBRATE);
  EXPECT_EQ(s.Next("v1", 1).kind(), v1::TASK_KIND_CALIBRATE);
  ASSERT_TRUE(s.Complete("v0", 0, "calibrate").ok());
  EXPECT_EQ(s.phase(), "calibrate");
  auto last = s.Complete("v1", 1, "calibrate");
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->phase_finished);
  EXPECT_EQ(s.Next("v1", 1).block(), 0);
}

TEST(SchedulerTest, GroupLossRequeuesEveryHeldBlockAsANewAttempt) {
  JobScheduler s("job-1", 2, Plan(4, false), /*max_attempts=*/2);
  v1::Task a = s.Next("w0", 0);
  v1::Task b = s.Next("w1", 1);
  ASSERT_TRUE(s.Complete("w0", 0, a.task_id()).ok());
  v1::Task c = s.Next("w0", 0);
  auto requeued = s.GroupLost("mpirun exited");
  ASSERT_EQ(requeued.size(), 2u);
  EXPECT_TRUE(s.error().empty());
  // Lowest layer first; the finished block 0 is not redone.
  v1::Task b2 = s.Next("v0", 0);
  v1::Task c2 = s.Next("v1", 1);
  EXPECT_EQ(b2.block(), b.block());
  EXPECT_EQ(b2.attempt(), 2);
  EXPECT_EQ(c2.block(), c.block());
  EXPECT_EQ(s.blocks_done(), 1);
  // A block that takes its group down every time still ends the job after max_attempts.
  s.GroupLost("mpirun exited again");
  EXPECT_NE(s.error().find("was attempted 2 times; last: mpirun exited again"), std::string::npos)
      << s.error();
}

TEST(SchedulerTest, RetryableFailuresRequeueUntilAttemptsRunOut) {
  JobScheduler s("job-1", 1, Plan(1, false), /*max_attempts=*/2);
  v1::Task t = s.Next("w0", 0);
  auto r = s.Fail("w0", 0, t.task_id(), "out of memory", /*retryable=*/true);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  t = s.Next("w0", 0);
  EXPECT_EQ(t.attempt(), 2);
  r = s.Fail("w0", 0, t.task_id(), "out of memory", true);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->empty());
  EXPECT_NE(s.error().find("block 0 was attempted 2 times"), std::string::npos) << s.error();
  EXPECT_NE(s.error().find("out of memory"), std::string::npos);
}

TEST(SchedulerTest, NonRetryableFailureFailsTheJobAndUnknownTasksAreRejected) {
  JobScheduler s("job-1", 1, Plan(2, false));
  v1::Task t = s.Next("w0", 0);
  EXPECT_EQ(s.Complete("w0", 0, "block-7.a1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.Complete("w0", 0, "calibrate").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(s.Fail("w0", 0, t.task_id(), "shard write: disk full", false).ok());
  EXPECT_EQ(s.error(), "block 0 failed on rank 0: shard write: disk full");
}

TEST(SchedulerTest, AbandonedTaskIsRequeued) {
  JobScheduler s("job-1", 2, Plan(2, false));
  v1::Task t = s.Next("w0", 0);
  EXPECT_EQ(t.block(), 0);
  v1::Task u = s.Next("w0", 0);  // asks again without completing block 0
  EXPECT_EQ(u.block(), 0);
  EXPECT_EQ(u.attempt(), 2);
}

TEST(SchedulerTest, EndToEndFinetuneRunsOnceAfterTheLastBlock) {
  JobScheduler s("job-1", 2, Plan(1, false, /*e2e=*/true));
  v1::Task b = s.Next("w0", 0);
  EXPECT_EQ(s.Next("w1", 1).kind(), v1::TASK_KIND_WAIT);  // e2e waits for the blocks
  auto c = s.Complete("w0", 0, b.task_id());
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->phase_finished);
  EXPECT_EQ(s.phase(), "finetune");
  v1::Task e = s.Next("w1", 1);
  EXPECT_EQ(e.kind(), v1::TASK_KIND_FINETUNE_E2E);
  EXPECT_EQ(s.Next("w0", 0).kind(), v1::TASK_KIND_WAIT);  // one rank only
  auto lost = s.WorkerLost("w1", 1);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].what, "end-to-end fine-tuning");
  e = s.Next("w0", 0);
  EXPECT_EQ(e.kind(), v1::TASK_KIND_FINETUNE_E2E);
  EXPECT_EQ(e.attempt(), 2);
  ASSERT_TRUE(s.Complete("w0", 0, e.task_id()).ok());
  EXPECT_TRUE(s.awaiting_finalize());
}

TEST(SchedulerTest, EvaluationFollowsFinalizeAndResultsAreKnownByTheirRecord) {
  TaskPlan plan = Plan(1, false);
  for (int i = 0; i < 3; ++i) {
    v1::EvalParams e;
    e.set_model(i % 2 ? "quantized" : "float");
    e.set_label("f" + std::to_string(i));
    plan.evals.push_back(e);
  }
  JobScheduler s("job-1", 2, plan);
  v1::Task b = s.Next("w0", 0);
  ASSERT_EQ(b.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(b.attempt_token(), b.task_id());  // the staged files' token
  auto info = s.Lookup(b.task_id());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->kind, v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(info->index, 0);
  EXPECT_FALSE(info->done);
  EXPECT_EQ(s.Lookup("block-7.a1").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(s.Complete("w0", 0, b.task_id()).ok());
  EXPECT_TRUE(s.Lookup(b.task_id())->done);
  // Finalize: the workers wait until the manager has written the checkpoint.
  EXPECT_TRUE(s.awaiting_finalize());
  EXPECT_EQ(s.Next("w1", 1).kind(), v1::TASK_KIND_WAIT);
  s.FinalizeDone();
  EXPECT_EQ(s.phase(), "evaluate");
  v1::Task e0 = s.Next("w0", 0), e1 = s.Next("w1", 1);
  ASSERT_EQ(e0.kind(), v1::TASK_KIND_EVALUATE);
  ASSERT_EQ(e1.kind(), v1::TASK_KIND_EVALUATE);
  EXPECT_EQ(e0.eval().label(), "f0");
  EXPECT_EQ(e1.eval().label(), "f1");
  // A lost rank's evaluation goes to another.
  auto lost = s.WorkerLost("w1", 1);
  ASSERT_EQ(lost.size(), 1u);
  auto c = s.Complete("w0", 0, e0.task_id());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->eval, 0);
  v1::Task again = s.Next("w0", 0);
  EXPECT_EQ(again.eval().label(), "f1");
  EXPECT_EQ(again.attempt(), 2);
  ASSERT_TRUE(s.Complete("w0", 0, again.task_id()).ok());
  // The lost rank's attempt reporting late is a duplicate: nothing of it counts.
  auto late = s.Complete("w1", 1, e1.task_id());
  ASSERT_TRUE(late.ok());
  EXPECT_TRUE(late->duplicate);
  v1::Task last = s.Next("w0", 0);
  ASSERT_TRUE(s.Complete("w0", 0, last.task_id()).ok());
  EXPECT_TRUE(s.done());
}

}  // namespace
}  // namespace qcal::job
