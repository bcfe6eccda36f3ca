// End to end through the real service: qcal-coordinator (started here) launches `mpirun -np N
// qcal-worker`; the checkpoint of a 2-rank and a 3-rank service job must be byte-identical to
// the single-process RunQuantizeJob with the same recipe and seed (labels mpi, golden).
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "common/atomic_file.h"
#include "methods/registry.h"
#include "rpc/auth.h"
#include "proto/qcal.grpc.pb.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/model/llama.h"
#include "runner/quantize_job.h"

extern char** environ;

namespace qcal {
namespace {

constexpr char kRecipe[] = R"(name: svc-e2e
method: quip
bits: 2
codebook: e8p
seed: 5
calibration:
  files: [data/tinystories/TinyStories-valid.sample30k.txt]
  num_sequences: 22
  seq_len: 64
  seed: 2
)";
constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

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

class ServiceEndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::SetComputeThreads(1);
    root_ = testing::MakeTempDir("svc");
    token_file_ = root_ + "/token";
    ASSERT_TRUE(WriteFileAtomic(token_file_, kToken).ok());
    ::chmod(token_file_.c_str(), 0600);
    const std::string build = testing::BuildDir();
    const std::string address_file = root_ + "/address";
    std::vector<std::string> args = {build + "/coordinator/qcal-coordinator",
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--state",
                                     root_ + "/state",
                                     "--auth-token-file",
                                     token_file_,
                                     "--address-file",
                                     address_file,
                                     "--worker-binary",
                                     build + "/worker/qcal-worker",
                                     "--heartbeat-timeout",
                                     "60"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ASSERT_EQ(::posix_spawn(&coordinator_, argv[0], nullptr, nullptr, argv.data(), environ), 0)
        << argv[0];
    for (int i = 0; i < 300; ++i) {
      auto a = ReadFile(address_file);
      if (a.ok() && !a->empty()) {
        address_ = a->substr(0, a->find('\n'));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_FALSE(address_.empty()) << "the coordinator did not write " << address_file;
    auto channel = rpc::MakeChannel(address_);
    ASSERT_TRUE(channel.ok()) << channel.status();
    ASSERT_TRUE(rpc::WaitForHealthy(*channel, std::chrono::seconds(30)).ok());
    stub_ = v1::JobService::NewStub(*channel);
  }
  void TearDown() override {
    if (coordinator_ > 0) {
      ::kill(coordinator_, SIGTERM);
      int status = 0;
      ::waitpid(coordinator_, &status, 0);
    }
  }

  // Submits and waits for a final state.
  v1::Job RunJob(const std::string& out, int workers) {
    v1::SubmitJobRequest req;
    v1::JobSpec* spec = req.mutable_spec();
    spec->set_recipe_path(root_ + "/recipe.yaml");
    spec->set_recipe_yaml(kRecipe);
    spec->set_model_dir(testing::RealModelDir("stories260K"));
    spec->set_out_dir(root_ + "/" + out);
    spec->set_data_root(testing::SharedDir());
    spec->set_workers(workers);
    spec->set_threads_per_worker(1);
    spec->set_calib_batch(4);
    spec->set_name(out);
    v1::SubmitJobResponse submitted;
    {
      grpc::ClientContext ctx;
      rpc::AddBearerToken(&ctx, kToken);
      const grpc::Status s = stub_->SubmitJob(&ctx, req, &submitted);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) return {};
    }
    v1::Job job;
    for (int i = 0; i < 6000; ++i) {
      grpc::ClientContext ctx;
      rpc::AddBearerToken(&ctx, kToken);
      v1::GetJobRequest get;
      get.set_job_id(submitted.job_id());
      const grpc::Status s = stub_->GetJob(&ctx, get, &job);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) break;
      if (job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED ||
          job.state() == v1::JOB_STATE_CANCELLED) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return job;
  }

  std::string root_, token_file_, address_;
  pid_t coordinator_ = -1;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

TEST_F(ServiceEndToEndTest, TwoAndThreeRankJobsWriteTheSingleProcessCheckpoint) {
  auto recipe = ParseRecipe(kRecipe, "recipe.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  v1::JobSpec opt;
  opt.set_model_dir(testing::RealModelDir("stories260K"));
  opt.set_out_dir(root_ + "/single");
  opt.set_data_root(testing::SharedDir());
  opt.set_calib_batch(4);
  opt.set_threads_per_worker(1);
  auto single = job::RunQuantizeJob(*recipe, opt);
  ASSERT_TRUE(single.ok()) << single.status();

  for (int workers : {2, 3}) {
    const std::string out = "svc" + std::to_string(workers);
    const auto t0 = std::chrono::steady_clock::now();
    const v1::Job job = RunJob(out, workers);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED)
        << workers << " workers: " << job.error() << "\nworkers.log:\n"
        << ReadFile(root_ + "/" + out + ".job/workers.log").value_or("(none)");
    std::printf("%d workers: job %s succeeded in %.1f s, blocks by rank:", workers,
                job.id().c_str(), secs);
    for (const auto& b : job.blocks()) std::printf(" %lld:r%d", (long long)b.block(), b.rank());
    std::printf("\n");
    const auto files = ListFiles(opt.out_dir());
    ASSERT_FALSE(files.empty());
    EXPECT_EQ(files, ListFiles(root_ + "/" + out));
    for (const std::string& f : files) {
      auto a = ReadFile(opt.out_dir() + "/" + f);
      auto b = ReadFile(root_ + "/" + out + "/" + f);
      ASSERT_TRUE(a.ok() && b.ok()) << f;
      EXPECT_TRUE(*a == *b) << workers << " workers: " << f << " differs";
    }
  }
}

}  // namespace
}  // namespace qcal
