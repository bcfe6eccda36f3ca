// LocalMpiLauncher with a stand-in for mpirun (a shell script that starts children the way
// mpirun starts ranks): exit status, log, and that Terminate / Kill leave no process behind.
#include "coordinator/launcher.h"

#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "tests/test_util.h"

namespace qcal::coordinator {
namespace {

// True while /proc/<pid> is a live (not zombie) process.
bool Alive(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && line.size() > close + 2 && line[close + 2] != 'Z';
}

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = qcal::testing::MakeTempDir("launcher");
    worker_ = dir_ + "/qcal-worker";
    WriteScript(worker_, "#!/bin/sh\nexit 0\n");
  }
  void WriteScript(const std::string& path, const std::string& text) {
    ASSERT_TRUE(WriteFileAtomic(path, text).ok());
    ASSERT_EQ(::chmod(path.c_str(), 0755), 0);
  }
  LaunchSpec Spec() {
    LaunchSpec s;
    s.job_id = "job-000001";
    s.workers = 2;
    s.coordinator_address = "127.0.0.1:5";
    s.auth_token_file = dir_ + "/token";
    s.log_path = dir_ + "/workers.log";
    return s;
  }
  // Polls until the group exits (or 10 s pass).
  std::optional<std::string> WaitExit(WorkerGroup& g) {
    for (int i = 0; i < 1000; ++i) {
      if (auto e = g.Poll()) return e;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::nullopt;
  }
  std::string dir_, worker_;
};

TEST_F(LauncherTest, CommandLine) {
  LocalMpiLauncherOptions o;
  o.mpirun = "mpirun";
  o.worker_binary = "/b/qcal-worker";
  LaunchSpec s = Spec();
  s.tls_ca_file = "/ca.pem";
  s.threads_per_worker = 4;
  std::vector<std::string> expected = {
      "mpirun", "--oversubscribe", "-np", "2", "/b/qcal-worker", "--coordinator", "127.0.0.1:5",
      "--job", "job-000001", "--auth-token-file", dir_ + "/token", "--tls-ca", "/ca.pem",
      "--threads", "4"};
  EXPECT_EQ(LocalMpiCommand(o, s), expected);
  // Mutual TLS: the workers present the client certificate they are given.
  s.tls_cert_file = "/worker.pem";
  s.tls_key_file = "/worker.key";
  expected.insert(expected.end() - 2, {"--tls-cert", "/worker.pem", "--tls-key", "/worker.key"});
  EXPECT_EQ(LocalMpiCommand(o, s), expected);
  // The job's device reaches every worker.
  s.device = "cuda";
  expected.insert(expected.end(), {"--device", "cuda"});
  EXPECT_EQ(LocalMpiCommand(o, s), expected);
}

TEST_F(LauncherTest, ReportsTheExitStatusAndKeepsTheLog) {
  const std::string mpirun = dir_ + "/fake-mpirun";
  WriteScript(mpirun, "#!/bin/sh\necho \"ranks: $3\"\necho 'rank 1: model.safetensors: no such file' >&2\nexit 3\n");
  auto launcher = MakeLocalMpiLauncher({mpirun, worker_, {}});
  auto group = launcher->Launch(Spec());
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(WaitExit(**group), "exit code 3");
  const std::string tail = (*group)->LogTail(2);
  EXPECT_EQ(tail, "ranks: 2\nrank 1: model.safetensors: no such file");
  // The log starts with the command line.
  EXPECT_NE((*group)->LogTail(10).find("==== job-000001: " + mpirun + " --oversubscribe -np 2"),
            std::string::npos);
}

TEST_F(LauncherTest, TerminateAndKillReachEveryDescendant) {
  // Like mpirun: children (one in its own session, out of the process group), one ignoring
  // SIGTERM; the script waits for them.
  const std::string mpirun = dir_ + "/fake-mpirun";
  WriteScript(mpirun,
              "#!/bin/sh\n"
              "setsid sleep 1000 &\n"
              "sleep 1000 &\n"
              "sh -c 'trap \"\" TERM; while true; do sleep 1; done' &\n"
              "wait\n");
  auto launcher = MakeLocalMpiLauncher({mpirun, worker_, {}});
  auto group = launcher->Launch(Spec());
  ASSERT_TRUE(group.ok()) << group.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE((*group)->Poll().has_value());
  // The script's pid is the group leader; its descendants are the "ranks".
  std::vector<int> before;
  for (int i = 0; i < 100 && before.size() < 3; ++i) {
    std::string desc = (*group)->Describe();  // "mpirun pid N (log ...)"
    const int pid = std::stoi(desc.substr(std::string("mpirun pid ").size()));
    before = DescendantPids(pid);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(before.size(), 3u);
  (*group)->Terminate();
  auto exit = WaitExit(**group);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(*exit, "killed by signal 15 (SIGTERM)");
  // Poll after exit SIGKILLs whatever outlived mpirun (the child that ignores SIGTERM).
  for (int i = 0; i < 200; ++i) {
    bool any = false;
    for (int pid : before) any |= Alive(pid);
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int pid : before) EXPECT_FALSE(Alive(pid)) << "pid " << pid << " survived";
}

TEST_F(LauncherTest, MissingProgramsAreNamed) {
  auto launcher = MakeLocalMpiLauncher({"mpirun", dir_ + "/no-worker", {}});
  auto group = launcher->Launch(Spec());
  EXPECT_EQ(group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(group.status().message().find("worker binary '" + dir_ + "/no-worker' is missing"),
            absl::string_view::npos)
      << group.status();
  launcher = MakeLocalMpiLauncher({dir_ + "/no-mpirun", worker_, {}});
  group = launcher->Launch(Spec());
  EXPECT_EQ(group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(group.status().message(),
            "cannot run '" + dir_ + "/no-mpirun': No such file or directory");
}


TEST_F(LauncherTest, SrunCommandLine) {
  LocalMpiLauncherOptions o;
  o.style = "srun";
  o.srun = "/usr/bin/srun";
  o.worker_binary = "/b/qcal-worker";
  const std::vector<std::string> expected = {
      "/usr/bin/srun", "--mpi=pmix", "--ntasks", "2", "--kill-on-bad-exit=1", "--job-name",
      "qcal-workers-job-000001", "/b/qcal-worker", "--coordinator", "127.0.0.1:5", "--job",
      "job-000001", "--auth-token-file", dir_ + "/token"};
  EXPECT_EQ(LocalMpiCommand(o, Spec()), expected);
}

// A coordinator that died leaves its group running; the next one stops it from the pid file
// before launching again, and never signals a process that merely reuses the pid.
TEST_F(LauncherTest, StopLeftoversStopsTheRecordedGroupOnly) {
  const std::string mpirun = dir_ + "/fake-mpirun";
  WriteScript(mpirun, "#!/bin/sh\nsleep 1000 &\nsleep 1000 &\nwait\n");
  LaunchSpec spec = Spec();
  spec.pid_file = dir_ + "/workers.pid";
  auto launcher = MakeLocalMpiLauncher({mpirun, worker_, {}});
  auto group = launcher->Launch(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  auto recorded = ReadFile(spec.pid_file);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  const int pid = std::stoi(*recorded);
  std::vector<int> ranks;
  for (int i = 0; i < 100 && ranks.size() < 2; ++i) {
    ranks = DescendantPids(pid);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(ranks.size(), 2u);
  // A record whose start time does not match (a recycled pid) is left alone.
  LaunchSpec other = spec;
  other.pid_file = dir_ + "/other.pid";
  ASSERT_TRUE(WriteFileAtomic(other.pid_file, std::to_string(pid) + " 1\n").ok());
  auto fresh = MakeLocalMpiLauncher({mpirun, worker_, {}});  // "the next coordinator"
  ASSERT_TRUE(fresh->StopLeftovers(other).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE((*group)->Poll().has_value());
  ASSERT_TRUE(fresh->StopLeftovers(spec).ok());
  auto exit = WaitExit(**group);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(*exit, "killed by signal 9 (SIGKILL)");
  for (int i = 0; i < 200; ++i) {
    bool any = false;
    for (int r : ranks) any |= Alive(r);
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int r : ranks) EXPECT_FALSE(Alive(r)) << "rank pid " << r << " survived";
  // Garbage in the pid file is named.
  ASSERT_TRUE(WriteFileAtomic(other.pid_file, "not a pid\n").ok());
  Status bad = fresh->StopLeftovers(other);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.message().find(other.pid_file), absl::string_view::npos) << bad;
}


// The Slurm launcher against stand-ins for sbatch, scontrol and scancel (shell scripts that log
// their arguments and answer from files the test writes).
TEST_F(LauncherTest, SlurmGroupsFollowTheJobAndAreCancelled) {
  const std::string calls = dir_ + "/calls.log";
  const std::string state = dir_ + "/state";
  WriteScript(dir_ + "/sbatch", "#!/bin/sh\necho \"sbatch $*\" >> " + calls + "\necho '4242;cluster'\n");
  WriteScript(dir_ + "/scontrol", "#!/bin/sh\necho \"scontrol $*\" >> " + calls + "\ncat " + state + "\n");
  WriteScript(dir_ + "/scancel", "#!/bin/sh\necho \"scancel $*\" >> " + calls + "\n");
  SlurmLauncherOptions o;
  o.worker_binary = worker_;
  o.sbatch = dir_ + "/sbatch";
  o.scontrol = dir_ + "/scontrol";
  o.scancel = dir_ + "/scancel";
  o.partition = "gpu";
  o.ranks_per_node = 8;
  o.gpus_per_rank = 1;
  o.poll_interval_s = 0.001;
  LaunchSpec spec = Spec();
  spec.pid_file = dir_ + "/workers.pid";
  auto launcher = MakeSlurmLauncher(o);
  ASSERT_TRUE(WriteFileAtomic(state, "JobId=4242 JobState=PENDING Reason=Resources NodeList=(null) ExitCode=0:0\n").ok());
  auto group = launcher->Launch(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ((*group)->Describe(), "Slurm job 4242 (log " + dir_ + "/workers.log)");
  EXPECT_EQ(*ReadFile(spec.pid_file), "slurm 4242\n");
  const std::string script = *ReadFile(dir_ + "/workers.sbatch");
  EXPECT_NE(script.find("exec srun --mpi=pmix --kill-on-bad-exit=1 '" + worker_ +
                        "' '--coordinator' '127.0.0.1:5' '--job' 'job-000001'"),
            std::string::npos) << script;
  EXPECT_FALSE((*group)->Poll().has_value());
  ASSERT_TRUE(WriteFileAtomic(state, "JobId=4242 JobState=RUNNING Reason=None NodeList=n[1-2] ExitCode=0:0\n").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_FALSE((*group)->Poll().has_value());
  auto notes = (*group)->TakeNotes();
  ASSERT_EQ(notes.size(), 3u);
  EXPECT_EQ(notes[0].message, "submitted the workers as Slurm job 4242");
  EXPECT_EQ(notes[1].message, "Slurm job 4242: PENDING (Resources)");
  EXPECT_EQ(notes[2].message, "Slurm job 4242: RUNNING on n[1-2]");
  EXPECT_FALSE(notes[2].warning);
  // Preempted (submitted --no-requeue: the coordinator replaces the group).
  ASSERT_TRUE(WriteFileAtomic(state, "JobId=4242 JobState=PREEMPTED Reason=None NodeList=n[1-2] ExitCode=0:15\n").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto exit = (*group)->Poll();
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(*exit, "Slurm job 4242 ended PREEMPTED (exit code 0:15)");
  notes = (*group)->TakeNotes();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_TRUE(notes[0].warning);
  const std::string log = *ReadFile(calls);
  EXPECT_NE(log.find("sbatch --parsable --no-requeue --job-name=qcal-workers-job-000001 "
                     "--ntasks=2 --output=" + dir_ + "/workers.log --open-mode=append "
                     "--ntasks-per-node=8 --gpus-per-task=1 --partition=gpu " + dir_ +
                     "/workers.sbatch"),
            std::string::npos) << log;
  EXPECT_NE(log.find("scontrol show job -o 4242"), std::string::npos);
  // A running group is cancelled; a later coordinator cancels what the pid file names.
  ASSERT_TRUE(WriteFileAtomic(state, "JobId=4243 JobState=RUNNING ExitCode=0:0\n").ok());
  auto second = launcher->Launch(spec);
  ASSERT_TRUE(second.ok());
  (*second)->Terminate();
  EXPECT_NE(ReadFile(calls)->find("scancel 4242"), std::string::npos);
  ASSERT_TRUE(MakeSlurmLauncher(o)->StopLeftovers(spec).ok());
  EXPECT_NE(ReadFile(calls)->find("scancel --signal=KILL --full 4242"), std::string::npos);
  // sbatch refusing the job is named.
  WriteScript(dir_ + "/sbatch", "#!/bin/sh\necho 'sbatch: error: Invalid partition name specified'\nexit 1\n");
  auto refused = launcher->Launch(spec);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("Invalid partition name specified"),
            absl::string_view::npos) << refused.status();
}

}  // namespace
}  // namespace qcal::coordinator
