// The JobManager with fakes for the clock, launcher, state filesystem and job directory; the
// test plays the workers by calling the WorkerService methods directly.
#include "coordinator/job_manager.h"

#include <chrono>
#include <deque>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "tests/coordinator/fakes.h"
#include "tests/coordinator/test_env.h"

namespace qcal::coordinator {
namespace {

using testing::FakeClock;
using testing::FakeLauncher;
using testing::FakeWorkspace;
using testing::FakeWorkspaceState;
using testing::MemStateFs;
using testing::TestEnv;

constexpr char kRtnRecipe[] = "name: rtn-test\nmethod: rtn\nbits: 4\n";

class ManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { env_ = TestEnv::Make("manager"); }

  std::unique_ptr<JobManager> MakeManager() {
    auto store = JobStore::Open(&fs_, "/state");
    EXPECT_TRUE(store.ok()) << store.status();
    ManagerOptions o;
    o.auth_token_file = "/secrets/token";
    o.heartbeat_timeout_s = 10;
    o.kill_grace_s = 5;
    o.tick_s = 0;  // the test calls Tick()
    o.wait_ms = 1;
    auto m = std::make_unique<JobManager>(
        o, &clock_, &launcher_,
        [this] {
          std::lock_guard<std::mutex> l(ws_mu_);
          std::shared_ptr<FakeWorkspaceState> s;
          if (!next_ws_.empty()) {
            s = next_ws_.front();
            next_ws_.pop_front();
          } else {
            s = std::make_shared<FakeWorkspaceState>();
          }
          all_ws_.push_back(s);
          return std::make_unique<FakeWorkspace>(s);
        },
        std::move(*store));
    m->SetWorkerAddress("127.0.0.1:5000");
    EXPECT_TRUE(m->Start().ok());
    return m;
  }

  std::shared_ptr<FakeWorkspaceState> NextWorkspace() {
    auto s = std::make_shared<FakeWorkspaceState>();
    std::lock_guard<std::mutex> l(ws_mu_);
    next_ws_.push_back(s);
    return s;
  }

  // Polls (real time, the driver is a thread) until `pred` holds; returns the job.
  v1::Job WaitFor(JobManager& m, const std::string& id,
                  const std::function<bool(const v1::Job&)>& pred) {
    v1::Job job;
    for (int i = 0; i < 2000; ++i) {
      auto j = m.Get(id);
      EXPECT_TRUE(j.ok());
      job = *j;
      if (pred(job)) return job;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "timed out; job is " << job.DebugString();
    return job;
  }
  static bool Running(const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; }
  static bool Final(const v1::Job& j) { return IsFinalState(j.state()); }

  std::string Register(JobManager& m, const std::string& job, int rank, int world) {
    v1::RegisterWorkerRequest r;
    r.set_job_id(job);
    r.set_rank(rank);
    r.set_world_size(world);
    r.set_hostname("host");
    r.set_pid(100 + rank);
    auto resp = m.RegisterWorker(r);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? resp->worker_id() : "";
  }

  static v1::BlockResult BlockDone(int64_t layer) {
    v1::BlockResult r;
    r.set_layer(layer);
    r.set_seconds(0.25);
    r.mutable_shard()->set_name(absl::StrCat("model-", layer + 1, ".safetensors"));
    r.mutable_shard()->set_staged(absl::StrCat("model-", layer + 1, ".safetensors.x"));
    return r;
  }

  Status Complete(JobManager& m, const std::string& worker, const v1::Task& t) {
    v1::CompleteTaskRequest c;
    c.set_worker_id(worker);
    c.set_task_id(t.task_id());
    if (t.kind() == v1::TASK_KIND_QUANTIZE_BLOCK) *c.mutable_block() = BlockDone(t.block());
    if (t.kind() == v1::TASK_KIND_FINETUNE_E2E) c.mutable_finetune()->set_kl_after(0.1);
    if (t.kind() == v1::TASK_KIND_CALIBRATE) c.mutable_calibrate()->set_tokens(1);
    if (t.kind() == v1::TASK_KIND_EVALUATE) {
      *c.mutable_eval()->mutable_params() = t.eval();
      c.mutable_eval()->set_perplexity(12.5);
    }
    return m.CompleteTask(c);
  }

  // Every worker asks, does and completes tasks until each got SHUTDOWN. Returns blocks per rank.
  std::map<int, int> RunWorkers(JobManager& m, const std::vector<std::string>& workers) {
    std::map<int, int> blocks;
    std::set<size_t> stopped;
    for (int round = 0; round < 5000 && stopped.size() < workers.size(); ++round) {
      for (size_t r = 0; r < workers.size(); ++r) {
        if (stopped.count(r)) continue;
        auto t = m.NextTask(workers[r]);
        EXPECT_TRUE(t.ok()) << t.status();
        if (!t.ok() || t->kind() == v1::TASK_KIND_SHUTDOWN) {
          stopped.insert(r);
          continue;
        }
        if (t->kind() == v1::TASK_KIND_WAIT) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        if (t->kind() == v1::TASK_KIND_QUANTIZE_BLOCK) ++blocks[static_cast<int>(r)];
        EXPECT_TRUE(Complete(m, workers[r], *t).ok());
      }
    }
    EXPECT_EQ(stopped.size(), workers.size()) << "workers never got SHUTDOWN";
    return blocks;
  }

  std::vector<v1::JobEvent> AllEvents(JobManager& m, const std::string& id) {
    std::vector<v1::JobEvent> events;
    Status s = m.Watch(
        id, 0, [&](const v1::JobEvent& e) { events.push_back(e); return true; },
        [] { return false; });
    EXPECT_TRUE(s.ok()) << s;
    return events;
  }

  TestEnv env_;
  FakeClock clock_;
  FakeLauncher launcher_;
  MemStateFs fs_;
  std::mutex ws_mu_;
  std::deque<std::shared_ptr<FakeWorkspaceState>> next_ws_;
  std::vector<std::shared_ptr<FakeWorkspaceState>> all_ws_;
};

TEST_F(ManagerTest, AJobRunsThroughEveryPhaseAndJournalsEachBlock) {
  auto ws = NextWorkspace();
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(2));
  ASSERT_TRUE(id.ok()) << id.status();
  v1::Job job = WaitFor(*m, *id, Running);
  ASSERT_EQ(launcher_.groups().size(), 1u);
  const LaunchSpec& ls = launcher_.groups()[0]->spec;
  EXPECT_EQ(ls.workers, 2);
  EXPECT_EQ(ls.job_id, *id);
  EXPECT_EQ(ls.coordinator_address, "127.0.0.1:5000");
  EXPECT_EQ(ls.auth_token_file, "/secrets/token");
  EXPECT_EQ(ls.log_path, env_.out_dir + ".job/workers.log");
  EXPECT_EQ(job.phase(), "calibrate");
  EXPECT_EQ(job.blocks_total(), 4);

  const std::string w0 = Register(*m, *id, 0, 2);
  const std::string w1 = Register(*m, *id, 1, 2);
  EXPECT_EQ(m->Get(*id)->workers_alive(), 2);
  std::map<int, int> blocks = RunWorkers(*m, {w0, w1});
  EXPECT_EQ(blocks[0] + blocks[1], 4);

  job = WaitFor(*m, *id, Final);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
  EXPECT_EQ(job.phase(), "done");
  EXPECT_EQ(job.blocks_done(), 4);
  ASSERT_EQ(job.blocks_size(), 4);
  for (const auto& b : job.blocks()) {
    EXPECT_FALSE(b.resumed());
    EXPECT_EQ(b.seconds(), 0.25);
    EXPECT_TRUE(b.rank() == 0 || b.rank() == 1);
  }
  EXPECT_EQ(job.result_json(), R"({"code_bits_per_weight":2.0})");
  // The coordinator wrote the journal: job_start, one block_done per block, job_done.
  ASSERT_EQ(ws->journal.size(), 6u);
  EXPECT_EQ(ws->journal.front()["event"], "job_start");
  EXPECT_EQ(ws->journal.back()["event"], "job_done");
  EXPECT_EQ(ws->finalized, 1);

  std::vector<v1::JobEvent> events = AllEvents(*m, *id);
  std::vector<std::string> phases;
  int block_events = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].seq(), static_cast<int64_t>(i + 1));
    if (events[i].kind() == v1::JOB_EVENT_KIND_PHASE) phases.push_back(events[i].phase());
    if (events[i].kind() == v1::JOB_EVENT_KIND_BLOCK_DONE) {
      ++block_events;
      EXPECT_EQ(events[i].done(), block_events);
      EXPECT_EQ(events[i].total(), 4);
      EXPECT_EQ(events[i].block().result().layer(), events[i].block().block());
    }
  }
  EXPECT_EQ(phases, (std::vector<std::string>{"calibrate", "quantize", "finalize", "done"}));
  EXPECT_EQ(block_events, 4);
  EXPECT_EQ(events.front().state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(events.back().kind(), v1::JOB_EVENT_KIND_STATE);
  EXPECT_EQ(events.back().state(), v1::JOB_STATE_SUCCEEDED);
  // A watcher resuming after the last event it saw gets nothing more and returns.
  int more = 0;
  EXPECT_TRUE(m->Watch(*id, events.back().seq(),
                       [&](const v1::JobEvent&) { return ++more > 0; }, [] { return false; })
                  .ok());
  EXPECT_EQ(more, 0);
}

TEST_F(ManagerTest, ASilentWorkersBlockGoesToAnotherRank) {
  auto m = MakeManager();
  v1::JobSpec spec = env_.Spec(2);
  spec.set_recipe_yaml(kRtnRecipe);  // no calibration: straight to blocks
  auto id = m->Submit(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 2);
  const std::string w1 = Register(*m, *id, 1, 2);
  v1::Task t1 = *m->NextTask(w1);
  v1::Task t0 = *m->NextTask(w0);
  EXPECT_EQ(t1.block(), 0);
  EXPECT_EQ(t0.block(), 1);
  clock_.Advance(6);
  ASSERT_TRUE(m->Heartbeat(w0).ok());
  m->Tick();
  EXPECT_EQ(m->Get(*id)->workers_alive(), 2);
  clock_.Advance(5);  // w1 silent for 11 s > 10 s
  m->Tick();
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.workers_alive(), 1);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(Complete(*m, w0, t0).ok());
  v1::Task again = *m->NextTask(w0);
  EXPECT_EQ(again.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_EQ(again.block(), 0);
  EXPECT_EQ(again.attempt(), 2);
  bool warned = false;
  m->Watch(
      *id, 0,
      [&](const v1::JobEvent& e) {
        if (e.kind() == v1::JOB_EVENT_KIND_WARNING &&
            e.message().find("block 0 returns to the queue (attempt 2)") != std::string::npos &&
            e.message().find("rank 1") != std::string::npos) {
          warned = true;
        }
        return !warned;  // stop once seen
      },
      [] { return false; });
  EXPECT_TRUE(warned);
  ASSERT_TRUE(Complete(*m, w0, again).ok());
  RunWorkers(*m, {w0});
  // w1 is gone, so w0 finishes alone.
  v1::Job done = WaitFor(*m, *id, Final);
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.error();
  int by_rank0 = 0;
  for (const auto& b : done.blocks()) by_rank0 += b.rank() == 0;
  EXPECT_EQ(by_rank0, 4);
}

TEST_F(ManagerTest, ARankLostDuringCalibrationReplacesTheGroup) {
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(2));
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 2);
  const std::string w1 = Register(*m, *id, 1, 2);
  EXPECT_EQ(m->NextTask(w0)->kind(), v1::TASK_KIND_CALIBRATE);
  EXPECT_EQ(m->NextTask(w1)->kind(), v1::TASK_KIND_CALIBRATE);
  clock_.Advance(8);
  ASSERT_TRUE(m->Heartbeat(w0).ok());
  clock_.Advance(3);
  m->Tick();  // rank 1 expires: the collective cannot finish, the group is killed and replaced
  ASSERT_EQ(launcher_.groups().size(), 2u);
  EXPECT_EQ(launcher_.groups()[0]->kills, 1);
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.error();
  EXPECT_EQ(job.phase(), "calibrate");
  // The old world's workers are forgotten; the new world calibrates and finishes the job.
  EXPECT_FALSE(m->NextTask(w0).ok());
  const std::string v0 = Register(*m, *id, 0, 2);
  const std::string v1 = Register(*m, *id, 1, 2);
  RunWorkers(*m, {v0, v1});
  job = WaitFor(*m, *id, Final);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
  EXPECT_EQ(job.blocks_done(), 4);
  bool warned = false;
  for (const v1::JobEvent& e : AllEvents(*m, *id)) {
    warned |= e.kind() == v1::JOB_EVENT_KIND_WARNING &&
              e.message().find("relaunching the group (1 of 3)") != std::string::npos;
  }
  EXPECT_TRUE(warned);
}

TEST_F(ManagerTest, ADeadGroupIsRelaunchedAndFinishedBlocksAreNotRedone) {
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(2));
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  std::string w0 = Register(*m, *id, 0, 2);
  std::string w1 = Register(*m, *id, 1, 2);
  for (const std::string& w : {w0, w1}) ASSERT_TRUE(Complete(*m, w, *m->NextTask(w)).ok());
  v1::Task b0 = *m->NextTask(w0);
  ASSERT_TRUE(Complete(*m, w0, b0).ok());
  v1::Task b1 = *m->NextTask(w1);  // in flight when the group dies
  ASSERT_EQ(b1.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  {
    auto g = launcher_.groups().at(0);
    std::lock_guard<std::mutex> l(g->mu);
    g->exit = "exit code 137";  // mpirun tore the world down after a rank was SIGKILLed
  }
  m->Tick();
  ASSERT_EQ(launcher_.groups().size(), 2u);
  EXPECT_EQ(m->Get(*id)->state(), v1::JOB_STATE_RUNNING);
  const std::string v0 = Register(*m, *id, 0, 2);
  const std::string v1 = Register(*m, *id, 1, 2);
  v1::Task again = *m->NextTask(v0);
  EXPECT_EQ(again.block(), b1.block());
  EXPECT_EQ(again.attempt(), 2);
  ASSERT_TRUE(Complete(*m, v0, again).ok());
  RunWorkers(*m, {v0, v1});
  v1::Job job = WaitFor(*m, *id, Final);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
  std::map<int64_t, int> done_per_block;
  for (const auto& b : job.blocks()) ++done_per_block[b.block()];
  EXPECT_EQ(done_per_block.size(), 4u);
  for (const auto& [block, n] : done_per_block) EXPECT_EQ(n, 1) << "block " << block;
  // The journal holds each block once.
  int journaled = 0;
  for (const auto& e : all_ws_.at(0)->journal) journaled += e.value("event", "") == "block_done";
  EXPECT_EQ(journaled, 4);
}

TEST_F(ManagerTest, AGroupThatKeepsDyingFailsTheJobWithItsLog) {
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(2));
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  for (int i = 0; i < 4; ++i) {
    auto groups = launcher_.groups();
    ASSERT_EQ(groups.size(), static_cast<size_t>(i + 1));
    {
      std::lock_guard<std::mutex> l(groups.back()->mu);
      groups.back()->exit = "exit code 1";
    }
    m->Tick();
  }
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.error().find("exited before the job finished"), std::string::npos) << job.error();
  EXPECT_NE(job.error().find("exit code 1"), std::string::npos);
  EXPECT_NE(job.error().find("after 3 relaunch(es)"), std::string::npos) << job.error();
  EXPECT_NE(job.error().find(env_.out_dir + ".job/workers.log"), std::string::npos);
  EXPECT_NE(job.error().find("line 2: something broke"), std::string::npos);
  EXPECT_EQ(launcher_.groups().size(), 4u);
}

TEST_F(ManagerTest, CancelStopsTheWorkersAfterAGracePeriod) {
  launcher_.ignore_sigterm = true;  // so the SIGKILL stage is reached
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(1));
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 1);
  EXPECT_EQ(m->NextTask(w0)->kind(), v1::TASK_KIND_CALIBRATE);
  EXPECT_FALSE(*m->Heartbeat(w0));
  auto cancelled = m->Cancel(*id);
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(*m->Heartbeat(w0));
  v1::ReportProgressRequest p;
  p.set_worker_id(w0);
  p.set_phase("calibrate");
  EXPECT_TRUE(*m->ReportProgress(p));
  EXPECT_EQ(m->NextTask(w0)->kind(), v1::TASK_KIND_SHUTDOWN);
  auto group = launcher_.groups().at(0);
  m->Tick();
  EXPECT_EQ(group->terminates, 0);  // the workers get a grace period to exit on their own
  clock_.Advance(5);
  m->Tick();
  EXPECT_EQ(group->terminates, 1);
  EXPECT_EQ(group->kills, 0);
  clock_.Advance(5);
  m->Tick();
  EXPECT_EQ(group->kills, 1);
  m->Tick();  // the group is gone now
  EXPECT_EQ(m->Get(*id)->workers_alive(), 0);
  EXPECT_EQ(m->Get(*id)->state(), v1::JOB_STATE_CANCELLED);  // stays cancelled
  // Cancelling again is harmless.
  EXPECT_EQ(m->Cancel(*id)->state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(ManagerTest, AFailingJobLeavesTheOthersRunning) {
  auto bad = NextWorkspace();
  bad->open_error = absl::InvalidArgumentError("/m/config.json: hidden_size is missing");
  auto good = NextWorkspace();
  auto m = MakeManager();
  auto a = m->Submit(env_.Spec(1));
  ASSERT_TRUE(a.ok());
  v1::JobSpec spec = env_.Spec(1, env_.root + "/out2");
  spec.set_recipe_yaml(kRtnRecipe);
  auto b = m->Submit(spec);
  ASSERT_TRUE(b.ok()) << b.status();
  v1::Job ja = WaitFor(*m, *a, Final);
  EXPECT_EQ(ja.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(ja.error(), "/m/config.json: hidden_size is missing");
  WaitFor(*m, *b, Running);
  RunWorkers(*m, {Register(*m, *b, 0, 1)});
  EXPECT_EQ(WaitFor(*m, *b, Final).state(), v1::JOB_STATE_SUCCEEDED);

  // Bad specs never become jobs.
  auto invalid = m->Submit(env_.Spec(0));
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid.status().message(), "workers must be at least 1 (got 0)");
  EXPECT_EQ(m->List().size(), 2u);
}

TEST_F(ManagerTest, TwoActiveJobsCannotShareAnOutput) {
  auto m = MakeManager();
  auto a = m->Submit(env_.Spec(1));
  ASSERT_TRUE(a.ok());
  auto b = m->Submit(env_.Spec(1));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(b.status().message().find("out_dir '" + env_.out_dir + "' is the out_dir '" +
                                      env_.out_dir + "' of job " + *a),
            absl::string_view::npos)
      << b.status();
  ASSERT_TRUE(m->Cancel(*a).ok());
  EXPECT_TRUE(m->Submit(env_.Spec(1)).ok());  // once the first ended
}

TEST_F(ManagerTest, ResumedBlocksAreReportedAndSkipped) {
  auto ws = NextWorkspace();
  ws->finished = {0, 2};
  auto m = MakeManager();
  v1::JobSpec spec = env_.Spec(1);
  spec.set_recipe_yaml(kRtnRecipe);
  auto id = m->Submit(spec);
  ASSERT_TRUE(id.ok());
  v1::Job job = WaitFor(*m, *id, Running);
  EXPECT_EQ(job.blocks_done(), 2);
  ASSERT_EQ(job.blocks_size(), 2);
  EXPECT_TRUE(job.blocks(0).resumed());
  EXPECT_EQ(job.blocks(0).seconds(), 0.5);
  const std::string w0 = Register(*m, *id, 0, 1);
  v1::Task t = *m->NextTask(w0);
  EXPECT_EQ(t.block(), 1);
  ASSERT_TRUE(Complete(*m, w0, t).ok());
  t = *m->NextTask(w0);
  EXPECT_EQ(t.block(), 3);
  ASSERT_TRUE(Complete(*m, w0, t).ok());
  EXPECT_EQ(WaitFor(*m, *id, Final).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(ManagerTest, ARestartedCoordinatorKnowsEveryJob) {
  std::string done_id, running_id;
  std::map<std::string, std::string> crashed_state;
  {
    auto m = MakeManager();
    v1::JobSpec spec = env_.Spec(1);
    spec.set_recipe_yaml(kRtnRecipe);
    done_id = *m->Submit(spec);
    WaitFor(*m, done_id, Running);
    RunWorkers(*m, {Register(*m, done_id, 0, 1)});
    WaitFor(*m, done_id, Final);
    running_id = *m->Submit(env_.Spec(1, env_.root + "/out2"));
    WaitFor(*m, running_id, Running);
    crashed_state = fs_.Snapshot();  // as if the process died here
  }
  fs_.Restore(crashed_state);
  auto m = MakeManager();
  std::vector<v1::Job> jobs = m->List();
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id(), done_id);
  EXPECT_EQ(jobs[0].state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(jobs[0].blocks_size(), 4);
  EXPECT_EQ(jobs[1].id(), running_id);
  // The unfinished job resumes: a new group (after stopping what the dead coordinator left,
  // Launcher::StopLeftovers), planned again from its journal.
  v1::Job resumed = WaitFor(*m, running_id, Running);
  EXPECT_TRUE(resumed.error().empty()) << resumed.error();
  const size_t groups_before = 2;  // one per job of the first coordinator
  ASSERT_EQ(launcher_.groups().size(), groups_before + 1);
  EXPECT_EQ(launcher_.groups().back()->spec.job_id, running_id);
  EXPECT_EQ(launcher_.groups().back()->spec.pid_file, env_.root + "/out2.job/workers.pid");
  RunWorkers(*m, {Register(*m, running_id, 0, 1)});
  EXPECT_EQ(WaitFor(*m, running_id, Final).state(), v1::JOB_STATE_SUCCEEDED);
  bool said = false;
  for (const v1::JobEvent& e : AllEvents(*m, running_id)) {
    said |= e.kind() == v1::JOB_EVENT_KIND_WARNING &&
            e.message() == "the coordinator restarted while the job was RUNNING; resuming it "
                           "from its journal";
  }
  EXPECT_TRUE(said);
  // Watching an old job replays its final state.
  std::vector<v1::JobEvent> events = AllEvents(*m, done_id);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].state(), v1::JOB_STATE_SUCCEEDED);
  auto next = m->Submit(env_.Spec(1, env_.root + "/out3"));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, "job-000003");
}

TEST_F(ManagerTest, WatchWakesOnEventsAndEndsOnShutdown) {
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(1));
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  std::atomic<int> received{0};
  Status watch_status = absl::UnknownError("not returned");
  v1::JobEvent last;
  std::thread watcher([&] {
    watch_status = m->Watch(
        *id, 0,
        [&](const v1::JobEvent& e) {
          last = e;
          ++received;
          return true;
        },
        [] { return false; });
  });
  const std::string w0 = Register(*m, *id, 0, 1);
  for (int i = 0; i < 200 && received.load() < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(received.load(), 5);  // QUEUED, started, RUNNING, phase, registered
  m->Shutdown();                  // must not hang with a watcher blocked
  watcher.join();
  // The job is not over: it stays RUNNING in the store, for the next coordinator to resume.
  EXPECT_EQ(watch_status.code(), absl::StatusCode::kUnavailable) << watch_status;
  EXPECT_EQ(last.kind(), v1::JOB_EVENT_KIND_WARNING);
  EXPECT_EQ(last.state(), v1::JOB_STATE_RUNNING);
  EXPECT_NE(last.message().find("the coordinator is shutting down; the job resumes"),
            std::string::npos) << last.message();
  // A watcher whose client went away returns Cancelled.
  auto m2 = MakeManager();
  auto id2 = m2->Submit(env_.Spec(1, env_.root + "/out4"));
  ASSERT_TRUE(id2.ok());
  Status s = m2->Watch(*id2, 1000000, [](const v1::JobEvent&) { return true; },
                       [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(m2->Watch("job-999999", 0, nullptr, nullptr).code(), absl::StatusCode::kNotFound);
}

TEST_F(ManagerTest, BadResultsAreRefused) {
  auto m = MakeManager();
  v1::JobSpec spec = env_.Spec(1);
  spec.set_recipe_yaml(kRtnRecipe);
  auto id = m->Submit(spec);
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 1);
  // A second rank 0 while the first is alive, a wrong world size, an unknown worker.
  v1::RegisterWorkerRequest dup;
  dup.set_job_id(*id);
  dup.set_rank(0);
  dup.set_world_size(1);
  EXPECT_EQ(m->RegisterWorker(dup).status().code(), absl::StatusCode::kAlreadyExists);
  dup.set_world_size(3);
  EXPECT_EQ(m->RegisterWorker(dup).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->NextTask("nobody").status().code(), absl::StatusCode::kNotFound);

  // Bad results count as failed attempts: the block returns to the queue, then the job fails.
  v1::Task t = *m->NextTask(w0);
  v1::CompleteTaskRequest c;
  c.set_worker_id(w0);
  c.set_task_id(t.task_id());
  c.mutable_calibrate()->set_tokens(1);  // another task's result
  Status s = m->CompleteTask(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "invalid result for block-0.a1: no block result");
  EXPECT_EQ(m->Get(*id)->state(), v1::JOB_STATE_RUNNING);

  t = *m->NextTask(w0);
  EXPECT_EQ(t.block(), 0);
  EXPECT_EQ(t.attempt(), 2);
  c.set_task_id(t.task_id());
  *c.mutable_block() = BlockDone(t.block() + 1);  // the wrong layer
  s = m->CompleteTask(c);
  EXPECT_EQ(s.message(), "invalid result for block-0.a2: the result is for block 1, not 0");

  all_ws_.back()->check_error = absl::DataLossError("/out/model-00001-of-00004.safetensors: "
                                                    "checksum 1 does not match");
  t = *m->NextTask(w0);
  EXPECT_EQ(t.attempt(), 3);
  c.set_task_id(t.task_id());
  *c.mutable_block() = BlockDone(t.block());
  EXPECT_EQ(m->CompleteTask(c).code(), absl::StatusCode::kInvalidArgument);
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.error().find("block 0 was attempted 3 times"), std::string::npos) << job.error();
  EXPECT_NE(job.error().find("checksum 1 does not match"), std::string::npos) << job.error();
  EXPECT_EQ(m->NextTask(w0)->kind(), v1::TASK_KIND_SHUTDOWN);
}

// Committing a result (renames and fsyncs on a shared filesystem, slow) happens outside the
// manager's lock: while one block's files are being committed, the service answers every other
// call, other workers' heartbeats and task requests included; the block counts only once its
// files are in place and journaled.
TEST_F(ManagerTest, ACommitInProgressDoesNotHoldTheService) {
  auto ws = NextWorkspace();
  std::promise<void> release;
  ws->commit_gate = release.get_future().share();
  auto m = MakeManager();
  v1::JobSpec spec = env_.Spec(2);
  spec.set_recipe_yaml(kRtnRecipe);
  auto id = m->Submit(spec);
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 2);
  const std::string w1 = Register(*m, *id, 1, 2);
  v1::Task t0 = *m->NextTask(w0);
  ASSERT_EQ(t0.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  std::thread completing([&] { EXPECT_TRUE(Complete(*m, w0, t0).ok()); });
  for (int i = 0; i < 2000 && ws->commits_waiting.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(ws->commits_waiting.load(), 1) << "the commit never started";

  // The commit is held: the service still answers.
  EXPECT_TRUE(m->Heartbeat(w1).ok());
  v1::Task t1 = *m->NextTask(w1);
  EXPECT_EQ(t1.kind(), v1::TASK_KIND_QUANTIZE_BLOCK);
  EXPECT_NE(t1.block(), t0.block());
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.blocks_done(), 0) << "a block counted before its files were committed";
  {
    std::lock_guard<std::mutex> l(ws->mu);
    EXPECT_TRUE(ws->committed.empty());
  }

  release.set_value();
  completing.join();
  job = *m->Get(*id);
  EXPECT_EQ(job.blocks_done(), 1);
  {
    std::lock_guard<std::mutex> l(ws->mu);
    ASSERT_EQ(ws->committed.size(), 1u);
    EXPECT_EQ(ws->journal.back()["event"], "block_done");
  }
  EXPECT_TRUE(Complete(*m, w1, t1).ok());
  RunWorkers(*m, {w0, w1});
  job = WaitFor(*m, *id, Final);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
  EXPECT_EQ(job.blocks_done(), 4);
}

TEST_F(ManagerTest, WorkerFailuresRequeueOrFailTheJob) {
  auto m = MakeManager();
  v1::JobSpec spec = env_.Spec(1);
  spec.set_recipe_yaml(kRtnRecipe);
  auto id = m->Submit(spec);
  ASSERT_TRUE(id.ok());
  WaitFor(*m, *id, Running);
  const std::string w0 = Register(*m, *id, 0, 1);
  v1::Task t = *m->NextTask(w0);
  v1::FailTaskRequest f;
  f.set_worker_id(w0);
  f.set_task_id(t.task_id());
  f.set_error("CUDA out of memory");
  f.set_retryable(true);
  ASSERT_TRUE(m->FailTask(f).ok());
  v1::Task again = *m->NextTask(w0);
  EXPECT_EQ(again.block(), t.block());
  EXPECT_EQ(again.attempt(), 2);
  f.set_task_id(again.task_id());
  f.set_error("/out/model-00001-of-00004.safetensors: Permission denied");
  f.set_retryable(false);
  ASSERT_TRUE(m->FailTask(f).ok());
  v1::Job job = *m->Get(*id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.error(),
            "block 0 failed on rank 0: /out/model-00001-of-00004.safetensors: Permission denied");
}

TEST_F(ManagerTest, LaunchFailureFailsTheJob) {
  launcher_.fail_with = absl::FailedPreconditionError("worker binary '/x/qcal-worker' is missing");
  auto m = MakeManager();
  auto id = m->Submit(env_.Spec(1));
  ASSERT_TRUE(id.ok());
  v1::Job job = WaitFor(*m, *id, Final);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.error(), "cannot start the workers: worker binary '/x/qcal-worker' is missing");
}

}  // namespace
}  // namespace qcal::coordinator
