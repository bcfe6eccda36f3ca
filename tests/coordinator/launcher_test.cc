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

}  // namespace
}  // namespace qcal::coordinator
