// Launchers start the worker processes of a job and control them as a group. The interface
// lets the JobManager be tested with a fake (tests/coordinator/fakes.h); LocalMpiLauncher runs
// `mpirun -np N qcal-worker ...` on this machine. (A Slurm launcher would submit an sbatch
// script with the same worker command line.)
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace qcal::coordinator {

struct LaunchSpec {
  std::string job_id;
  int workers = 1;                  // MPI ranks
  int threads_per_worker = 0;       // 0: the worker decides
  std::string coordinator_address;  // host:port the workers dial
  std::string auth_token_file;      // the workers read the bearer token from it
  std::string tls_ca_file;          // empty: plaintext
  std::string tls_cert_file;        // the workers' client certificate (mutual TLS); empty: none
  std::string tls_key_file;         // its private key
  std::string log_path;             // stdout + stderr of the whole group (JOB/workers.log)
};

// A running group of worker processes. Methods are called from one thread at a time.
class WorkerGroup {
 public:
  virtual ~WorkerGroup() = default;
  // Non-blocking. nullopt while the group runs; once it exited, a description of how
  // ("exit code 0", "killed by signal 9").
  virtual std::optional<std::string> Poll() = 0;
  // Asks the group to stop (SIGTERM to the launcher process and every process under it).
  virtual void Terminate() = 0;
  // Forces it (SIGKILL to the same processes).
  virtual void Kill() = 0;
  // The last `max_lines` lines of the group's log (for error messages).
  virtual std::string LogTail(int max_lines) = 0;
  // A one-line description for logs ("mpirun pid 1234").
  virtual std::string Describe() const = 0;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  // Errors (binary missing, fork failure) name what could not be started.
  virtual StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec& spec) = 0;
};

struct LocalMpiLauncherOptions {
  std::string mpirun = "mpirun";  // name (searched in PATH) or path
  std::string worker_binary;      // path of qcal-worker
  std::vector<std::string> extra_mpirun_args;  // e.g. {"--bind-to", "none"}
};

// `mpirun --oversubscribe -np N WORKER --coordinator ADDR --job ID --auth-token-file F
// [--tls-ca F] [--threads N]` in its own process group, output appended to spec.log_path.
// Running as root, it sets OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) for mpirun unless already set.
std::unique_ptr<Launcher> MakeLocalMpiLauncher(LocalMpiLauncherOptions options);

// The argument vector LocalMpiLauncher runs (exposed for tests and logs).
std::vector<std::string> LocalMpiCommand(const LocalMpiLauncherOptions& options,
                                         const LaunchSpec& spec);

// Every live descendant of `pid` (children first, then theirs), from /proc.
std::vector<int> DescendantPids(int pid);

// The last `max_lines` lines of a text file ("" when unreadable).
std::string TailOfFile(const std::string& path, int max_lines);

}  // namespace qcal::coordinator
