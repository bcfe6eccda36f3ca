// qcal-coordinator with real MPI workers (mpirun qcal-worker) on stories260K:
//  * 2 and 3 ranks write a checkpoint bit-identical to single-process `qcal quantize`;
//  * calls without the bearer token are refused;
//  * a job with a missing model path is refused with a clear message, a job that fails at run
//    time fails alone, and the coordinator keeps serving the others;
//  * cancelling a running job stops its worker processes;
//  * the CLI's service commands and `qcal run`.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "rpc/auth.h"
#include "proto/qcal.grpc.pb.h"
#include "tests/test_util.h"

extern char** environ;

namespace qcal::coordinator {
namespace {

using namespace qcal::rpc;  // NOLINT: the RPC helpers

using Clock = std::chrono::steady_clock;

struct Result {
  int exit_code;
  std::string out;  // stdout and stderr together
};

Result Shell(const std::string& cmd) {
  Result r{-1, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Qcal() { return qcal::testing::BuildDir() + "/client/qcal"; }
std::string WorkerBinary() { return qcal::testing::BuildDir() + "/worker/qcal-worker"; }

// Every regular file under `dir`, relative path -> contents.
void ReadTree(const std::string& dir, const std::string& rel,
              std::map<std::string, std::string>* out) {
  DIR* d = ::opendir((dir + "/" + rel).c_str());
  if (!d) return;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    const std::string r = rel.empty() ? name : rel + "/" + name;
    struct stat st;
    if (::stat((dir + "/" + r).c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      ReadTree(dir, r, out);
    } else {
      (*out)[r] = *ReadFile(dir + "/" + r);
    }
  }
  ::closedir(d);
}

void ExpectSameFiles(const std::string& expected_dir, const std::string& actual_dir) {
  std::map<std::string, std::string> expected, actual;
  ReadTree(expected_dir, "", &expected);
  ReadTree(actual_dir, "", &actual);
  ASSERT_FALSE(expected.empty()) << expected_dir;
  std::set<std::string> names;
  for (const auto& [n, c] : expected) names.insert(n);
  for (const auto& [n, c] : actual) names.insert(n);
  for (const std::string& n : names) {
    ASSERT_TRUE(expected.count(n)) << n << " only in " << actual_dir;
    ASSERT_TRUE(actual.count(n)) << n << " missing from " << actual_dir;
    EXPECT_TRUE(expected[n] == actual[n])
        << n << " differs (" << expected[n].size() << " vs " << actual[n].size() << " bytes)";
  }
  EXPECT_GE(names.size(), 8u);  // shards, index, config, tokenizer
}

// Live processes whose command line carries every one of `args` as an argument (the job id and
// the coordinator's address: mpirun and its ranks for this test's job, not another test's).
std::vector<int> ProcessesWithArgs(const std::vector<std::string>& args) {
  std::vector<int> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (struct dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/cmdline", std::ios::binary);
    std::string cmd((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::ifstream s(std::string("/proc/") + e->d_name + "/stat");
    std::string stat;
    std::getline(s, stat);
    const size_t close = stat.rfind(')');
    if (close != std::string::npos && stat.size() > close + 2 && stat[close + 2] == 'Z') continue;
    std::set<std::string> have;
    std::stringstream parts(cmd);
    std::string a;
    while (std::getline(parts, a, '\0')) have.insert(a);
    bool all = !args.empty();
    for (const std::string& want : args) all &= have.count(want) > 0;
    if (all) out.push_back(static_cast<int>(pid));
  }
  ::closedir(d);
  return out;
}

class CoordinatorIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(WorkerBinary().c_str(), X_OK) != 0) {
      GTEST_SKIP() << WorkerBinary() << " is not built";
    }
    if (Shell("mpirun --version").exit_code != 0) GTEST_SKIP() << "mpirun is not available";
    shared_ = qcal::testing::SharedDir();
    dir_ = std::filesystem::path(qcal::testing::MakeTempDir("coord-it")).lexically_normal().string();
    model_ = dir_ + "/stories260K";
    Result r = Shell(Qcal() + " import llama2c " + shared_ + "/models/stories260K/stories260K.bin " +
                   shared_ + "/models/stories260K/tok512.bin --out " + model_);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    recipe_ = WriteRecipe("quip-small.yaml", 16);
    ASSERT_FALSE(recipe_.empty());
    token_file_ = dir_ + "/token";
    ASSERT_TRUE(WriteFileAtomic(token_file_, std::string(kToken) + "\n").ok());
    ASSERT_EQ(::chmod(token_file_.c_str(), 0600), 0);
    StartCoordinator();
  }

  void TearDown() override {
    if (coordinator_pid_ > 0) {
      ::kill(coordinator_pid_, SIGTERM);
      int status = 0;
      for (int i = 0; i < 300; ++i) {
        if (::waitpid(coordinator_pid_, &status, WNOHANG) == coordinator_pid_) {
          coordinator_pid_ = 0;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (coordinator_pid_ > 0) {
        ADD_FAILURE() << "qcal-coordinator did not exit within 15 s of SIGTERM";
        ::kill(coordinator_pid_, SIGKILL);
        ::waitpid(coordinator_pid_, &status, 0);
      } else {
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
            << "qcal-coordinator exit status " << status;
      }
    }
  }

  // A copy of jobs/<source>.yaml with `sequences` calibration sequences.
  std::string WriteRecipe(const std::string& name, int sequences,
                          const std::string& source = "quip-e8p-2bit") {
    auto text = ReadFile(qcal::testing::SourceDir() + "/jobs/" + source + ".yaml");
    EXPECT_TRUE(text.ok()) << text.status();
    if (!text.ok()) return "";
    std::string yaml = *text;
    const std::string key = "num_sequences: 128";
    const size_t pos = yaml.find(key);
    EXPECT_NE(pos, std::string::npos);
    yaml.replace(pos, key.size(), "num_sequences: " + std::to_string(sequences));
    const std::string path = dir_ + "/" + name;
    EXPECT_TRUE(WriteFileAtomic(path, yaml).ok());
    return path;
  }

  void StartCoordinator() {
    const std::string state = dir_ + "/state";
    const std::string address_file = dir_ + "/address";
    std::vector<std::string> args = {
        qcal::testing::BuildDir() + "/coordinator/qcal-coordinator",
        "--listen", "127.0.0.1:0", "--state", state, "--auth-token-file", token_file_,
        "--address-file", address_file, "--kill-grace", kill_grace_, "--heartbeat-timeout",
        heartbeat_timeout_, "--log-file", dir_ + "/coordinator.log"};
    std::remove(address_file.c_str());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string out = dir_ + "/coordinator.out";
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    ASSERT_EQ(::posix_spawn(&coordinator_pid_, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    for (int i = 0; i < 400; ++i) {
      auto text = ReadFile(address_file);
      if (text.ok() && !text->empty()) {
        address_ = text->substr(0, text->find('\n'));
        break;
      }
      int status;
      ASSERT_NE(::waitpid(coordinator_pid_, &status, WNOHANG), coordinator_pid_)
          << "qcal-coordinator exited: " << ReadFile(out).value_or("");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_FALSE(address_.empty()) << "no address file; " << ReadFile(out).value_or("");
    channel_ = *MakeChannel(address_);
    ASSERT_TRUE(WaitForHealthy(channel_, std::chrono::seconds(20)).ok());
    jobs_ = v1::JobService::NewStub(channel_);
  }

  v1::JobSpec Spec(const std::string& out, int workers, const std::string& model = "") {
    v1::JobSpec s;
    s.set_recipe_path(recipe_);
    s.set_recipe_yaml(*ReadFile(recipe_));
    s.set_model_dir(model.empty() ? model_ : model);
    s.set_out_dir(out);
    s.set_data_root(shared_);
    s.set_workers(workers);
    s.set_threads_per_worker(1);
    return s;
  }

  grpc::Status Submit(const v1::JobSpec& spec, std::string* id) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, kToken);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, req, &resp);
    *id = resp.job_id();
    return s;
  }

  v1::Job Get(const std::string& id) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, kToken);
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::Status s = jobs_->GetJob(&ctx, req, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  // Follows the job's event stream to its end (at most `timeout`) and returns the job.
  v1::Job WatchToEnd(const std::string& id, std::chrono::seconds timeout = std::chrono::seconds(900)) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent e;
    int blocks = 0;
    while (reader->Read(&e)) blocks += e.kind() == v1::JOB_EVENT_KIND_BLOCK_DONE;
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    v1::Job job = Get(id);
    if (job.state() == v1::JOB_STATE_SUCCEEDED) {
      EXPECT_EQ(blocks, job.blocks_total()) << "one BLOCK_DONE event per block";
    }
    return job;
  }

  // `qcal quantize` in one process with the same recipe: the reference checkpoint.
  std::string Reference() {
    const std::string ref = dir_ + "/reference";
    Result r = Shell(Qcal() + " quantize --recipe " + recipe_ + " --model " + model_ + " --out " +
                   ref + " --data-root " + shared_ + " --threads 1");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return ref;
  }

  void ExpectBitIdenticalWithRanks(int ranks) {
    const std::string ref = Reference();
    const std::string out = dir_ + "/out" + std::to_string(ranks);
    std::string id;
    grpc::Status s = Submit(Spec(out, ranks), &id);
    ASSERT_TRUE(s.ok()) << s.error_message();
    v1::Job job = WatchToEnd(id);
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED)
        << job.error() << "\nworkers.log:\n" << ReadFile(out + ".job/workers.log").value_or("");
    EXPECT_EQ(job.blocks_done(), 5);
    EXPECT_EQ(job.phase(), "done");
    EXPECT_FALSE(job.result_json().empty());
    std::set<int> ranks_seen;
    for (const auto& b : job.blocks()) ranks_seen.insert(b.rank());
    for (int r : ranks_seen) EXPECT_TRUE(r >= 0 && r < ranks) << r;
    std::printf("[ info     ] %d ranks: blocks by rank", ranks);
    for (const auto& b : job.blocks()) std::printf(" %lld:%d", (long long)b.block(), b.rank());
    std::printf("\n");
    ExpectSameFiles(ref, out);
    // The coordinator journaled every block (single writer).
    auto journal = ReadFile(out + ".job/journal.jsonl");
    ASSERT_TRUE(journal.ok());
    std::stringstream lines(*journal);
    std::string line;
    std::map<std::string, int> events;
    while (std::getline(lines, line)) events[nlohmann::json::parse(line)["event"]]++;
    EXPECT_EQ(events["job_start"], 1);
    EXPECT_EQ(events["block_done"], 5);
    EXPECT_EQ(events["job_done"], 1);
    // The workers exited after SHUTDOWN.
    for (int i = 0; i < 100 && !JobProcesses(id).empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(JobProcesses(id).empty());
  }

  // mpirun and the ranks of job `id` of this test's coordinator.
  std::vector<int> JobProcesses(const std::string& id) {
    return ProcessesWithArgs({id, address_});
  }

  // Stops the coordinator (SIGTERM, as TearDown) and starts one with these settings.
  void RestartCoordinator(const std::string& heartbeat_timeout, const std::string& kill_grace) {
    ::kill(coordinator_pid_, SIGTERM);
    int status = 0;
    ::waitpid(coordinator_pid_, &status, 0);
    coordinator_pid_ = 0;
    heartbeat_timeout_ = heartbeat_timeout;
    kill_grace_ = kill_grace;
    StartCoordinator();
  }

  // The pid of rank `rank` of job `id` (from OMPI_COMM_WORLD_RANK in its environment), or -1.
  pid_t RankPid(const std::string& id, int rank) {
    for (int pid : JobProcesses(id)) {
      auto env = ReadFile("/proc/" + std::to_string(pid) + "/environ");
      if (!env.ok()) continue;
      std::stringstream vars(*env);
      std::string v;
      bool worker = false, match = false;
      while (std::getline(vars, v, '\0')) {
        if (v == "OMPI_COMM_WORLD_RANK=" + std::to_string(rank)) match = true;
      }
      auto cmd = ReadFile("/proc/" + std::to_string(pid) + "/cmdline");
      worker = cmd.ok() && cmd->find("qcal-worker") != std::string::npos &&
               cmd->find("mpirun") == std::string::npos;
      if (worker && match) return pid;
    }
    return -1;
  }

  // Every event of job `id` so far (GetJob does not carry them: one WatchJob replay, cut off
  // after `wait`).
  std::vector<v1::JobEvent> EventsSoFar(const std::string& id,
                                        std::chrono::milliseconds wait = std::chrono::milliseconds(300)) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + wait);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(&ctx, req);
    std::vector<v1::JobEvent> out;
    v1::JobEvent e;
    while (reader->Read(&e)) out.push_back(e);
    reader->Finish();
    return out;
  }

  // The stale-attempt race (issue 18): rank 1 is paused (SIGSTOP) in the middle of a block;
  // after the heartbeat timeout the block is requeued and rank 0 redoes it. Rank 1 is resumed
  // (SIGCONT) either as soon as the redo is done (the job still running) or after the job
  // succeeded; it then finishes its stale attempt. The output must be byte-identical to an
  // uninterrupted run (`qcal quantize`), and loadable (its index's checksums verified).
  void StaleAttemptLeavesOutputIntact(bool resume_after_success) {
    RestartCoordinator("3", "60");
    recipe_ = WriteRecipe("ft-small.yaml", 32, "quip-e8p-2bit-ft");
    ASSERT_FALSE(recipe_.empty());
    const std::string ref = Reference();
    const std::string out = dir_ + (resume_after_success ? "/stale-after-success" : "/stale-redo");
    std::string id;
    ASSERT_TRUE(Submit(Spec(out, 2), &id).ok());
    // Rank 1 is paused while it holds a block; if it happened to be between tasks (no requeue
    // follows), it is resumed and paused again a little later.
    int64_t stolen_block = -1;
    pid_t rank1 = -1;
    const auto deadline = Clock::now() + std::chrono::seconds(300);
    while (stolen_block < 0 && Clock::now() < deadline) {
      const v1::Job job = Get(id);
      ASSERT_FALSE(job.state() == v1::JOB_STATE_FAILED || job.state() == v1::JOB_STATE_CANCELLED)
          << job.error();
      ASSERT_NE(job.state(), v1::JOB_STATE_SUCCEEDED) << "the job ended before rank 1 was paused";
      if (job.phase() != "quantize") {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      rank1 = RankPid(id, 1);
      ASSERT_GT(rank1, 0) << "no rank 1 process";
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ASSERT_EQ(::kill(rank1, SIGSTOP), 0);
      // Heartbeat timeout 3 s: a held block returns to the queue within about 4 s.
      const auto wait_until = Clock::now() + std::chrono::seconds(8);
      while (stolen_block < 0 && Clock::now() < wait_until) {
        for (const v1::JobEvent& e : EventsSoFar(id)) {
          if (e.kind() == v1::JOB_EVENT_KIND_WARNING &&
              e.message().find("returns to the queue") != std::string::npos) {
            const size_t at = e.message().rfind("block ", e.message().find(" returns to"));
            if (at != std::string::npos) stolen_block = std::atoll(e.message().c_str() + at + 6);
          }
        }
      }
      if (stolen_block < 0) {
        ::kill(rank1, SIGCONT);  // it held no block: try again
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    }
    ASSERT_GE(stolen_block, 0) << "rank 1 never held a block when paused";
    std::printf("[ info     ] rank 1 (pid %d) paused in block %lld, which was requeued\n", rank1,
                static_cast<long long>(stolen_block));
    if (resume_after_success) {
      const v1::Job job = WatchToEnd(id);
      ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
      ASSERT_EQ(::kill(rank1, SIGCONT), 0);
    } else {
      // Resumed as soon as another rank has redone the block.
      bool redone = false;
      while (!redone && Clock::now() < deadline) {
        const v1::Job job = Get(id);
        for (const auto& b : job.blocks()) redone |= b.block() == stolen_block;
        if (!redone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      ASSERT_TRUE(redone);
      ASSERT_EQ(::kill(rank1, SIGCONT), 0);
      const v1::Job job = WatchToEnd(id);
      ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
    }
    // The resumed rank finishes its stale attempt (and exits): wait for every process of the job.
    for (int i = 0; i < 900 && !JobProcesses(id).empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(JobProcesses(id).empty()) << "job processes still running 90 s after the end";
    ExpectSameFiles(ref, out);
    EXPECT_NE(::access((out + "/.staging").c_str(), F_OK), 0) << "staging left behind";
    Result eval = Shell(Qcal() + " eval --model " + out + " --data " + shared_ +
                        "/data/tinystories/TinyStories-valid.sample30k.txt --ctx 256 --max-tokens 2048");
    EXPECT_EQ(eval.exit_code, 0) << eval.out;
  }

  static constexpr char kToken[] = "integration-test-token-0123456789";
  std::string heartbeat_timeout_ = "30", kill_grace_ = "2";
  std::string shared_, dir_, model_, recipe_, token_file_, address_;
  pid_t coordinator_pid_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

TEST_F(CoordinatorIntegrationTest, StaleAttemptResumedAfterItsBlockWasRedone) {
  StaleAttemptLeavesOutputIntact(/*resume_after_success=*/false);
}

TEST_F(CoordinatorIntegrationTest, StaleAttemptResumedAfterTheJobSucceeded) {
  StaleAttemptLeavesOutputIntact(/*resume_after_success=*/true);
}

TEST_F(CoordinatorIntegrationTest, TwoRanksMatchSingleProcessBitForBit) {
  ExpectBitIdenticalWithRanks(2);
}

TEST_F(CoordinatorIntegrationTest, ThreeRanksMatchSingleProcessBitForBit) {
  ExpectBitIdenticalWithRanks(3);
}

// The scalar-grid methods (rtn: no calibration at all; gptq: the float model's Hessians) through
// the service: the checkpoint is the single process's, byte for byte. With the quip, quarot,
// prefixquant and spinquant cases here and in the tests above, every method family's
// `qcal run` output equals its `qcal quantize` output: both execute the same task plan
// (runner/task_plan.h) through the same steps.
TEST_F(CoordinatorIntegrationTest, RtnOnTwoRanksMatchesSingleProcess) {
  recipe_ = WriteRecipe("rtn-small.yaml", 16, "rtn-4bit");
  ASSERT_FALSE(recipe_.empty());
  ExpectBitIdenticalWithRanks(2);
}

TEST_F(CoordinatorIntegrationTest, GptqOnTwoRanksMatchesSingleProcess) {
  recipe_ = WriteRecipe("gptq-small.yaml", 16, "gptq-4bit");
  ASSERT_FALSE(recipe_.empty());
  ExpectBitIdenticalWithRanks(2);
}

// QuaRot with GPTQ weights calibrates block by block on the quantized blocks' outputs: the
// scheduler hands the blocks out in order and each rank reads its block's inputs from the job
// directory; the checkpoint is the single process's, byte for byte.
TEST_F(CoordinatorIntegrationTest, QuarotSequentialBlocksOnTwoRanksMatchSingleProcess) {
  recipe_ = WriteRecipe("quarot-small.yaml", 16, "quarot-w4a4kv4");
  ASSERT_FALSE(recipe_.empty());
  ExpectBitIdenticalWithRanks(2);
}

// PrefixQuant's prefix search is a global phase of the calibration task (every rank measures its
// chunks; the integer counts are summed) and its blocks run in order behind the prefix: the
// checkpoint is the single process's, byte for byte.
TEST_F(CoordinatorIntegrationTest, PrefixquantPrefixPhaseOnTwoRanksMatchesSingleProcess) {
  recipe_ = WriteRecipe("prefixquant-small.yaml", 16, "prefixquant-w4a4kv4");
  ASSERT_FALSE(recipe_.empty());
  ExpectBitIdenticalWithRanks(2);
}

// SpinQuant trains its rotations in a global phase on every rank (each a slice of every step's
// batch, the gradients summed exactly), then its blocks run as QuaRot's: the checkpoint is the
// single process's, byte for byte.
TEST_F(CoordinatorIntegrationTest, SpinquantRotationsPhaseOnTwoRanksMatchesSingleProcess) {
  recipe_ = WriteRecipe("spinquant-small.yaml", 16, "spinquant-w4a4kv4");
  ASSERT_FALSE(recipe_.empty());
  auto text = ReadFile(recipe_);
  ASSERT_TRUE(text.ok());
  std::string yaml = *text;
  const std::string key = "steps: 100";
  const size_t pos = yaml.find(key);
  ASSERT_NE(pos, std::string::npos);
  yaml.replace(pos, key.size(), "steps: 12");  // 12 steps of 8 sequences, 4 on each rank
  ASSERT_TRUE(WriteFileAtomic(recipe_, yaml).ok());
  ExpectBitIdenticalWithRanks(2);
}

TEST_F(CoordinatorIntegrationTest, UnauthenticatedRequestsAreRefused) {
  for (const std::string& token : {std::string(), std::string("wrong-token-wrong-token")}) {
    grpc::ClientContext ctx;
    if (!token.empty()) AddBearerToken(&ctx, token);
    v1::ListJobsRequest req;
    v1::ListJobsResponse resp;
    grpc::Status s = jobs_->ListJobs(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();

    grpc::ClientContext ctx2;
    if (!token.empty()) AddBearerToken(&ctx2, token);
    v1::SubmitJobRequest sub;
    *sub.mutable_spec() = Spec(dir_ + "/never", 2);
    v1::SubmitJobResponse sub_resp;
    s = jobs_->SubmitJob(&ctx2, sub, &sub_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();

    auto workers = v1::WorkerService::NewStub(channel_);
    grpc::ClientContext ctx3;
    if (!token.empty()) AddBearerToken(&ctx3, token);
    v1::RegisterWorkerRequest reg;
    v1::RegisterWorkerResponse reg_resp;
    s = workers->RegisterWorker(&ctx3, reg, &reg_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  // The qcal CLI says so too.
  const std::string bad_token = dir_ + "/bad-token";
  ASSERT_TRUE(WriteFileAtomic(bad_token, "not-the-right-token-at-all\n").ok());
  Result r = Shell(Qcal() + " list --coordinator " + address_ + " --auth-token-file " + bad_token);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("UNAUTHENTICATED"), std::string::npos) << r.out;
  EXPECT_FALSE(::access((dir_ + "/never").c_str(), F_OK) == 0);
  // With the token, nothing was submitted.
  grpc::ClientContext ok;
  AddBearerToken(&ok, kToken);
  v1::ListJobsResponse resp;
  ASSERT_TRUE(jobs_->ListJobs(&ok, v1::ListJobsRequest(), &resp).ok());
  EXPECT_EQ(resp.jobs_size(), 0);
}

TEST_F(CoordinatorIntegrationTest, MissingModelFailsClearlyWhileOtherJobsGoOn) {
  const std::string ref = Reference();
  // A good job runs while the bad ones come and go.
  std::string good;
  ASSERT_TRUE(Submit(Spec(dir_ + "/good", 2), &good).ok());

  std::string id;
  grpc::Status s = Submit(Spec(dir_ + "/bad", 2, dir_ + "/no-such-model"), &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "model_dir '" + dir_ + "/no-such-model' does not exist");

  // A model directory whose weights are missing passes the submit checks (config.json is
  // fine) and fails at run time, alone, with the file named.
  const std::string hollow = dir_ + "/hollow-model";
  ASSERT_TRUE(MakeDirs(hollow).ok());
  for (const char* f : {"config.json", "tokenizer.model", "tokenizer_config.json"}) {
    ASSERT_TRUE(WriteFileAtomic(hollow + "/" + f, *ReadFile(model_ + "/" + f)).ok());
  }
  std::string hollow_id;
  s = Submit(Spec(dir_ + "/hollow-out", 2, hollow), &hollow_id);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::Job failed = WatchToEnd(hollow_id);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  std::printf("[ info     ] run-time failure: %s\n", failed.error().c_str());
  EXPECT_NE(failed.error().find(hollow), std::string::npos) << failed.error();

  v1::Job ok = WatchToEnd(good);
  ASSERT_EQ(ok.state(), v1::JOB_STATE_SUCCEEDED) << ok.error();
  ExpectSameFiles(ref, dir_ + "/good");
  // And the coordinator still takes new work.
  std::string after;
  ASSERT_TRUE(Submit(Spec(dir_ + "/after", 1), &after).ok());
  EXPECT_EQ(WatchToEnd(after).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorIntegrationTest, CancellingARunningJobStopsItsWorkers) {
  // A long calibration, so the job is still running when it is cancelled.
  recipe_ = WriteRecipe("quip-long.yaml", 4096);
  std::string id;
  ASSERT_TRUE(Submit(Spec(dir_ + "/cancelled", 2), &id).ok());
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  v1::Job job;
  while (Clock::now() < deadline) {
    job = Get(id);
    if (job.state() == v1::JOB_STATE_RUNNING && job.workers_alive() == 2) break;
    ASSERT_FALSE(job.state() == v1::JOB_STATE_FAILED) << job.error();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(job.workers_alive(), 2) << job.DebugString();
  const std::vector<int> before = JobProcesses(id);
  EXPECT_GE(before.size(), 3u) << "mpirun and two ranks";

  grpc::ClientContext ctx;
  AddBearerToken(&ctx, kToken);
  v1::CancelJobRequest req;
  req.set_job_id(id);
  v1::CancelJobResponse resp;
  ASSERT_TRUE(jobs_->CancelJob(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.job().state(), v1::JOB_STATE_CANCELLED) << resp.job().error();

  // Kill grace 2 s: SIGTERM at 2 s, SIGKILL at 4 s. Allow 20 s in all.
  const auto t0 = Clock::now();
  std::vector<int> left = JobProcesses(id);
  while (!left.empty() && Clock::now() - t0 < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = JobProcesses(id);
  }
  EXPECT_TRUE(left.empty()) << left.size() << " worker processes survived the cancel";
  std::printf("[ info     ] workers gone %.1f s after the cancel\n",
              std::chrono::duration<double>(Clock::now() - t0).count());
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_CANCELLED);
  for (int i = 0; i < 50 && Get(id).workers_alive() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Get(id).workers_alive(), 0);
}

TEST_F(CoordinatorIntegrationTest, CliServiceCommands) {
  const std::string common = " --coordinator " + address_ + " --auth-token-file " + token_file_;
  Result r = Shell(Qcal() + " submit " + recipe_ + " --model " + model_ + " --out " + dir_ +
                 "/cli-out --data-root " + shared_ + " --workers 2 --name cli-test --json" +
                 common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto submitted = nlohmann::json::parse(r.out.substr(r.out.rfind('{')), nullptr, false);
  ASSERT_FALSE(submitted.is_discarded()) << r.out;
  const std::string id = submitted.value("job_id", "");
  ASSERT_FALSE(id.empty()) << r.out;

  r = Shell(Qcal() + " watch " + id + common);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("SUCCEEDED"), std::string::npos) << r.out;

  r = Shell(Qcal() + " status " + id + " --json" + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto status = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(status.is_discarded()) << r.out;
  EXPECT_EQ(status["state"], "SUCCEEDED");
  EXPECT_EQ(status["blocks_done"], 5);
  EXPECT_EQ(status["blocks"].size(), 5u);
  EXPECT_TRUE(status["blocks"][0]["metrics"].is_object()) << r.out;

  r = Shell(Qcal() + " status " + id + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* word : {"SUCCEEDED", "cli-test", "bits per weight"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word << " in " << r.out;
  }
  r = Shell(Qcal() + " list" + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(id), std::string::npos) << r.out;
  r = Shell(Qcal() + " list --json" + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto list = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(list.is_array()) << r.out;
  EXPECT_EQ(list.size(), 1u);
  r = Shell(Qcal() + " cancel " + id + common);  // an ended job stays as it is
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(id + " SUCCEEDED"), std::string::npos) << r.out;

  // Resubmitting the same job resumes it: every block is finished, so no worker is started
  // and the job goes straight to finalize.
  r = Shell(Qcal() + " submit " + recipe_ + " --model " + model_ + " --out " + dir_ +
            "/cli-out --data-root " + shared_ + " --workers 2 --watch" + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("resuming: 5 of 5 blocks were finished by an earlier run"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("started 2 worker rank(s)"), std::string::npos) << r.out;
  r = Shell(Qcal() + " status job-000002 --json" + common);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto resumed = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(resumed.is_discarded()) << r.out;
  EXPECT_EQ(resumed["state"], "SUCCEEDED");
  ASSERT_EQ(resumed["blocks"].size(), 5u);
  for (const auto& b : resumed["blocks"]) EXPECT_TRUE(b["resumed"].get<bool>()) << b.dump();

  r = Shell(Qcal() + " status job-424242" + common);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("unknown job 'job-424242'"), std::string::npos) << r.out;
  r = Shell(Qcal() + " submit " + recipe_ + " --model " + dir_ + "/nothing --out " + dir_ +
          "/x --data-root " + shared_ + common);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("model_dir '" + dir_ + "/nothing' does not exist"), std::string::npos)
      << r.out;
}

TEST_F(CoordinatorIntegrationTest, QcalRunStartsItsOwnCoordinatorAndWorkers) {
  const std::string out = dir_ + "/run-out";
  Result r = Shell(Qcal() + " run " + recipe_ + " --model " + model_ + " --out " + out +
                 " --workers 2 --data-root " + shared_ + " --eval-max-tokens 3000");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* word : {"SUCCEEDED", "perplexity", "float", "quantized", "wikitext2",
                           "tinystories"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word << " in:\n" << r.out;
  }
  ExpectSameFiles(Reference(), out);
  // The job's report has the workers' perplexities (written again after the evaluation phase),
  // not "Not measured".
  auto report = ReadFile(out + ".job/report.html");
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->find("Not measured"), std::string::npos);
  EXPECT_NE(report->find("wikitext2"), std::string::npos);
  EXPECT_NE(report->find("tinystories"), std::string::npos);
  // A failing job makes `qcal run` fail with the job's message.
  r = Shell(Qcal() + " run " + recipe_ + " --model " + out + " --out " + out + "/inside --workers 1 " +
          "--data-root " + shared_ + " --no-eval");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("is inside model_dir"), std::string::npos) << r.out;
}

// Whether `pid` runs (an exited process waiting to be reaped by init does not).
bool Running(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  auto stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  if (!stat.ok()) return false;
  const size_t paren = stat->rfind(')');
  return paren == std::string::npos || paren + 2 >= stat->size() || (*stat)[paren + 2] != 'Z';
}

// Mutual TLS end to end: a coordinator that requires client certificates hands its workers one
// (--worker-tls-cert/--worker-tls-key), so they can register and the job succeeds; without it the
// coordinator refuses to start instead of failing every job.
TEST_F(CoordinatorIntegrationTest, MutualTlsWorkersPresentTheirCertificate) {
  if (!qcal::testing::HaveOpenssl()) GTEST_SKIP() << "no openssl CLI";
  const std::string tls = dir_ + "/mtls";
  ASSERT_TRUE(MakeDirs(tls).ok());
  for (const char* who : {"server", "client"}) {
    ASSERT_TRUE(qcal::testing::MakeSelfSignedCert(tls, who)) << who;
  }
  const std::string coordinator = qcal::testing::BuildDir() + "/coordinator/qcal-coordinator";
  const std::string server_tls = " --tls-cert " + tls + "/server.pem --tls-key " + tls +
                                 "/server.key --tls-client-ca " + tls + "/client.pem";
  Result refused = Shell(coordinator + " --listen 127.0.0.1:0 --state " + tls + "/state0" +
                         " --auth-token-file " + token_file_ + server_tls);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("--tls-client-ca requires --worker-tls-cert"), std::string::npos)
      << refused.out;

  const std::string address_file = tls + "/address";
  Result started = Shell(coordinator + " --listen 127.0.0.1:0 --state " + tls + "/state" +
                         " --auth-token-file " + token_file_ + server_tls +
                         " --worker-tls-cert " + tls + "/client.pem --worker-tls-key " + tls +
                         "/client.key --address-file " + address_file + " > " + tls +
                         "/coordinator.out 2>&1 & echo $!");
  ASSERT_EQ(started.exit_code, 0) << started.out;
  const pid_t pid = std::stoi(started.out);
  std::string address;
  for (int i = 0; i < 400 && address.empty(); ++i) {
    auto text = ReadFile(address_file);
    if (text.ok() && !text->empty()) address = text->substr(0, text->find('\n'));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(address.empty()) << ReadFile(tls + "/coordinator.out").value_or("");
  const std::string client_tls = " --tls-ca " + tls + "/server.pem --tls-cert " + tls +
                                 "/client.pem --tls-key " + tls + "/client.key";
  Result r = Shell(Qcal() + " submit " + recipe_ + " --model " + model_ + " --out " + dir_ +
                   "/mtls-out --data-root " + shared_ + " --workers 1 --watch --coordinator " +
                   address + " --auth-token-file " + token_file_ + client_tls);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("SUCCEEDED"), std::string::npos) << r.out;
  // A client without a certificate is turned away.
  Result plain = Shell(Qcal() + " list --coordinator " + address + " --auth-token-file " +
                       token_file_ + " --tls-ca " + tls + "/server.pem");
  EXPECT_NE(plain.exit_code, 0) << plain.out;
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 100 && Running(pid); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(Running(pid));
}

// SIGTERM to `qcal run --state` (from `timeout`, a batch system's requeue or time limit) stops the
// private coordinator, which stops the workers instead of leaving them running, and leaves the
// job resumable.
TEST_F(CoordinatorIntegrationTest, QcalRunStopsItsWorkersOnSigterm) {
  // Calibration takes about a minute, so orphaned workers would outlive the 15 s allowed below.
  recipe_ = WriteRecipe("quip-longer.yaml", 16384);
  const std::string state = dir_ + "/sigterm-state";
  // mpirun and the ranks: they hold the job's own worker credential (STATE/credentials/).
  const std::vector<std::string> worker_args = {"--job",
                                                state + "/credentials/job-000001.token"};
  const std::string log = dir_ + "/sigterm-run.log";
  Result r = Shell(Qcal() + " run " + recipe_ + " --model " + model_ + " --out " + dir_ +
                   "/sigterm-out --workers 2 --data-root " + shared_ + " --no-eval --state " +
                   state + " > " + log + " 2>&1 & echo $!");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const pid_t run_pid = std::stoi(r.out);
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  std::vector<int> workers;
  while (Clock::now() < deadline) {  // mpirun and both ranks are up
    workers = ProcessesWithArgs(worker_args);
    if (workers.size() >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(workers.size(), 3u) << *ReadFile(log);
  ASSERT_EQ(::kill(run_pid, SIGTERM), 0);

  const auto t0 = Clock::now();
  while (Clock::now() - t0 < std::chrono::seconds(15) &&
         (Running(run_pid) || !ProcessesWithArgs(worker_args).empty())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(Running(run_pid)) << "qcal run is still running 15 s after SIGTERM";
  EXPECT_TRUE(ProcessesWithArgs(worker_args).empty())
      << "worker processes survived qcal run's SIGTERM";
  std::printf("[ info     ] qcal run and its workers gone %.1f s after SIGTERM\n",
              std::chrono::duration<double>(Clock::now() - t0).count());
  auto text = ReadFile(log);
  ASSERT_TRUE(text.ok());
  // With --state, SIGTERM (a batch system's requeue or preemption) leaves the job resumable
  // rather than cancelling it (issue 14): qcal run on the same state continues it.
  EXPECT_NE(text->find("SIGTERM: stopping the coordinator; job-000001 resumes when qcal run is "
                       "started again with --state"),
            std::string::npos)
      << *text;
  EXPECT_EQ(text->find("CANCELLED"), std::string::npos) << *text;
  auto record = ReadFile(state + "/jobs/job-000001.json");
  ASSERT_TRUE(record.ok());
  EXPECT_NE(record->find("JOB_STATE_RUNNING"), std::string::npos) << *record;
}

// Issue 18: after `kill -9` of `qcal run`, its private coordinator (started with
// --exit-with-parent) goes too, and stops the workers, instead of lingering for minutes.
TEST_F(CoordinatorIntegrationTest, QcalRunKilledTakesItsCoordinatorAndWorkersAlong) {
  recipe_ = WriteRecipe("quip-longer-kill.yaml", 16384);
  const std::string state = dir_ + "/kill9-state";
  const std::vector<std::string> coordinator_args = {"--state", state};
  const std::vector<std::string> worker_args = {"--job",
                                                state + "/credentials/job-000001.token"};
  const std::string log = dir_ + "/kill9-run.log";
  Result r = Shell(Qcal() + " run " + recipe_ + " --model " + model_ + " --out " + dir_ +
                   "/kill9-out --workers 2 --data-root " + shared_ + " --no-eval --state " +
                   state + " > " + log + " 2>&1 & echo $!");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const pid_t run_pid = std::stoi(r.out);
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  size_t coordinators = 0, workers = 0;  // as last seen together (mpirun's helpers come and go)
  while (Clock::now() < deadline && (coordinators == 0 || workers < 3)) {
    coordinators = ProcessesWithArgs(coordinator_args).size();
    workers = ProcessesWithArgs(worker_args).size();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(coordinators, 0u) << *ReadFile(log);
  ASSERT_GE(workers, 3u) << *ReadFile(log);
  ASSERT_EQ(::kill(run_pid, SIGKILL), 0);

  const auto t0 = Clock::now();
  while (Clock::now() - t0 < std::chrono::seconds(20) &&
         (!ProcessesWithArgs(coordinator_args).empty() ||
          !ProcessesWithArgs(worker_args).empty())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ProcessesWithArgs(coordinator_args).empty())
      << "qcal run's coordinator outlived it by 20 s";
  EXPECT_TRUE(ProcessesWithArgs(worker_args).empty()) << "its workers outlived it by 20 s";
  std::printf("[ info     ] coordinator and workers gone %.1f s after kill -9 of qcal run\n",
              std::chrono::duration<double>(Clock::now() - t0).count());
  for (int pid : ProcessesWithArgs(worker_args)) ::kill(pid, SIGKILL);
  for (int pid : ProcessesWithArgs(coordinator_args)) ::kill(pid, SIGKILL);
}

}  // namespace
}  // namespace qcal::coordinator
