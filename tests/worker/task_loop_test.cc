// The worker task loop against a fake coordinator, with thread-ranks (ThreadComm): a 2- and
// 3-rank "service" run writes a checkpoint byte-identical to the single-process RunQuantizeJob
// (with and without fine-tuning), cancellation stops the ranks, bad input fails the task with
// a non-retryable error naming the file.
#include "worker/task_loop.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <set>
#include <thread>

#include "common/atomic_file.h"
#include "runner/job_dir.h"
#include "methods/registry.h"
#include "runner/task_executor.h"
#include "tests/worker/fake_coordinator_client.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/calib/calibration.h"
#include "engine/model/llama.h"
#include "runner/quantize_job.h"
#include "engine/comm/comm.h"

namespace qcal {
namespace {

constexpr char kRecipe[] = R"(name: svc-quip
method: quip
bits: 2
codebook: e8p
incoherence: true
seed: 3
calibration:
  files: [data/tinystories/TinyStories-valid.sample30k.txt]
  num_sequences: 22
  seq_len: 64
  seed: 1
)";

constexpr char kRecipeFt[] = R"(name: svc-quip-ft
method: quip
bits: 2
codebook: e8p
seed: 3
calibration:
  files: [data/tinystories/TinyStories-valid.sample30k.txt]
  num_sequences: 20
  seq_len: 32
  seed: 1
finetune:
  enabled: true
  block: {epochs: 1, lr: 5.0e-5, batch: 4, holdout: 0.2}
  end_to_end: {enabled: true, epochs: 1, lr: 5.0e-5, batch: 4, holdout: 0.2}
)";

std::vector<std::string> ListFiles(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

class TaskLoopTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    root_ = new std::string(testing::MakeTempDir("taskloop"));
  }
  static void TearDownTestSuite() { delete root_; }

  static v1::JobSpec Spec(const std::string& yaml, const std::string& out) {
    v1::JobSpec spec;
    spec.set_recipe_path("test.yaml");
    spec.set_recipe_yaml(yaml);
    spec.set_model_dir(testing::RealModelDir("stories260K"));
    spec.set_out_dir(*root_ + "/" + out);
    spec.set_data_root(testing::SharedDir());
    spec.set_calib_batch(4);
    spec.set_threads_per_worker(1);
    return spec;
  }

  // Runs `ranks` thread-ranks against `fake`; returns each rank's loop status.
  static std::vector<StatusOr<worker::TaskLoopResult>> RunRanks(
      testing::FakeCoordinator& fake, int ranks, std::atomic<int>* cancel_calls = nullptr) {
    auto comms = comm::MakeThreadComms(ranks);
    std::vector<StatusOr<worker::TaskLoopResult>> results(ranks, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        worker::TaskLoopOptions opt;
        opt.job_id = "job";
        opt.hostname = "test";
        if (cancel_calls) opt.on_cancelled = [cancel_calls] { ++*cancel_calls; };
        results[r] = worker::RunTaskLoop(fake, *comms[r], opt);
        comms[r].reset();  // a rank that stops early must not hang the others
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }

  // Every file of the single-process checkpoint, byte for byte, in the service checkpoint.
  static void ExpectSameCheckpoint(const std::string& a, const std::string& b) {
    const auto files = ListFiles(a);
    ASSERT_FALSE(files.empty());
    EXPECT_EQ(files, ListFiles(b));
    for (const std::string& f : files) {
      auto x = ReadFile(a + "/" + f);
      auto y = ReadFile(b + "/" + f);
      ASSERT_TRUE(x.ok() && y.ok()) << f;
      EXPECT_TRUE(*x == *y) << f << " differs between " << a << " and " << b;
    }
  }

  // Single-process RunQuantizeJob, then service runs of each world size; compares every file.
  static void RunAndCompare(const std::string& yaml, const std::string& name,
                            const std::vector<int>& world_sizes) {
    const std::string& root = *root_;
    auto recipe = ParseRecipe(yaml, "test.yaml");
    ASSERT_TRUE(recipe.ok()) << recipe.status();
    // Single process.
    v1::JobSpec opt;
    opt.set_model_dir(testing::RealModelDir("stories260K"));
    opt.set_out_dir(root + "/" + name + "-single");
    opt.set_data_root(testing::SharedDir());
    opt.set_calib_batch(4);
    opt.set_threads_per_worker(1);
    auto single = job::RunQuantizeJob(*recipe, opt);
    ASSERT_TRUE(single.ok()) << single.status();

    for (int ranks : world_sizes) {
      const std::string out = name + "-svc" + std::to_string(ranks);
      testing::FakeCoordinator fake(Spec(yaml, out), *recipe, ranks);
      ASSERT_EQ(fake.error(), "");
      auto results = RunRanks(fake, ranks);
      for (int r = 0; r < ranks; ++r) {
        ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
        EXPECT_EQ(results[r]->shutdown_reason, "done");
        EXPECT_EQ(results[r]->tasks_failed, 0);
      }
      EXPECT_TRUE(fake.finalized()) << fake.error();
      EXPECT_TRUE(fake.failures().empty());
      EXPECT_EQ(static_cast<int>(fake.calibrate_results().size()), ranks);
      int64_t blocks = 0;
      for (const auto& [w, n] : fake.blocks_by_worker()) blocks += n;
      EXPECT_EQ(blocks, 5);
      std::printf("%s, %d ranks: blocks per worker:", name.c_str(), ranks);
      for (const auto& [w, n] : fake.blocks_by_worker())
        std::printf(" %s=%lld", w.c_str(), (long long)n);
      std::printf("; bits %.4f\n", fake.summary().value("code_bits", 0.0));
      ExpectSameCheckpoint(opt.out_dir(), root + "/" + out);
      // The calibration products too.
      for (int64_t l = 0; l < 5 && recipe->needs().float_hessians; ++l) {
        auto h1 = ReadFile(calib::HessianPath(JobPaths(DefaultJobDir(opt.out_dir())).hessians, l));
        auto h2 = ReadFile(calib::HessianPath(JobPaths(DefaultJobDir(root + "/" + out)).hessians, l));
        ASSERT_TRUE(h1.ok() && h2.ok());
        EXPECT_TRUE(*h1 == *h2) << "Hessians of block " << l;
      }
    }
  }

  static std::string* root_;
};
std::string* TaskLoopTest::root_ = nullptr;

TEST_F(TaskLoopTest, ServiceRunIsBitIdenticalToSingleProcess) {
  RunAndCompare(kRecipe, "quip", {2, 3});
}

TEST_F(TaskLoopTest, ServiceRunWithFinetuningIsBitIdenticalToSingleProcess) {
  RunAndCompare(kRecipeFt, "quipft", {2});
}

TEST_F(TaskLoopTest, CancellationStopsEveryRank) {
  auto recipe = ParseRecipe(kRecipe, "test.yaml");
  ASSERT_TRUE(recipe.ok());
  testing::FakeCoordinator fake(Spec(kRecipe, "cancel"), *recipe, 2);
  fake.CancelAfterHeartbeats(3);
  std::atomic<int> cancel_calls{0};
  auto results = RunRanks(fake, 2, &cancel_calls);
  for (int r = 0; r < 2; ++r) {
    // Either the loop saw the cancellation itself, or the coordinator told it to shut down.
    if (results[r].ok()) {
      EXPECT_EQ(results[r]->shutdown_reason, "cancelled");
    } else {
      EXPECT_TRUE(absl::IsCancelled(results[r].status()) || absl::IsAborted(results[r].status()))
          << results[r].status();
    }
  }
  EXPECT_GE(cancel_calls.load(), 1) << "on_cancelled must run when a heartbeat says cancelled";
  EXPECT_FALSE(fake.finalized());
}

// The calibration text was there when the job was planned (the coordinator fingerprints it) but
// is missing where the workers run: the calibration task fails, naming the file.
TEST_F(TaskLoopTest, MissingCalibrationDataFailsTheTaskNamingTheFile) {
  const std::string missing = ::qcal::testing::MakeTempDir("calib") + "/missing.txt";
  std::string yaml = kRecipe;
  yaml.replace(yaml.find("data/tinystories/TinyStories-valid.sample30k.txt"),
               std::string("data/tinystories/TinyStories-valid.sample30k.txt").size(), missing);
  auto recipe = ParseRecipe(yaml, "test.yaml");
  ASSERT_TRUE(recipe.ok());
  ASSERT_TRUE(WriteFileAtomic(missing, "Once upon a time there was a text.\n").ok());
  testing::FakeCoordinator fake(Spec(yaml, "missing"), *recipe, 2);
  ASSERT_EQ(std::remove(missing.c_str()), 0);
  auto results = RunRanks(fake, 2);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    EXPECT_EQ(results[r]->tasks_failed, 1);
  }
  const auto failures = fake.failures();
  ASSERT_EQ(failures.size(), 2u);
  bool named = false;
  for (const auto& f : failures) {
    EXPECT_EQ(f.task_id, "calibrate");
    named = named || f.error.find("missing.txt") != std::string::npos;
    if (f.error.find("missing.txt") != std::string::npos) {
      EXPECT_FALSE(f.retryable) << f.error;
    }
  }
  EXPECT_TRUE(named) << failures[0].error;
  EXPECT_FALSE(fake.finalized());
}

TEST(TaskLoopRetryTest, BadInputIsNotRetryable) {
  EXPECT_FALSE(job::IsRetryable(absl::NotFoundError("x")));
  EXPECT_FALSE(job::IsRetryable(absl::InvalidArgumentError("x")));
  EXPECT_FALSE(job::IsRetryable(absl::DataLossError("x")));
  EXPECT_TRUE(job::IsRetryable(absl::InternalError("x")));
  EXPECT_TRUE(job::IsRetryable(absl::ResourceExhaustedError("x")));
}

// Issue 18: "calibration: calibration: ..." is said once.
TEST(TaskLoopRetryTest, TaskErrorsNameTheTaskOnce) {
  EXPECT_EQ(job::AnnotateTaskError(absl::InvalidArgumentError("no files given"),
                                       "calibration").message(),
            "calibration: no files given");
  EXPECT_EQ(job::AnnotateTaskError(absl::InvalidArgumentError("calibration: no files given"),
                                       "calibration").message(),
            "calibration: no files given");
  EXPECT_EQ(job::AnnotateTaskError(absl::InternalError("calibration, block 2: out of range"),
                                       "calibration").message(),
            "calibration, block 2: out of range");
  const Status s = job::AnnotateTaskError(absl::DataLossError("x.safetensors: bad"), "block 3");
  EXPECT_EQ(s.message(), "block 3: x.safetensors: bad");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace qcal
