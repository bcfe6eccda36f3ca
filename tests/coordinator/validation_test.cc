// Submitted specs are checked before a job exists; each problem gets a precise message.
#include "coordinator/validation.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "runner/workspace.h"
#include "tests/coordinator/test_env.h"

namespace qcal::coordinator {
namespace {

using testing::TestEnv;

// The InvalidArgument message ValidateJobSpec gives `spec` ("" when it accepts it).
std::string Problem(v1::JobSpec spec) {
  StatusOr<Recipe> r = ValidateJobSpec(&spec);
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  return std::string(r.status().message());
}

TEST(ValidationTest, AcceptsAGoodSpecAndNormalizesPaths) {
  TestEnv env = TestEnv::Make("valid");
  v1::JobSpec spec = env.Spec();
  spec.set_out_dir(env.root + "/x/../out/");
  StatusOr<Recipe> r = ValidateJobSpec(&spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name, "quip-test");
  EXPECT_EQ(spec.out_dir(), env.out_dir);
}

TEST(ValidationTest, EachProblemHasAPreciseMessage) {
  TestEnv env = TestEnv::Make("valid");
  v1::JobSpec s = env.Spec();

  s = env.Spec(0);
  EXPECT_EQ(Problem(s), "workers must be at least 1 (got 0)");
  s = env.Spec(100000);
  EXPECT_EQ(Problem(s), "workers must be at most 1024 (got 100000)");
  s = env.Spec();
  s.set_threads_per_worker(2000);
  EXPECT_EQ(Problem(s), "threads_per_worker must be in [0, 1024] (got 2000)");
  s = env.Spec();
  s.set_device("gpu");
  EXPECT_EQ(Problem(s), "device must be auto, cpu, cuda or cuda:N (got 'gpu')");
  s.set_device("cuda:1x");
  EXPECT_EQ(Problem(s), "device must be auto, cpu, cuda or cuda:N (got 'cuda:1x')");
  for (const char* ok : {"", "auto", "cpu", "cuda", "cuda:3"}) {
    s.set_device(ok);
    EXPECT_EQ(Problem(s), "") << ok;
  }
  s = env.Spec();
  s.set_recipe_yaml("method: quip\nname: \xff\n");
  EXPECT_NE(Problem(s).find("not UTF-8 text at line 2, byte 7 (0xff)"), std::string::npos)
      << Problem(s);
  s = env.Spec();
  s.set_recipe_yaml("method: quip\ncalibration: {num_sequences: 2000000000}\n");
  EXPECT_NE(Problem(s).find("key 'calibration.num_sequences' (line 2) must be in [1, 1048576], "
                            "got 2000000000"),
            std::string::npos)
      << Problem(s);

  s = env.Spec();
  s.set_model_dir(env.root + "/missing");
  EXPECT_EQ(Problem(s), "model_dir '" + env.root + "/missing' does not exist");

  s = env.Spec();
  s.set_model_dir("models/m");
  EXPECT_NE(Problem(s).find("model_dir 'models/m' is not an absolute path"), std::string::npos);

  s = env.Spec();
  s.set_model_dir(env.model_dir + "/config.json");
  EXPECT_EQ(Problem(s), "model_dir '" + env.model_dir + "/config.json' is not a directory");

  s = env.Spec();
  s.set_out_dir(env.model_dir + "/quantized");
  EXPECT_EQ(Problem(s), "out_dir '" + env.model_dir + "/quantized' is inside model_dir '" +
                            env.model_dir + "'; write the output outside the input");
  s = env.Spec();
  s.set_out_dir(env.model_dir);
  EXPECT_EQ(Problem(s), "out_dir '" + env.model_dir +
                            "' is the model directory; write the output outside the input");
  // Through a symlink into the model directory.
  ASSERT_EQ(::symlink(env.model_dir.c_str(), (env.root + "/link").c_str()), 0);
  s = env.Spec();
  s.set_out_dir(env.root + "/link/q");
  EXPECT_NE(Problem(s).find("is inside model_dir"), std::string::npos);
  s = env.Spec();
  s.set_job_dir(env.model_dir + "/job");
  EXPECT_NE(Problem(s).find("job_dir '" + env.model_dir + "/job' is inside model_dir"),
            std::string::npos);

  s = env.Spec();
  s.set_recipe_yaml("name: x\nmethod: quip\nbitz: 2\n");
  EXPECT_NE(Problem(s).find("jobs/quip-test.yaml"), std::string::npos) << Problem(s);
  EXPECT_NE(Problem(s).find("bitz"), std::string::npos) << Problem(s);

  s = env.Spec();
  s.set_data_root(env.root + "/nodata");
  EXPECT_EQ(Problem(s), "data_root '" + env.root + "/nodata' does not exist");
  s = env.Spec();
  ASSERT_EQ(::unlink((env.data_root + "/data/calib.txt").c_str()), 0);
  EXPECT_EQ(Problem(s), "calibration file (jobs/quip-test.yaml: 'data/calib.txt') '" +
                            env.data_root + "/data/calib.txt' does not exist");

  s = env.Spec();
  s.set_recipe_yaml("name: r\nmethod: rtn\nbits: 4\n");  // rtn: no calibration data needed
  EXPECT_EQ(Problem(s), "");

  ASSERT_TRUE(WriteFileAtomic(env.model_dir + "/config.json", "{\"hidden_size\": 1}").ok());
  s = env.Spec();
  s.set_recipe_yaml("name: r\nmethod: rtn\nbits: 4\n");
  EXPECT_NE(Problem(s).find(env.model_dir + "/config.json"), std::string::npos) << Problem(s);
  ASSERT_EQ(::unlink((env.model_dir + "/config.json").c_str()), 0);
  EXPECT_EQ(Problem(s), "model config '" + env.model_dir + "/config.json' does not exist");
}

TEST(ValidationTest, OutputMustBeCreatable) {
  TestEnv env = TestEnv::Make("valid");
  v1::JobSpec s = env.Spec();
  ASSERT_TRUE(WriteFileAtomic(env.root + "/afile", "x").ok());
  s.set_out_dir(env.root + "/afile");
  EXPECT_EQ(Problem(s), "out_dir '" + env.root + "/afile' exists and is not a directory");
  s.set_out_dir(env.root + "/afile/sub");
  EXPECT_EQ(Problem(s), "out_dir '" + env.root + "/afile/sub' cannot be created: '" + env.root +
                            "/afile' is not a directory");
}

}  // namespace
}  // namespace qcal::coordinator

namespace qcal::coordinator {
namespace {

using job::JobWorkspace;
using job::MakeDiskWorkspace;
using job::JobDirOf;

// Issue 18: one output directory, one job, across processes: a service job's workspace holds
// the output directory's lock from Open until the job ends (Close), so a `qcal quantize` on the
// same directory (the same OutputDirLock) is refused meanwhile, and the other way round.
TEST(WorkspaceTest, TheOutputDirectoryIsLockedForTheJobsLife) {
  const testing::TestEnv env = testing::TestEnv::Make("workspace-lock");
  v1::JobSpec spec = env.Spec();
  StatusOr<Recipe> recipe = ValidateJobSpec(&spec);
  ASSERT_TRUE(recipe.ok()) << recipe.status();

  ASSERT_TRUE(MakeDirs(env.out_dir).ok());
  {
    StatusOr<OutputDirLock> held = OutputDirLock::Acquire(env.out_dir);  // "qcal quantize"
    ASSERT_TRUE(held.ok()) << held.status();
    std::unique_ptr<JobWorkspace> ws = MakeDiskWorkspace();
    StatusOr<JobPlan> plan = ws->Open(*recipe, spec);
    ASSERT_FALSE(plan.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(plan.status())) << plan.status();
    EXPECT_NE(plan.status().message().find(env.out_dir + ": another qcal job"),
              std::string::npos)
        << plan.status();
  }
  std::unique_ptr<JobWorkspace> ws = MakeDiskWorkspace();
  StatusOr<JobPlan> plan = ws->Open(*recipe, spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->inputs.key.empty());
  EXPECT_FALSE(OutputDirLock::Acquire(env.out_dir).ok()) << "locked while the job runs";
  EXPECT_FALSE(JobDirLock::Acquire(JobDirOf(spec), "test").ok()) << "the job dir too";
  ws->Close();
  EXPECT_TRUE(OutputDirLock::Acquire(env.out_dir).ok()) << "released when the job ended";
  EXPECT_TRUE(JobDirLock::Acquire(JobDirOf(spec), "test").ok()) << "the job dir too";
}

// Issue 36: one driver per job directory, across processes: a `qcal quantize` holding the job
// directory (another output) makes the coordinator's job fail at planning, naming the holder,
// before it writes anything there.
TEST(WorkspaceTest, TheJobDirectoryHasOneDriver) {
  const testing::TestEnv env = testing::TestEnv::Make("workspace-jobdir");
  v1::JobSpec spec = env.Spec();
  StatusOr<Recipe> recipe = ValidateJobSpec(&spec);
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  StatusOr<JobDirLock> held =
      JobDirLock::Acquire(JobDirOf(spec), "qcal quantize --out " + env.root + "/other");
  ASSERT_TRUE(held.ok()) << held.status();
  std::unique_ptr<JobWorkspace> ws = MakeDiskWorkspace();
  StatusOr<JobPlan> plan = ws->Open(*recipe, spec);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(plan.status())) << plan.status();
  EXPECT_NE(plan.status().message().find(JobDirOf(spec) + ": the job directory is in use by "
                                         "qcal quantize --out " + env.root + "/other (pid "),
            std::string::npos)
      << plan.status();
  EXPECT_FALSE(std::filesystem::exists(JobDirOf(spec) + "/journal.jsonl"));
}

}  // namespace
}  // namespace qcal::coordinator
