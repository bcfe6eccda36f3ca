#include "client/service_commands.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/utf8.h"
#include "client/job_view.h"
#include "client/progress.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "proto/qcal.pb.h"
#include "runner/job_dir.h"
#include "runner/job_inputs.h"
#include "rpc/auth.h"
#include "rpc/job_client.h"
#include "rpc/job_state.h"
#include "runner/task_plan.h"

extern char** environ;

namespace qcal::client {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::qcal::v1;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Connection

struct ConnectionOptions {
  std::string address;
  std::string token_file;
  rpc::ClientTls tls;
};

void AddConnectionOptions(CLI::App* cmd, ConnectionOptions* o) {
  const char* env_address = std::getenv("QCAL_COORDINATOR");
  o->address = env_address ? env_address : "127.0.0.1:50051";
  const char* env_token = std::getenv("QCAL_AUTH_TOKEN_FILE");
  o->token_file = env_token ? env_token : "";
  cmd->add_option("--coordinator", o->address, "coordinator host:port (env QCAL_COORDINATOR)")
      ->capture_default_str();
  cmd->add_option("--auth-token-file", o->token_file,
                  "file with the bearer token (env QCAL_AUTH_TOKEN_FILE)");
  cmd->add_option("--tls-ca", o->tls.ca_file, "use TLS, trusting this CA")
      ->check(CLI::ExistingFile);
  cmd->add_option("--tls-cert", o->tls.cert_file, "client certificate (mutual TLS)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--tls-key", o->tls.key_file, "key of --tls-cert")->check(CLI::ExistingFile);
}

StatusOr<std::string> TokenOf(const ConnectionOptions& o) {
  if (o.token_file.empty()) {
    return absl::InvalidArgumentError(
        "no auth token: pass --auth-token-file or set QCAL_AUTH_TOKEN_FILE");
  }
  return rpc::ReadTokenFile(o.token_file);
}

StatusOr<std::unique_ptr<rpc::JobClient>> Connect(const ConnectionOptions& o) {
  rpc::JobClientOptions options;
  options.address = o.address;
  options.tls = o.tls;
  QCAL_ASSIGN_OR_RETURN(options.token, TokenOf(o));
  return rpc::MakeGrpcJobClient(options);
}

// ---------------------------------------------------------------------------------------------
// submit / status / watch / cancel / list

struct SpecOptions {
  std::string recipe_path;
  std::string model_dir, out_dir, job_dir;
  std::string data_root = kDefaultDataRoot;
  int workers = 1;
  int threads = 0;
  int calib_batch = 0;
  int experts_per_task = 0;
  std::string name;
  std::string max_memory;  // "8G", "512M", bytes; empty: the worker's default
  std::string device;      // every rank's --device; empty: auto
  bool overwrite = false;  // replace a finished checkpoint this job's journal did not write
  // The evaluation phase (perplexity by the workers after the job).
  bool eval = false;
  std::vector<std::string> eval_data;
  int64_t eval_ctx = 512;
  int64_t eval_max_tokens = -1;
};

void AddSpecOptions(CLI::App* cmd, SpecOptions* o) {
  cmd->add_option("recipe", o->recipe_path, "recipe YAML (jobs/*.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--model", o->model_dir, "float model directory (HF layout)")->required();
  cmd->add_option("--out", o->out_dir, "output checkpoint directory")
      ->transform(qcal::CanonicalFlagPath)->required();
  cmd->add_option("--job-dir", o->job_dir, "journal and calibration products (default OUT.job)")
      ->transform(qcal::CanonicalFlagPath);
  cmd->add_option("--data-root", o->data_root, "where the recipe's calibration files resolve")
      ->capture_default_str();
  cmd->add_option("--workers", o->workers, "MPI ranks")->capture_default_str();
  cmd->add_option("--threads", o->threads, "compute threads per rank (0 = automatic)")
      ->check(CLI::Range(0, kMaxThreads));
  cmd->add_option("--calib-batch", o->calib_batch, "sequences per calibration forward (0 = 8)");
  cmd->add_option("--experts-per-task", o->experts_per_task, kExpertsPerTaskHelp)
      ->check(CLI::Range(-1, 1 << 20));
  cmd->add_option("--device", o->device,
                  "compute device of every rank: auto (a local GPU by the rank's local index, "
                  "else the CPU), cpu, cuda, cuda:N (default auto)");
  cmd->add_option("--name", o->name, "a label shown by `qcal list`");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a finished checkpoint in --out that this job directory did not write");
  cmd->add_option("--max-memory", o->max_memory,
                  "activations a worker rank keeps in memory before spilling them to the job "
                  "directory: 8G, 512M, ... (default: half the node's RAM over its ranks)");
  cmd->add_option("--eval-data", o->eval_data,
                  "text files the evaluation phase scores (default: WikiText-2 test and the "
                  "TinyStories sample under the data root)");
  cmd->add_option("--eval-ctx", o->eval_ctx, "perplexity window")->capture_default_str();
  cmd->add_option("--eval-max-tokens", o->eval_max_tokens,
                  "evaluate on at most this many tokens per file");
}

std::string Absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  return (ec ? fs::path(path) : p).lexically_normal().string();
}

// Protobuf strings (and the coordinator's JSON job records) are UTF-8: refuse anything else here,
// naming what, rather than as an empty INTERNAL error from the RPC layer.
Status RequireUtf8(const std::string& what, const std::string& value) {
  if (const std::string where = DescribeInvalidUtf8(value); !where.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not UTF-8 text (at ", where, ")"));
  }
  return absl::OkStatus();
}

Status CheckSpecText(const v1::JobSpec& spec) {
  QCAL_RETURN_IF_ERROR(RequireUtf8(absl::StrCat("the recipe path '", spec.recipe_path(), "'"),
                                   spec.recipe_path()));
  QCAL_RETURN_IF_ERROR(RequireUtf8(spec.recipe_path(), spec.recipe_yaml()));
  const std::pair<const char*, const std::string*> fields[] = {
      {"--model", &spec.model_dir()}, {"--out", &spec.out_dir()}, {"--job-dir", &spec.job_dir()},
      {"--data-root", &spec.data_root()}, {"--name", &spec.name()}};
  for (const auto& [flag, value] : fields) QCAL_RETURN_IF_ERROR(RequireUtf8(flag, *value));
  for (const v1::EvalData& d : spec.eval().data()) {
    QCAL_RETURN_IF_ERROR(RequireUtf8("--eval-data", d.path()));
  }
  return absl::OkStatus();
}

StatusOr<v1::JobSpec> MakeSpec(const SpecOptions& o) {
  v1::JobSpec spec;
  spec.set_recipe_path(Absolute(o.recipe_path));
  QCAL_ASSIGN_OR_RETURN(std::string yaml, ReadFile(o.recipe_path));
  spec.set_recipe_yaml(yaml);
  spec.set_model_dir(Absolute(o.model_dir));
  spec.set_out_dir(Absolute(o.out_dir));
  spec.set_job_dir(Absolute(o.job_dir));
  spec.set_data_root(Absolute(o.data_root));
  spec.set_workers(o.workers);
  spec.set_threads_per_worker(o.threads);
  spec.set_device(o.device);
  spec.set_calib_batch(o.calib_batch);
  spec.set_experts_per_task(o.experts_per_task);
  spec.set_name(o.name);
  spec.set_overwrite(o.overwrite);
  if (!o.max_memory.empty()) {
    QCAL_ASSIGN_OR_RETURN(int64_t bytes, ParseBytes(o.max_memory, "--max-memory"));
    spec.set_max_memory_bytes(bytes);
  }
  if (o.eval) {
    v1::EvalSpec* eval = spec.mutable_eval();
    eval->set_ctx(o.eval_ctx);
    eval->set_max_tokens(o.eval_max_tokens);
    if (!o.eval_data.empty()) {
      for (const std::string& p : o.eval_data) {
        v1::EvalData* d = eval->add_data();
        d->set_label(fs::path(p).stem().string());
        d->set_path(Absolute(p));
      }
    } else {
      const std::string root = spec.data_root();
      const std::pair<const char*, std::string> defaults[] = {
          {"wikitext2", root + "/data/wikitext2/wiki.test.joined.txt"},
          {"tinystories", root + "/data/tinystories/TinyStories-valid.sample30k.txt"}};
      for (const auto& [label, path] : defaults) {
        if (::access(path.c_str(), R_OK) != 0) continue;
        v1::EvalData* d = eval->add_data();
        d->set_label(label);
        d->set_path(path);
      }
    }
  }
  QCAL_RETURN_IF_ERROR(CheckSpecText(spec));
  return spec;
}

int RunSubmit(const ConnectionOptions& c, const SpecOptions& s, bool watch, bool json_out) {
  auto client = Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto spec = MakeSpec(s);
  if (!spec.ok()) return Fail(spec.status());
  auto submitted = (*client)->Submit(*spec);
  if (!submitted.ok()) return FailRpc(submitted.status());
  const std::string id = *submitted;
  if (json_out) {
    std::printf("%s\n", json{{"job_id", id}}.dump().c_str());
  } else {
    std::printf("%s\n", id.c_str());
  }
  std::fflush(stdout);
  if (!watch) return 0;
  auto job = JobWatcher(**client, json_out).Follow(id);
  if (!job.ok()) return FailRpc(job.status());
  return ExitCodeFor(job->state());
}

int RunStatus(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto got = (*client)->Get(id);
  if (!got.ok()) return FailRpc(got.status());
  const v1::Job& job = *got;
  if (json_out) {
    std::printf("%s\n", JobToJson(job).dump().c_str());
  } else {
    PrintJob(job);
  }
  return 0;
}

int RunWatch(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto job = JobWatcher(**client, json_out).Follow(id);
  if (!job.ok()) return FailRpc(job.status());
  if (!json_out) {
    std::printf("%s %s%s%s\n", job->id().c_str(), rpc::JobStateName(job->state()),
                job->error().empty() ? "" : ": ", job->error().c_str());
  }
  return ExitCodeFor(job->state());
}

int RunCancel(const ConnectionOptions& c, const std::string& id, bool json_out) {
  auto client = Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto cancelled = (*client)->Cancel(id);
  if (!cancelled.ok()) return FailRpc(cancelled.status());
  const v1::Job& job = *cancelled;
  if (json_out) {
    std::printf("%s\n", JobToJson(job).dump().c_str());
  } else {
    std::printf("%s %s\n", job.id().c_str(), rpc::JobStateName(job.state()));
  }
  return 0;
}

int RunList(const ConnectionOptions& c, bool json_out) {
  auto client = Connect(c);
  if (!client.ok()) return Fail(client.status());
  auto listed = (*client)->List();
  if (!listed.ok()) return FailRpc(listed.status());
  const std::vector<v1::Job>& jobs = *listed;
  if (json_out) {
    json arr = json::array();
    for (const auto& j : jobs) arr.push_back(JobToJson(j));
    std::printf("%s\n", arr.dump().c_str());
    return 0;
  }
  std::printf("%-11s %-16s %-10s %-9s %-7s %-8s %-19s %s\n", "ID", "NAME", "STATE", "PHASE",
              "BLOCKS", "WORKERS", "UPDATED", "OUT");
  for (const auto& j : jobs) {
    std::printf("%-11s %-16s %-10s %-9s %-7s %-8s %-19s %s\n", j.id().c_str(),
                j.spec().name().empty() ? "-" : Shown(j.spec().name()).substr(0, 16).c_str(),
                rpc::JobStateName(j.state()), j.phase().c_str(),
                absl::StrCat(j.blocks_done(), "/", j.blocks_total()).c_str(),
                absl::StrCat(j.workers_alive(), "/", j.spec().workers()).c_str(),
                DateTime(j.updated_unix()).c_str(), Shown(j.spec().out_dir()).c_str());
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// qcal run: a private coordinator, its workers, the job, then perplexity.

struct RunOptions {
  SpecOptions spec;
  std::string state_dir;
  std::string coordinator_binary, worker_binary, mpirun;
  std::string launcher;        // mpirun (default) or srun (inside a Slurm allocation)
  std::string listen = "127.0.0.1:0";
  std::string advertise_host;  // what the workers dial (multi-node: this host's name)
  int max_group_restarts = -1;  // -1: the coordinator's default
  bool no_eval = false;
  bool json = false;
};

// qcal-coordinator beside this program, in the build tree's coordinator/ folder, or on PATH.
std::string FindCoordinatorBinary() { return io::FindProgram("qcal-coordinator", "coordinator"); }

// The coordinator child: started in its own process group (a Ctrl-C reaches only qcal, which
// cancels the job first), stopped with SIGTERM.
class LocalCoordinator {
 public:
  ~LocalCoordinator() { Stop(); }

  Status Start(const RunOptions& o, const std::string& state, const std::string& token_file) {
    state_ = state;
    const std::string address_file = state + "/address";
    ::unlink(address_file.c_str());
    std::vector<std::string> args = {
        o.coordinator_binary.empty() ? FindCoordinatorBinary() : o.coordinator_binary,
        "--listen", o.listen, "--state", state, "--auth-token-file", token_file,
        "--address-file", address_file, "--exit-with-parent"};
    if (!o.worker_binary.empty()) args.insert(args.end(), {"--worker-binary", o.worker_binary});
    if (!o.mpirun.empty()) args.insert(args.end(), {"--mpirun", o.mpirun});
    if (!o.launcher.empty()) args.insert(args.end(), {"--launcher", o.launcher});
    if (!o.advertise_host.empty()) {
      args.insert(args.end(), {"--advertise-host", o.advertise_host});
    }
    if (o.max_group_restarts >= 0) {
      args.insert(args.end(), {"--max-group-restarts", std::to_string(o.max_group_restarts)});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    output_ = state + "/coordinator.out";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, output_.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    const int rc = ::posix_spawnp(&pid_, argv[0], &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      pid_ = 0;
      return absl::FailedPreconditionError(
          absl::StrCat("cannot run '", args[0], "': ", std::strerror(rc),
                       " (build the qcal-coordinator target or pass --coordinator-binary)"));
    }
    for (int i = 0; i < 600; ++i) {
      auto text = ReadFile(address_file);
      if (text.ok() && !text->empty()) {
        address_ = text->substr(0, text->find('\n'));
        return absl::OkStatus();
      }
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return absl::UnavailableError(absl::StrCat(
            "the local coordinator exited at start; its output (", output_, "):\n",
            ReadFile(output_).value_or("")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("the local coordinator did not start within 30 s; see ", output_));
  }

  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status;
    for (int i = 0; i < 400; ++i) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
  }

  const std::string& address() const { return address_; }

  // The coordinator exited without Stop (killed, crashed): reaps it and says how.
  std::optional<std::string> Died() {
    if (pid_ <= 0) return std::nullopt;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
    pid_ = 0;
    if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
    return absl::StrCat("exit code ", WEXITSTATUS(status));
  }

 private:
  pid_t pid_ = 0;
  std::string state_, address_, output_;
};

std::atomic<int> g_interrupts{0};
std::atomic<int> g_terms{0};
void OnInterrupt(int sig) {
  g_interrupts.fetch_add(1);
  if (sig == SIGTERM) g_terms.fetch_add(1);
}

int RunRun(const RunOptions& o_in) {
  RunOptions o = o_in;
  o.spec.eval = !o.no_eval;
  auto spec = MakeSpec(o.spec);
  if (!spec.ok()) return Fail(spec.status());

  // State directory and a fresh token only this user can read.
  std::string state = o.state_dir;
  const bool temporary_state = state.empty();
  if (temporary_state) {
    std::string tmpl = (fs::temp_directory_path() / "qcal-run.XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return Fail("cannot create a temporary state dir");
    state = tmpl;
  } else if (auto s = MakeDirs(state); !s.ok()) {
    return Fail(s);
  }
  state = Absolute(state);
  const std::string token_file = state + "/auth-token";
  {
    auto token = rpc::NewRandomToken();
    if (!token.ok()) return Fail(token.status());
    ::unlink(token_file.c_str());
    const int fd = ::open(token_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, token->data(), token->size()) != static_cast<ssize_t>(token->size())) {
      if (fd >= 0) ::close(fd);
      return Fail(absl::StrCat(token_file, ": cannot write the auth token"));
    }
    ::close(fd);
  }

  // A job an interrupted run left QUEUED or RUNNING in this state directory (a Slurm requeue, a
  // preemption, a crash): the coordinator resumes it when it starts, and we follow it instead of
  // submitting a second job for the same output (same model and recipe; else the submission is
  // refused, naming that job). Read before the start, since a resumed job with nothing left but
  // finalizing may already be over when we could ask.
  std::string resumed_id;
  if (!temporary_state) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(state + "/jobs", ec)) {
      auto text = ReadFile(entry.path().string());
      if (!text.ok()) continue;
      const json record = json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (!record.is_object() || !record.contains("spec") || !record["spec"].is_object()) continue;
      const std::string job_state = record.value("state", "");
      if ((job_state == "JOB_STATE_QUEUED" || job_state == "JOB_STATE_RUNNING") &&
          record["spec"].value("out_dir", "") == spec->out_dir() &&
          record["spec"].value("model_dir", "") == spec->model_dir() &&
          record["spec"].value("recipe_yaml", "") == spec->recipe_yaml() &&
          record.value("id", "") > resumed_id) {
        resumed_id = record.value("id", "");
      }
    }
  }
  LocalCoordinator coordinator;
  if (auto s = coordinator.Start(o, state, token_file); !s.ok()) return Fail(s);
  ConnectionOptions conn;
  conn.address = coordinator.address();
  conn.token_file = token_file;
  auto client = Connect(conn);
  if (!client.ok()) return Fail(client.status());
  {
    auto channel = rpc::MakeChannel(conn.address, conn.tls);
    if (!channel.ok()) return Fail(channel.status());
    if (auto s = rpc::WaitForHealthy(*channel, std::chrono::seconds(30)); !s.ok()) return Fail(s);
  }
  StatusOr<std::string> submitted =
      resumed_id.empty() ? (*client)->Submit(*spec) : StatusOr<std::string>(resumed_id);
  if (!resumed_id.empty() && !o.json) {
    std::printf("%s: resumed by the coordinator on %s (an earlier run was interrupted); "
                "following it\n", resumed_id.c_str(), state.c_str());
  }
  if (!submitted.ok()) {
    // Refused before it existed: nothing in the state directory is worth keeping.
    coordinator.Stop();
    if (temporary_state) {
      std::error_code ec;
      fs::remove_all(state, ec);
    }
    return FailRpc(submitted.status());
  }
  const std::string id = *submitted;
  if (!o.json) {
    std::printf("%s: %s -> %s with %d worker rank(s); local coordinator at %s (state %s)\n",
                id.c_str(), spec->model_dir().c_str(), spec->out_dir().c_str(), spec->workers(),
                coordinator.address().c_str(), state.c_str());
    std::fflush(stdout);
  }

  // First Ctrl-C cancels the job, so its workers are stopped rather than orphaned; the second
  // gives up at once. SIGTERM (`timeout`, a batch system's requeue or preemption) does the same
  // with a temporary state directory; with --state it stops the coordinator instead, leaving the
  // job resumable: qcal run on the same --state continues it (exit code 3).
  g_interrupts = 0;
  g_terms = 0;
  struct sigaction sa = {}, old_int = {}, old_term = {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  std::atomic<bool> watching{true};
  std::thread canceller([&] {
    bool cancelled = false;
    while (watching) {
      const int n = g_interrupts.load();
      if (n >= 1 && !cancelled && !temporary_state && g_terms.load() >= 1) {
        std::fprintf(stderr, "\nqcal: SIGTERM: stopping the coordinator; %s resumes when qcal "
                             "run is started again with --state %s\n",
                     id.c_str(), state.c_str());
        coordinator.Stop();
        std::_Exit(3);
      }
      if (n >= 1 && !cancelled) {
        std::fprintf(stderr, "\nqcal: cancelling %s (Ctrl-C again to quit now)\n", id.c_str());
        (*client)->Cancel(id).IgnoreError();
        cancelled = true;
      }
      if (n >= 2) {
        coordinator.Stop();
        std::_Exit(130);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto job = JobWatcher(**client, o.json).Follow(id);
  // A coordinator that died under us (killed, out of memory) is started again on the same state
  // directory: it resumes the job from its journal, and we follow it there.
  for (int restarts = 1; !job.ok() && g_interrupts.load() == 0 && restarts <= 3; ++restarts) {
    const std::optional<std::string> died = coordinator.Died();
    if (!died) break;
    std::fprintf(stderr,
                 "qcal: the local coordinator died (%s); starting it again on %s (%d of 3): the "
                 "job resumes from its journal\n",
                 died->c_str(), state.c_str(), restarts);
    if (auto s = coordinator.Start(o, state, token_file); !s.ok()) {
      job = s;
      break;
    }
    conn.address = coordinator.address();
    auto again = Connect(conn);
    if (!again.ok()) {
      job = again.status();
      break;
    }
    auto channel = rpc::MakeChannel(conn.address, conn.tls);
    if (channel.ok()) rpc::WaitForHealthy(*channel, std::chrono::seconds(30)).IgnoreError();
    auto old_client = std::move(*client);
    *client = std::move(*again);
    old_client.reset();
    job = JobWatcher(**client, o.json).Follow(id);
  }
  watching = false;
  canceller.join();
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  coordinator.Stop();
  if (!job.ok()) return FailRpc(job.status());

  json eval_rows = json::array();
  if (!o.json) {
    std::printf("\n%s %s%s%s\n", id.c_str(), rpc::JobStateName(job->state()),
                job->error().empty() ? "" : ": ", job->error().c_str());
    PrintBlockTable(*job);
    if (job->state() == v1::JOB_STATE_SUCCEEDED) PrintResult(*job);
  }
  if (job->state() != v1::JOB_STATE_SUCCEEDED) {
    std::fprintf(stderr, "qcal: coordinator log and worker output: %s, %s\n",
                 (state + "/coordinator.log").c_str(),
                 JobPaths(JobDirFor(spec->job_dir(), spec->out_dir())).workers_log.c_str());
  }

  // The evaluation phase ran on the workers; its perplexities are part of the job.
  std::map<std::string, json> by_file;
  std::vector<std::string> order;
  for (const v1::EvalResult& e : job->evals()) {
    const std::string& label = e.params().label();
    if (by_file.count(label) == 0) {
      order.push_back(label);
      by_file[label] = {{"data", label}, {"path", e.params().path()}};
    }
    if (e.params().model() == "float") by_file[label]["tokens"] = e.scored();
    by_file[label][e.params().model()] = e.perplexity();
  }
  for (const std::string& label : order) eval_rows.push_back(by_file[label]);
  if (!o.json && job->state() == v1::JOB_STATE_SUCCEEDED) PrintEvalTable(*job);
  if (o.json) {
    std::printf("%s\n", json{{"job", JobToJson(*job)}, {"perplexity", eval_rows}}.dump().c_str());
  }
  if (temporary_state && job->state() == v1::JOB_STATE_SUCCEEDED) {
    std::error_code ec;
    fs::remove_all(state, ec);
  }
  return ExitCodeFor(job->state());
}

}  // namespace

void AddServiceCommands(CLI::App& app, int* exit_code) {
  // submit
  {
    auto* cmd = app.add_subcommand("submit", "Submit a quantization job to a coordinator");
    auto c = std::make_shared<ConnectionOptions>();
    auto s = std::make_shared<SpecOptions>();
    auto flags = std::make_shared<std::pair<bool, bool>>(false, false);  // watch, json
    AddSpecOptions(cmd, s.get());
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--watch", flags->first, "follow the job and exit with its status");
    cmd->add_flag("--eval", s->eval,
                  "add the evaluation phase: the workers score the float and quantized model "
                  "(--eval-data files, default WikiText-2 test and TinyStories)");
    cmd->add_flag("--json", flags->second, "print JSON");
    cmd->callback([=] { *exit_code = RunSubmit(*c, *s, flags->first, flags->second); });
  }
  // status / watch / cancel
  struct JobCommand {
    const char* name;
    const char* help;
    int (*run)(const ConnectionOptions&, const std::string&, bool);
  };
  for (const JobCommand& jc : {JobCommand{"status", "Show a job", RunStatus},
                               JobCommand{"watch",
                                          "Follow a job's events until it ends (exit 0 "
                                          "succeeded, 1 failed, 2 cancelled)",
                                          RunWatch},
                               JobCommand{"cancel", "Cancel a job (its workers are stopped)",
                                          RunCancel}}) {
    auto* cmd = app.add_subcommand(jc.name, jc.help);
    auto c = std::make_shared<ConnectionOptions>();
    auto id = std::make_shared<std::string>();
    auto json_out = std::make_shared<bool>(false);
    cmd->add_option("job", *id, "job id (job-000001)")->required();
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--json", *json_out, "print JSON");
    auto run = jc.run;
    cmd->callback([=] { *exit_code = run(*c, *id, *json_out); });
  }
  // list
  {
    auto* cmd = app.add_subcommand("list", "List the coordinator's jobs");
    auto c = std::make_shared<ConnectionOptions>();
    auto json_out = std::make_shared<bool>(false);
    AddConnectionOptions(cmd, c.get());
    cmd->add_flag("--json", *json_out, "print JSON");
    cmd->callback([=] { *exit_code = RunList(*c, *json_out); });
  }
  // run
  {
    auto* cmd = app.add_subcommand(
        "run",
        "Quantize with a private local coordinator and N MPI workers, then print float and "
        "quantized perplexity");
    auto o = std::make_shared<RunOptions>();
    AddSpecOptions(cmd, &o->spec);
    cmd->add_option("--state", o->state_dir,
                    "coordinator state directory (default: a temporary one, removed on success); "
                    "run again on the same one after an interruption, the job resumes");
    cmd->add_option("--coordinator-binary", o->coordinator_binary,
                    "qcal-coordinator (default: beside qcal or in the build tree)");
    cmd->add_option("--worker-binary", o->worker_binary,
                    "qcal-worker (default: the coordinator's choice)");
    cmd->add_option("--mpirun", o->mpirun, "mpirun to launch the workers with");
    cmd->add_option("--launcher", o->launcher,
                    "mpirun (this machine, default) or srun (a job step in the Slurm allocation "
                    "qcal runs in: the sbatch templates in slurm/)")
        ->check(CLI::IsMember({"mpirun", "srun"}));
    cmd->add_option("--listen", o->listen,
                    "host:port the private coordinator serves on (0.0.0.0:0 for workers on "
                    "other nodes)")
        ->capture_default_str();
    cmd->add_option("--advertise-host", o->advertise_host,
                    "host the workers dial (default: the listening host)");
    cmd->add_option("--max-group-restarts", o->max_group_restarts,
                    "relaunches of a worker group that died before the job fails (default 3)");
    cmd->add_flag("--no-eval", o->no_eval,
                  "skip the evaluation phase (float and quantized perplexity by the workers)");
    cmd->add_flag("--json", o->json, "print JSON events and one JSON summary at the end");
    cmd->callback([o, exit_code] { *exit_code = RunRun(*o); });
  }
}

}  // namespace qcal::client
