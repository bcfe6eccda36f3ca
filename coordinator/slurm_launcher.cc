// SlurmLauncher: each worker group is a Slurm job of its own (see launcher.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "coordinator/launcher.h"

extern char** environ;

namespace qcal::coordinator {
namespace {

// Single-quoted for bash.
std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// "KEY=VALUE KEY=VALUE ..." of `scontrol show job -o` (values without spaces, which holds for
// the fields read here).
std::map<std::string, std::string> ParseScontrol(const std::string& line) {
  std::map<std::string, std::string> out;
  for (absl::string_view word : absl::StrSplit(line, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
    const size_t eq = word.find('=');
    if (eq == absl::string_view::npos) continue;
    out.emplace(std::string(word.substr(0, eq)), std::string(word.substr(eq + 1)));
  }
  return out;
}

// Slurm job states in which the group still exists (it may run again).
bool Alive(const std::string& state) {
  static const std::set<std::string> alive = {
      "PENDING",   "CONFIGURING",  "RUNNING",     "COMPLETING", "SUSPENDED", "REQUEUED",
      "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD",
      "STOPPED"};
  return alive.count(state) != 0;
}

bool Alarming(const std::string& state) {
  return state == "PREEMPTED" || state == "NODE_FAIL" || state == "TIMEOUT" ||
         state == "REQUEUED" || state == "BOOT_FAIL" || state == "OUT_OF_MEMORY" ||
         state == "SUSPENDED" || state == "DEADLINE" || state == "FAILED";
}

class SlurmWorkerGroup : public WorkerGroup {
 public:
  SlurmWorkerGroup(SlurmLauncherOptions options, std::string slurm_id, std::string log_path)
      : o_(std::move(options)), id_(std::move(slurm_id)), log_path_(std::move(log_path)) {
    notes_.push_back({false, absl::StrCat("submitted the workers as Slurm job ", id_)});
  }
  ~SlurmWorkerGroup() override {
    if (!exit_) Cancel({"--signal=KILL", "--full"});  // never leave a job behind
  }

  std::optional<std::string> Poll() override {
    if (exit_) return exit_;
    const auto now = std::chrono::steady_clock::now();
    if (polled_ && now - last_poll_ < std::chrono::duration<double>(o_.poll_interval_s)) {
      return std::nullopt;
    }
    polled_ = true;
    last_poll_ = now;
    StatusOr<CommandResult> r = RunCommand({o_.scontrol, "show", "job", "-o", id_}, 30);
    if (!r.ok()) {
      QCAL_LOG_WARN("slurm job {}: {}", id_, std::string(r.status().message()));
      return std::nullopt;  // slurmctld busy or unreachable: ask again later
    }
    if (r->exit_code != 0) {
      if (r->output.find("Invalid job id") != std::string::npos) {
        // Purged from slurmctld's memory (MinJobAge) after it ended.
        exit_ = absl::StrCat("Slurm job ", id_, " is no longer known to Slurm");
      } else {
        QCAL_LOG_WARN("slurm job {}: scontrol: {}", id_, r->output);
      }
      return exit_;
    }
    const auto fields = ParseScontrol(r->output);
    auto get = [&](const char* k) {
      auto it = fields.find(k);
      return it == fields.end() ? std::string() : it->second;
    };
    const std::string state = get("JobState");
    if (state != state_) {
      state_ = state;
      std::string msg = absl::StrCat("Slurm job ", id_, ": ", state);
      const std::string reason = get("Reason");
      if (state == "PENDING" && !reason.empty() && reason != "None") {
        absl::StrAppend(&msg, " (", reason, ")");
      }
      if (state == "RUNNING") absl::StrAppend(&msg, " on ", get("NodeList"));
      notes_.push_back({Alarming(state), msg});
    }
    if (!state.empty() && !Alive(state)) {
      exit_ = absl::StrCat("Slurm job ", id_, " ended ", state, " (exit code ", get("ExitCode"),
                           ")");
    }
    return exit_;
  }

  void Terminate() override { Cancel({}); }
  void Kill() override { Cancel({"--signal=KILL", "--full"}); }
  std::string LogTail(int max_lines) override { return TailOfFile(log_path_, max_lines); }
  std::string Describe() const override {
    return absl::StrCat("Slurm job ", id_, " (log ", log_path_, ")");
  }
  std::vector<Note> TakeNotes() override { return std::exchange(notes_, {}); }

 private:
  void Cancel(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {o_.scancel};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(id_);
    StatusOr<CommandResult> r = RunCommand(argv, 30);
    if (!r.ok() || r->exit_code != 0) {
      QCAL_LOG_WARN("slurm job {}: scancel failed: {}", id_,
                    r.ok() ? r->output : std::string(r.status().message()));
    }
    if (!flags.empty()) RunCommand({o_.scancel, id_}, 30).IgnoreError();  // and end the job
    polled_ = false;  // see the result at the next Poll
  }

  SlurmLauncherOptions o_;
  std::string id_, log_path_;
  std::optional<std::string> exit_;
  std::string state_;
  bool polled_ = false;
  std::chrono::steady_clock::time_point last_poll_;
  std::vector<Note> notes_;
};

class SlurmLauncher : public Launcher {
 public:
  explicit SlurmLauncher(SlurmLauncherOptions options) : o_(std::move(options)) {}

  StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec& spec) override {
    QCAL_RETURN_IF_ERROR(CheckWorkerBinary(o_.worker_binary));
    const std::string dir = spec.log_path.substr(0, spec.log_path.rfind('/'));
    const std::string script = dir + "/workers.sbatch";
    QCAL_RETURN_IF_ERROR(WriteFileAtomic(script, SlurmWorkerScript(o_, spec)));
    std::vector<std::string> argv = {o_.sbatch};
    const std::vector<std::string> args = SlurmSbatchArgs(o_, spec, script);
    argv.insert(argv.end(), args.begin(), args.end());
    QCAL_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, 60));
    std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
    const bool numeric = !id.empty() && id.find_first_not_of("0123456789") == std::string::npos;
    if (r.exit_code != 0 || !numeric) {
      return absl::UnavailableError(
          absl::StrCat("sbatch failed (exit code ", r.exit_code, "): ", r.output));
    }
    if (!spec.pid_file.empty()) {
      if (Status s = WriteFileAtomic(spec.pid_file, absl::StrCat("slurm ", id, "\n")); !s.ok()) {
        QCAL_LOG_WARN("job {}: {}", spec.job_id, std::string(s.message()));
      }
    }
    QCAL_LOG_INFO("job {}: {} ranks submitted as Slurm job {}, log {}", spec.job_id, spec.workers,
                  id, spec.log_path);
    return std::unique_ptr<WorkerGroup>(new SlurmWorkerGroup(o_, id, spec.log_path));
  }

  Status StopLeftovers(const LaunchSpec& spec) override {
    if (spec.pid_file.empty()) return absl::OkStatus();
    StatusOr<std::string> text = ReadFile(spec.pid_file);
    if (!text.ok() || text->rfind("slurm ", 0) != 0) return absl::OkStatus();
    const std::string id = text->substr(6, text->find('\n') - 6);
    if (id.empty() || id.find_first_not_of("0123456789") != std::string::npos) {
      return absl::DataLossError(absl::StrCat(spec.pid_file, ": not 'slurm JOBID'"));
    }
    // Ending a job that already ended is harmless (scancel says so and changes nothing).
    RunCommand({o_.scancel, "--signal=KILL", "--full", id}, 30).IgnoreError();
    RunCommand({o_.scancel, id}, 30).IgnoreError();
    return absl::OkStatus();
  }

 private:
  SlurmLauncherOptions o_;
};

}  // namespace

std::unique_ptr<Launcher> MakeSlurmLauncher(SlurmLauncherOptions options) {
  return std::make_unique<SlurmLauncher>(std::move(options));
}

std::vector<std::string> SlurmSbatchArgs(const SlurmLauncherOptions& o, const LaunchSpec& spec,
                                         const std::string& script_path) {
  std::vector<std::string> a = {"--parsable",
                                "--no-requeue",
                                "--job-name=qcal-workers-" + spec.job_id,
                                "--ntasks=" + std::to_string(spec.workers),
                                "--output=" + spec.log_path,
                                "--open-mode=append"};
  if (o.ranks_per_node > 0) a.push_back("--ntasks-per-node=" + std::to_string(o.ranks_per_node));
  if (o.gpus_per_rank > 0) a.push_back("--gpus-per-task=" + std::to_string(o.gpus_per_rank));
  if (o.cpus_per_rank > 0) a.push_back("--cpus-per-task=" + std::to_string(o.cpus_per_rank));
  if (!o.partition.empty()) a.push_back("--partition=" + o.partition);
  if (!o.account.empty()) a.push_back("--account=" + o.account);
  if (!o.qos.empty()) a.push_back("--qos=" + o.qos);
  if (!o.time.empty()) a.push_back("--time=" + o.time);
  a.insert(a.end(), o.extra_sbatch_args.begin(), o.extra_sbatch_args.end());
  a.push_back(script_path);
  return a;
}

std::string SlurmWorkerScript(const SlurmLauncherOptions& o, const LaunchSpec& spec) {
  std::string cmd;
  for (const std::string& w : WorkerCommand(o.worker_binary, spec)) {
    absl::StrAppend(&cmd, cmd.empty() ? "" : " ", Quote(w));
  }
  return absl::StrCat(
      "#!/bin/bash\n"
      "# The worker ranks of qcal job ", spec.job_id,
      ", submitted by qcal-coordinator --launcher slurm.\n"
      "echo \"==== $(date -Is) Slurm job ${SLURM_JOB_ID}: ${SLURM_NTASKS} rank(s) on "
      "${SLURM_JOB_NODELIST}\"\n"
      "exec srun --mpi=pmix --kill-on-bad-exit=1 ",
      cmd, "\n");
}

StatusOr<CommandResult> RunCommand(const std::vector<std::string>& args, double timeout_s) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot run '", args[0], "': ", std::strerror(rc)));
  }
  CommandResult result;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  bool timed_out = false;
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd p = {fds[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    const ssize_t got = ::read(fds[0], buf, sizeof(buf));
    if (got <= 0) break;  // EOF: the command closed its output
    if (result.output.size() < (1 << 20)) result.output.append(buf, static_cast<size_t>(got));
  }
  ::close(fds[0]);
  int status = 0;
  if (timed_out) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return absl::DeadlineExceededError(
        absl::StrCat("'", args[0], "' did not finish within ", timeout_s, " s"));
  }
  ::waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  while (!result.output.empty() && result.output.back() == '\n') result.output.pop_back();
  return result;
}

}  // namespace qcal::coordinator
