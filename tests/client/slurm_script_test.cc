// qcal slurm-script: the templates of slurm/ filled from options; bad options named; the result
// is valid bash with every field filled.
#include "client/slurm_command.h"

#include <cstdio>
#include <cstdlib>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "tests/test_util.h"

namespace qcal::client {
namespace {

SlurmScriptOptions Options() {
  SlurmScriptOptions o;
  o.recipe = "/jobs/quip-e8p-2bit.yaml";
  o.model_dir = "/models/llama-3.1-70b";
  o.out_dir = "/scratch/out/llama70b-quip2";
  o.nodes = 4;
  o.tasks_per_node = 8;
  o.cpus_per_task = 12;
  o.time = "1-00:00:00";
  o.partition = "gpu";
  o.account = "proj42";
  o.qcal_binary = "/opt/qcal/bin/qcal";
  return o;
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(SlurmScriptTest, TheGpuTemplateIsFilled) {
  auto script = MakeSlurmScript(Options());
  ASSERT_TRUE(script.ok()) << script.status();
  for (const char* line :
       {"#SBATCH --nodes=4\n", "#SBATCH --ntasks-per-node=8\n", "#SBATCH --gpus-per-task=1\n",
        "#SBATCH --cpus-per-task=12\n", "#SBATCH --time=1-00:00:00\n", "#SBATCH --requeue\n",
        "#SBATCH --open-mode=append\n", "#SBATCH --signal=B:USR1@600\n",
        "#SBATCH --partition=gpu\n", "#SBATCH --account=proj42\n",
        "#SBATCH --job-name=qcal-llama70b-quip2\n",
        "#SBATCH --output=/scratch/out/llama70b-quip2.slurm-%j.log\n",
        "QCAL=/opt/qcal/bin/qcal\n", "STATE=/scratch/out/llama70b-quip2.service\n",
        "run /jobs/quip-e8p-2bit.yaml --model /models/llama-3.1-70b --out "
        "/scratch/out/llama70b-quip2 --state \"$STATE\"",
        "--launcher srun", "--no-eval", "export NCCL_DEBUG", "scontrol requeue"}) {
    EXPECT_TRUE(Contains(*script, line)) << "missing: " << line << "\n" << *script;
  }
  EXPECT_FALSE(Contains(*script, "#SBATCH --qos")) << "an unset option leaves no line";
  // Every field was filled: no @NAME@ left (the literal '@' of USR1@600 is not a field).
  EXPECT_FALSE(Contains(*script, "@RUN_ARGS@"));
  EXPECT_FALSE(Contains(*script, "@QCAL@"));
}

TEST(SlurmScriptTest, TheCpuVariantHasNoGpusAndQuotesOddPaths) {
  SlurmScriptOptions o = Options();
  o.cpu = true;
  o.model_dir = "/models/it's here";
  o.eval = true;
  o.data_root = "/data";
  auto script = MakeSlurmScript(o);
  ASSERT_TRUE(script.ok()) << script.status();
  EXPECT_FALSE(Contains(*script, "--gpus-per-task"));
  EXPECT_FALSE(Contains(*script, "NCCL"));
  EXPECT_TRUE(Contains(*script, "--model '/models/it'\\''s here'")) << *script;
  EXPECT_FALSE(Contains(*script, "--no-eval"));
  EXPECT_TRUE(Contains(*script, "--data-root /data"));
  EXPECT_FALSE(Contains(*script, "--experts-per-task")) << "the default passes nothing";
}

// A MoE job's expert groups per task reach the batch script's `qcal run` (issue 53).
TEST(SlurmScriptTest, ExpertsPerTaskReachesTheRun) {
  SlurmScriptOptions o = Options();
  o.experts_per_task = 16;
  auto script = MakeSlurmScript(o);
  ASSERT_TRUE(script.ok()) << script.status();
  EXPECT_TRUE(Contains(*script, "--no-eval --experts-per-task 16")) << *script;
  o.experts_per_task = -1;
  script = MakeSlurmScript(o);
  ASSERT_TRUE(script.ok()) << script.status();
  EXPECT_TRUE(Contains(*script, "--experts-per-task -1")) << *script;
}

TEST(SlurmScriptTest, ScriptsAreValidBash) {
  const std::string dir = qcal::testing::MakeTempDir("slurm-script");
  for (bool cpu : {false, true}) {
    SlurmScriptOptions o = Options();
    o.cpu = cpu;
    auto script = MakeSlurmScript(o);
    ASSERT_TRUE(script.ok()) << script.status();
    const std::string path = dir + (cpu ? "/cpu.sbatch" : "/gpu.sbatch");
    ASSERT_TRUE(WriteFileAtomic(path, *script).ok());
    EXPECT_EQ(std::system(("bash -n " + path).c_str()), 0) << *script;
  }
}

TEST(SlurmScriptTest, BadOptionsAreNamed) {
  struct Case {
    void (*change)(SlurmScriptOptions*);
    const char* message;
  };
  const Case cases[] = {
      {[](SlurmScriptOptions* o) { o->nodes = 0; }, "--nodes must be at least 1, not 0"},
      {[](SlurmScriptOptions* o) { o->tasks_per_node = -1; }, "--ranks-per-node must be"},
      {[](SlurmScriptOptions* o) { o->cpus_per_task = 0; }, "--cpus-per-rank must be"},
      {[](SlurmScriptOptions* o) { o->time = "two hours"; },
       "--time 'two hours' is not a Slurm time"},
      {[](SlurmScriptOptions* o) { o->signal_lead_s = 5; }, "--signal-lead 5 s"},
      {[](SlurmScriptOptions* o) { o->partition = "gpu; rm -rf /"; }, "'gpu; rm -rf /': spaces"},
      {[](SlurmScriptOptions* o) { o->out_dir = "/scratch/my out"; }, "cannot hold whitespace"},
      {[](SlurmScriptOptions* o) { o->recipe.clear(); }, "--recipe, --model and --out"},
  };
  for (const Case& c : cases) {
    SlurmScriptOptions o = Options();
    c.change(&o);
    auto script = MakeSlurmScript(o);
    ASSERT_FALSE(script.ok()) << c.message;
    EXPECT_EQ(script.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(std::string(script.status().message()), c.message))
        << script.status() << " vs " << c.message;
  }
}

TEST(SlurmScriptTest, UnknownTemplateFieldsAreRefused) {
  auto filled = FillSlurmTemplate("a @KNOWN@ b @UNKNOWN@ c USR1@600", {{"KNOWN", "x"}});
  ASSERT_FALSE(filled.ok());
  EXPECT_TRUE(Contains(std::string(filled.status().message()), "@UNKNOWN@"));
  filled = FillSlurmTemplate("a @KNOWN@ b USR1@600 c@d", {{"KNOWN", "x"}});
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_EQ(*filled, "a x b USR1@600 c@d");
}

}  // namespace
}  // namespace qcal::client
