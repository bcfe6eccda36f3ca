// LocalMpiLauncher: mpirun on this machine, in its own process group.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "coordinator/launcher.h"

extern char** environ;

namespace qcal::coordinator {
namespace {

struct ProcStat {
  int ppid = 0;
  unsigned long long start_time = 0;  // clock ticks since boot (identifies the process)
};

bool ReadProcStat(int pid, ProcStat* out) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  // "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
  //  stime cutime cstime priority nice num_threads itrealvalue starttime ..."; comm may hold
  // spaces and parentheses, so parse after the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string state;
  rest >> state >> out->ppid;
  std::string skip;
  for (int field = 5; field < 22; ++field) rest >> skip;  // fields 5..21
  rest >> out->start_time;                                 // field 22
  return !rest.fail();
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return absl::StrCat("killed by signal ", sig, name ? absl::StrCat(" (SIG", name, ")") : "");
  }
  return absl::StrCat("wait status ", status);
}

class LocalWorkerGroup : public WorkerGroup {
 public:
  LocalWorkerGroup(pid_t pid, std::string log_path, std::string style)
      : pid_(pid), log_path_(std::move(log_path)), style_(std::move(style)) {
    Remember();
  }
  ~LocalWorkerGroup() override {
    if (!exit_) {
      // Never leave workers behind: the manager normally stops the group before dropping it.
      Kill();
      int status;
      ::waitpid(pid_, &status, 0);
    }
  }

  std::optional<std::string> Poll() override {
    if (exit_) return exit_;
    Remember();
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_ = DescribeWaitStatus(status);
    } else if (r < 0 && errno == ECHILD) {
      exit_ = "exited (status collected elsewhere)";
    }
    if (exit_) {
      // Ranks that outlived mpirun (they should not): stop them too.
      SignalKnown(SIGKILL);
    }
    return exit_;
  }

  void Terminate() override { Signal(SIGTERM); }
  void Kill() override { Signal(SIGKILL); }

  std::string LogTail(int max_lines) override { return TailOfFile(log_path_, max_lines); }
  std::string Describe() const override {
    return absl::StrCat(style_, " pid ", pid_, " (log ", log_path_, ")");
  }

 private:
  // Records every current descendant, so they can be signalled even after mpirun is gone.
  void Remember() {
    for (int pid : DescendantPids(pid_)) {
      ProcStat st;
      if (ReadProcStat(pid, &st)) known_.emplace(pid, st.start_time);
    }
  }
  void SignalKnown(int sig) {
    for (const auto& [pid, start] : known_) {
      ProcStat st;
      // Only the same process (not a recycled pid).
      if (ReadProcStat(pid, &st) && st.start_time == start) ::kill(pid, sig);
    }
  }
  void Signal(int sig) {
    if (!exit_) {
      Remember();
      ::kill(-pid_, sig);  // the process group mpirun leads
      ::kill(pid_, sig);
    }
    SignalKnown(sig);
  }

  pid_t pid_;
  std::string log_path_;
  std::string style_;
  std::optional<std::string> exit_;
  std::map<int, unsigned long long> known_;  // descendant pid -> start time
};

class LocalMpiLauncher : public Launcher {
 public:
  explicit LocalMpiLauncher(LocalMpiLauncherOptions options) : options_(std::move(options)) {}

  StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec& spec) override {
    QCAL_RETURN_IF_ERROR(CheckWorkerBinary(options_.worker_binary));
    const std::vector<std::string> args = LocalMpiCommand(options_, spec);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);

    std::vector<std::string> env_storage;
    for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
    if (::geteuid() == 0) {
      for (const char* name : {"OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"}) {
        if (std::getenv(name) == nullptr) env_storage.push_back(absl::StrCat(name, "=1"));
      }
    }
    std::vector<char*> envp;
    for (std::string& e : env_storage) envp.push_back(e.data());
    envp.push_back(nullptr);

    QCAL_ASSIGN_OR_RETURN(const int log_fd,
                          OpenNoFollow(spec.log_path, O_WRONLY | O_CREAT | O_APPEND, 0644,
                                       "cannot open the workers' log"));
    {
      const std::string header = absl::StrCat("==== ", spec.job_id, ": ", Join(args), "\n");
      (void)!::write(log_fd, header.data(), header.size());
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
    posix_spawn_file_actions_adddup2(&fa, log_fd, 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    for (int sig : {SIGPIPE, SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaddset(&defaults, sig);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                        POSIX_SPAWN_SETSIGDEF);
    pid_t pid = 0;
    const int rc = ::posix_spawnp(&pid, args[0].c_str(), &fa, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(log_fd);
    if (rc != 0) {
      return absl::FailedPreconditionError(absl::StrCat("cannot run '", args[0], "': ",
                                                        std::strerror(rc)));
    }
    QCAL_LOG_INFO("job {}: started {} ranks: {} pid {}, log {}", spec.job_id, spec.workers,
                  options_.style, pid, spec.log_path);
    if (!spec.pid_file.empty()) {
      ProcStat st;
      const unsigned long long start = ReadProcStat(pid, &st) ? st.start_time : 0;
      if (Status s = WriteFileAtomic(spec.pid_file, absl::StrCat(pid, " ", start, "\n"));
          !s.ok()) {
        QCAL_LOG_WARN("job {}: {}", spec.job_id, std::string(s.message()));
      }
    }
    return std::unique_ptr<WorkerGroup>(
        new LocalWorkerGroup(pid, spec.log_path, options_.style));
  }

  Status StopLeftovers(const LaunchSpec& spec) override {
    if (spec.pid_file.empty()) return absl::OkStatus();
    StatusOr<std::string> text = ReadFile(spec.pid_file);
    if (!text.ok()) return absl::OkStatus();  // never launched
    long long pid = 0;
    unsigned long long start = 0;
    if (std::sscanf(text->c_str(), "%lld %llu", &pid, &start) != 2 || pid <= 1) {
      return absl::DataLossError(absl::StrCat(spec.pid_file, ": not 'PID START_TIME'"));
    }
    ProcStat st;
    if (!ReadProcStat(static_cast<int>(pid), &st)) {
      // The launcher is gone; its ranks (its process group, which keeps the id while any member
      // lives, so the id cannot have been reused) may have outlived it.
      ::kill(-static_cast<pid_t>(pid), SIGKILL);
      return absl::OkStatus();
    }
    if (st.start_time != start) return absl::OkStatus();  // the pid now names another process
    QCAL_LOG_WARN("job {}: stopping the worker group an earlier coordinator left running "
                  "(pid {})", spec.job_id, pid);
    const std::vector<int> descendants = DescendantPids(static_cast<int>(pid));
    ::kill(-static_cast<pid_t>(pid), SIGKILL);
    ::kill(static_cast<pid_t>(pid), SIGKILL);
    for (int d : descendants) ::kill(d, SIGKILL);
    return absl::OkStatus();
  }

 private:
  static std::string Join(const std::vector<std::string>& args) {
    std::string s;
    for (const std::string& a : args) absl::StrAppend(&s, s.empty() ? "" : " ", a);
    return s;
  }
  LocalMpiLauncherOptions options_;
};

}  // namespace

std::vector<std::string> LocalMpiCommand(const LocalMpiLauncherOptions& o, const LaunchSpec& s) {
  std::vector<std::string> args;
  if (o.style == "srun") {
    // --kill-on-bad-exit: a rank that dies ends the step (and so the group), like mpirun does.
    args = {o.srun, "--mpi=pmix", "--ntasks", std::to_string(s.workers), "--kill-on-bad-exit=1",
            "--job-name", "qcal-workers-" + s.job_id};
  } else {
    args = {o.mpirun, "--oversubscribe", "-np", std::to_string(s.workers)};
  }
  args.insert(args.end(), o.extra_mpirun_args.begin(), o.extra_mpirun_args.end());
  const std::vector<std::string> worker = WorkerCommand(o.worker_binary, s);
  args.insert(args.end(), worker.begin(), worker.end());
  return args;
}

Status CheckWorkerBinary(const std::string& path) {
  if (::access(path.c_str(), X_OK) == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "worker binary '", path, "' is missing or not executable (", std::strerror(errno),
      "); build the qcal-worker target or pass --worker-binary"));
}

std::vector<std::string> WorkerCommand(const std::string& worker_binary, const LaunchSpec& s) {
  std::vector<std::string> args = {worker_binary, "--coordinator", s.coordinator_address,
                                   "--job", s.job_id, "--auth-token-file", s.auth_token_file};
  if (!s.tls_ca_file.empty()) args.insert(args.end(), {"--tls-ca", s.tls_ca_file});
  if (!s.tls_cert_file.empty()) {
    args.insert(args.end(), {"--tls-cert", s.tls_cert_file, "--tls-key", s.tls_key_file});
  }
  if (s.threads_per_worker > 0) {
    args.insert(args.end(), {"--threads", std::to_string(s.threads_per_worker)});
  }
  if (!s.device.empty()) args.insert(args.end(), {"--device", s.device});
  return args;
}

std::unique_ptr<Launcher> MakeLocalMpiLauncher(LocalMpiLauncherOptions options) {
  return std::make_unique<LocalMpiLauncher>(std::move(options));
}

std::vector<int> DescendantPids(int root) {
  std::multimap<int, int> children;  // ppid -> pid
  if (DIR* d = ::opendir("/proc")) {
    while (struct dirent* e = ::readdir(d)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0') continue;
      ProcStat st;
      if (ReadProcStat(static_cast<int>(pid), &st)) children.emplace(st.ppid, pid);
    }
    ::closedir(d);
  }
  std::vector<int> out;
  std::vector<int> frontier = {root};
  std::set<int> seen = {root};
  while (!frontier.empty()) {
    std::vector<int> next;
    for (int p : frontier) {
      auto [lo, hi] = children.equal_range(p);
      for (auto it = lo; it != hi; ++it) {
        if (seen.insert(it->second).second) {
          out.push_back(it->second);
          next.push_back(it->second);
        }
      }
    }
    frontier = std::move(next);
  }
  return out;
}

std::string TailOfFile(const std::string& path, int max_lines) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  const std::streamoff start = size > 16384 ? size - 16384 : 0;
  f.seekg(start);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!text.empty() && text.back() == '\n') text.pop_back();
  size_t pos = text.size();
  for (int n = 0; n < max_lines && pos != std::string::npos && pos > 0; ++n) {
    pos = text.rfind('\n', pos - 1);
  }
  return pos == std::string::npos ? text : text.substr(pos + 1);
}

}  // namespace qcal::coordinator
