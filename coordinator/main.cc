// qcal-coordinator: the job service (gRPC control plane). No LibTorch.
//
//   qcal-coordinator --listen 127.0.0.1:50051 --state /var/lib/qcal --auth-token-file token
//
// SIGINT / SIGTERM: the workers are stopped, the server drains and the process exits 0;
// unfinished jobs stay QUEUED/RUNNING in STATE and resume from their journals when a
// coordinator starts again on it (also after a crash: see JobManager).
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/cli.h"
#include "common/io_util.h"
#include "common/log.h"
#include "rpc/auth.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_store.h"
#include "coordinator/launcher.h"
#include "coordinator/service.h"
#include "coordinator/state_fs.h"

namespace {

// qcal-worker beside this executable, in the build tree's worker/ folder, or on PATH.
std::string FindWorkerBinary() { return qcal::io::FindProgram("qcal-worker", "worker"); }

// The address workers dial: the listening host (or this host's name for a wildcard) and the
// bound port.
std::string AdvertisedAddress(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
    char name[256] = {0};
    host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qcal::coordinator;
  using namespace qcal::rpc;  // NOLINT
  using qcal::Fail;
  qcal::SetProgramName("qcal-coordinator");
  CLI::App app{"qcal-coordinator: the qcal job service (gRPC)"};
  ServerOptions server_options;
  ManagerOptions manager_options;
  LocalMpiLauncherOptions launcher_options;
  std::string state_dir, token_file, advertise, address_file, log_level = "info", log_file;
  server_options.listen = "127.0.0.1:50051";
  app.add_option("--listen", server_options.listen, "host:port to serve on (port 0: any free)")
      ->capture_default_str();
  app.add_option("--state", state_dir, "state directory (job records, log)")
      ->transform(qcal::CanonicalFlagPath)->required();
  app.add_option("--max-threads", server_options.max_threads,
                 "threads serving calls (each worker rank holds about 2; a call beyond the cap is "
                 "refused with RESOURCE_EXHAUSTED)")
      ->capture_default_str()
      ->check(CLI::Range(8, 65536));
  app.add_flag("--reflection", server_options.reflection,
               "serve gRPC server reflection (grpcurl list/describe; needs no token)");
  std::string tokens_file;
  auto* single = app.add_option("--auth-token-file", token_file,
                                "one bearer token, for one admin user (see --tokens-file)")
                     ->check(CLI::ExistingFile);
  auto* table = app.add_option("--tokens-file", tokens_file,
                               "users: each token's name, role and the directories it may read "
                               "and write (docs/service.md, Security)")
                    ->check(CLI::ExistingFile);
  single->excludes(table);
  app.add_option("--tls-cert", server_options.tls_cert_file, "serve TLS with this certificate")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", server_options.tls_key_file, "private key of --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", server_options.tls_client_ca_file,
                 "require client certificates signed by this CA (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--worker-tls-ca", manager_options.worker_tls_ca,
                 "CA the workers verify the coordinator with (default: --tls-cert)")
      ->check(CLI::ExistingFile);
  app.add_option("--worker-tls-cert", manager_options.worker_tls_cert,
                 "client certificate the workers present (needed with --tls-client-ca)")
      ->check(CLI::ExistingFile);
  app.add_option("--worker-tls-key", manager_options.worker_tls_key,
                 "private key of --worker-tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--advertise", advertise,
                 "address the workers dial (default: the listening host and port)");
  app.add_option("--address-file", address_file,
                 "write the bound host:port here once serving (for scripts and `qcal run`)");
  app.add_option("--worker-binary", launcher_options.worker_binary,
                 "qcal-worker executable (default: beside this program or in ../worker)");
  app.add_option("--mpirun", launcher_options.mpirun, "mpirun to launch workers with")
      ->capture_default_str();
  app.add_option("--launcher", launcher_options.style,
                 "how worker groups start: mpirun (this machine), srun (a job step in the "
                 "Slurm allocation this coordinator runs in; see slurm/), or slurm (each group "
                 "its own Slurm job, submitted with sbatch; --slurm-* options)")
      ->capture_default_str()
      ->check(CLI::IsMember({"mpirun", "srun", "slurm"}));
  SlurmLauncherOptions slurm_options;
  app.add_option("--slurm-partition", slurm_options.partition, "--launcher slurm: partition");
  app.add_option("--slurm-account", slurm_options.account, "--launcher slurm: account");
  app.add_option("--slurm-qos", slurm_options.qos, "--launcher slurm: quality of service");
  app.add_option("--slurm-time", slurm_options.time, "--launcher slurm: time limit per group");
  app.add_option("--slurm-ranks-per-node", slurm_options.ranks_per_node,
                 "--launcher slurm: ranks per node (0: Slurm places them; 8 on 8-GPU nodes)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--slurm-gpus-per-rank", slurm_options.gpus_per_rank,
                 "--launcher slurm: GPUs per rank (--gpus-per-task)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--slurm-cpus-per-rank", slurm_options.cpus_per_rank,
                 "--launcher slurm: CPUs per rank (--cpus-per-task)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--slurm-arg", slurm_options.extra_sbatch_args,
                 "--launcher slurm: one more sbatch argument (repeatable), e.g. --slurm-arg=--exclusive");
  app.add_option("--slurm-poll", slurm_options.poll_interval_s,
                 "--launcher slurm: seconds between scontrol polls of a group")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--srun", launcher_options.srun, "srun for --launcher srun")->capture_default_str();
  std::string advertise_host;
  app.add_option("--advertise-host", advertise_host,
                 "host name or address the workers dial, with the bound port (default: the "
                 "listening host, or this host's name for a wildcard)");
  app.add_option("--max-group-restarts", manager_options.max_group_restarts,
                 "relaunches of a job's worker group that died (a rank killed, mpirun or srun "
                 "gone, a node lost) before the job fails")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--heartbeat-timeout", manager_options.heartbeat_timeout_s,
                 "seconds of silence after which a worker is dead")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kill-grace", manager_options.kill_grace_s,
                 "seconds the workers of an ended job get before SIGTERM (and again before "
                 "SIGKILL)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  bool exit_with_parent = false;
  app.add_flag("--exit-with-parent", exit_with_parent,
               "shut down (as on SIGTERM) when the process that started this one dies: for a "
               "private coordinator such as `qcal run`'s");
  app.add_option("--log-level", log_level, "debug, info, warn, error, off")->capture_default_str();
  app.add_option("--log-file", log_file, "log file (default: STATE/coordinator.log)");
  CLI11_PARSE(app, argc, argv);

  qcal::SetLogLevel(qcal::ParseLogLevel(log_level));
  if (auto s = qcal::MakeDirs(state_dir); !s.ok()) return Fail(std::string(s.message()));
  qcal::SetLogFile(log_file.empty() ? state_dir + "/coordinator.log" : log_file);

  // One coordinator per state directory.
  const std::string lock_path = state_dir + "/coordinator.lock";
  qcal::StatusOr<int> opened =
      qcal::OpenNoFollow(lock_path, O_RDWR | O_CREAT, 0644, "open the lock");
  if (!opened.ok()) return Fail(opened.status());
  const int lock_fd = *opened;
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return Fail(absl::StrCat(lock_path, ": another coordinator is using this state directory"));
  }

  if (tokens_file.empty() && token_file.empty()) {
    return Fail("give --tokens-file (users, roles and directories) or --auth-token-file");
  }
  if (!tokens_file.empty()) {
    auto tokens = qcal::coordinator::TokenTable::Load(tokens_file);
    if (!tokens.ok()) return Fail(tokens.status());
    server_options.tokens = std::move(*tokens);
    QCAL_LOG_INFO("{}: {} user(s)", tokens_file, server_options.tokens.size());
  } else {
    auto token = ReadTokenFile(token_file);
    if (!token.ok()) return Fail(std::string(token.status().message()));
    server_options.token = *token;
    QCAL_LOG_WARN("{}: one token for one admin user: whoever holds it may submit, see and cancel "
                  "every job and have this coordinator (uid {}) read and write any path it can; "
                  "give each person their own token and directories with --tokens-file",
                  token_file, ::geteuid());
  }
  // Each job's workers get a credential of their own, written here (never a client token).
  manager_options.credentials_dir = state_dir + "/credentials";
  manager_options.state_dir = state_dir;
  if (manager_options.worker_tls_ca.empty()) {
    manager_options.worker_tls_ca = server_options.tls_cert_file;
  }
  // Refuse TLS settings under which no worker could connect, rather than failing every job.
  if (manager_options.worker_tls_cert.empty() != manager_options.worker_tls_key.empty()) {
    return Fail("--worker-tls-cert and --worker-tls-key go together");
  }
  if (!manager_options.worker_tls_cert.empty() && server_options.tls_cert_file.empty()) {
    return Fail("--worker-tls-cert needs a TLS coordinator (--tls-cert, --tls-key)");
  }
  if (!server_options.tls_client_ca_file.empty() && manager_options.worker_tls_cert.empty()) {
    return Fail("--tls-client-ca requires --worker-tls-cert and --worker-tls-key: every client, "
                "the workers included, must present a certificate signed by that CA");
  }
  if (launcher_options.worker_binary.empty()) launcher_options.worker_binary = FindWorkerBinary();
  if (::access(launcher_options.worker_binary.c_str(), X_OK) != 0) {
    QCAL_LOG_WARN("worker binary {} is not executable: jobs will fail until it is built",
                  launcher_options.worker_binary);
  }

  // A private key others can read is no longer private: say so (the operator decides).
  for (const std::string* key : {&server_options.tls_key_file, &manager_options.worker_tls_key}) {
    struct stat st;
    if (!key->empty() && ::stat(key->c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
      QCAL_LOG_WARN("{}: the private key is readable by group or others (mode {:o}); "
                    "chmod 600 it", *key, st.st_mode & 0777);
    }
  }

  // Signals are taken by sigwait below; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  if (exit_with_parent) {
    // The parent's death delivers SIGTERM, taken by the sigwait below like an operator's; a
    // parent that died before this line is noticed by getppid() (re-parented to init/subreaper).
    const pid_t parent = ::getppid();
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (parent == 1 || ::kill(parent, 0) != 0) {
      return Fail("--exit-with-parent: the parent process is already gone");
    }
  }
  ::signal(SIGPIPE, SIG_IGN);

  auto state_fs = MakeLocalStateFs();
  auto store = JobStore::Open(state_fs.get(), state_dir);
  if (!store.ok()) return Fail(std::string(store.status().message()));
  std::unique_ptr<Launcher> launcher;
  if (launcher_options.style == "slurm") {
    slurm_options.worker_binary = launcher_options.worker_binary;
    launcher = MakeSlurmLauncher(slurm_options);
  } else {
    launcher = MakeLocalMpiLauncher(launcher_options);
  }
  JobManager manager(manager_options, SystemClock(), launcher.get(),
                     [] { return MakeDiskWorkspace(); }, std::move(*store));
  if (auto s = manager.Start(); !s.ok()) return Fail(std::string(s.message()));
  auto server = CoordinatorServer::Start(server_options, &manager);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  const int port = (*server)->port();
  const std::string worker_address =
      !advertise.empty()        ? advertise
      : !advertise_host.empty() ? absl::StrCat(advertise_host, ":", port)
                                : AdvertisedAddress(server_options.listen, port);
  manager.SetWorkerAddress(worker_address);
  const std::string bound =
      absl::StrCat(server_options.listen.substr(0, server_options.listen.rfind(':')), ":", port);
  if (!address_file.empty()) {
    if (auto s = qcal::WriteFileAtomic(address_file, bound + "\n"); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  }
  QCAL_LOG_INFO("qcal-coordinator listening on {} ({}), workers dial {}, worker binary {}",
                bound, server_options.tls_cert_file.empty() ? "plaintext" : "TLS",
                worker_address, launcher_options.worker_binary);

  int sig = 0;
  sigwait(&signals, &sig);
  QCAL_LOG_INFO("signal {}: shutting down", sig);
  manager.Shutdown();
  (*server)->Shutdown();
  (*server)->Wait();
  return 0;
}
