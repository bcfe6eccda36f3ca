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
  std::string device;               // --device of every worker; empty: the worker's default (auto)
  std::string coordinator_address;  // host:port the workers dial
  std::string auth_token_file;      // the workers read the bearer token from it
  std::string tls_ca_file;          // empty: plaintext
  std::string tls_cert_file;        // the workers' client certificate (mutual TLS); empty: none
  std::string tls_key_file;         // its private key
  std::string log_path;             // stdout + stderr of the whole group (JOB/workers.log)
  std::string pid_file;             // where the launcher records the group (JOB/workers.pid),
                                    // so a later coordinator can stop what it left behind
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
  // What happened to the group since the last call that users should see in `qcal watch`
  // (a Slurm job PENDING, RUNNING, PREEMPTED, ...): the manager emits each as an event.
  struct Note {
    bool warning = false;
    std::string message;
  };
  virtual std::vector<Note> TakeNotes() { return {}; }
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  // Errors (binary missing, fork failure) name what could not be started.
  virtual StatusOr<std::unique_ptr<WorkerGroup>> Launch(const LaunchSpec& spec) = 0;
  // Stops the processes an earlier Launch of the same job recorded in spec.pid_file that are
  // still alive (a coordinator that died leaves its groups behind). Only the recorded processes
  // (pid and start time must match), never a recycled pid.
  virtual Status StopLeftovers(const LaunchSpec& spec) { return absl::OkStatus(); }
};

struct LocalMpiLauncherOptions {
  std::string mpirun = "mpirun";  // name (searched in PATH) or path
  std::string worker_binary;      // path of qcal-worker
  std::vector<std::string> extra_mpirun_args;  // e.g. {"--bind-to", "none"}; for srun, srun's
  // "mpirun": mpirun on this machine. "srun": a job step inside the Slurm allocation this
  // coordinator runs in (the sbatch templates in slurm/): srun places the ranks on the
  // allocation's nodes and wires them with PMIx.
  std::string style = "mpirun";
  std::string srun = "srun";      // name or path, for style "srun"
};

// `mpirun --oversubscribe -np N WORKER --coordinator ADDR --job ID --auth-token-file F
// [--tls-ca F] [--threads N]`, or `srun --mpi=pmix --ntasks N --kill-on-bad-exit=1 WORKER ...`,
// in its own process group, output appended to spec.log_path, the launcher's pid and start time
// in spec.pid_file. Running as root, it sets OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) unless already
// set.
std::unique_ptr<Launcher> MakeLocalMpiLauncher(LocalMpiLauncherOptions options);

struct SlurmLauncherOptions {
  std::string worker_binary;     // on the shared filesystem: the compute nodes run it
  std::string sbatch = "sbatch", scontrol = "scontrol", scancel = "scancel";
  std::string partition, account, qos, time;  // empty: the cluster's defaults
  int ranks_per_node = 0;        // --ntasks-per-node (0: Slurm places the ranks)
  int gpus_per_rank = 0;         // --gpus-per-task
  int cpus_per_rank = 0;         // --cpus-per-task (0: the cluster's default)
  std::vector<std::string> extra_sbatch_args;
  double poll_interval_s = 2;    // scontrol show job at most this often
};

// Submits each group as its own Slurm job (the coordinator runs outside any allocation: a
// long-lived service on a login or service node): `sbatch --parsable --no-requeue` of
// JOB/workers.sbatch, a script that runs `srun --mpi=pmix --kill-on-bad-exit=1 WORKER ...`.
// The group follows the job with `scontrol show job` (state changes become Notes: PENDING with
// its reason, RUNNING on NODES, ...), ends when Slurm ends it (COMPLETED, FAILED, CANCELLED,
// TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, ...: the manager then relaunches or fails the
// job), Terminate is `scancel` (SIGTERM, SIGKILL after KillWait), Kill `scancel -s KILL`.
// --no-requeue: a preempted or failed worker job is replaced by the coordinator, which knows
// what is finished, rather than restarted by Slurm. spec.pid_file holds "slurm JOBID".
std::unique_ptr<Launcher> MakeSlurmLauncher(SlurmLauncherOptions options);

// The sbatch arguments and the batch script of a group (exposed for tests).
std::vector<std::string> SlurmSbatchArgs(const SlurmLauncherOptions& options,
                                         const LaunchSpec& spec, const std::string& script_path);
std::string SlurmWorkerScript(const SlurmLauncherOptions& options, const LaunchSpec& spec);

// Runs argv (no shell), returns its exit status and its stdout + stderr; an error when it could
// not be started or did not end within timeout_s (it is then killed).
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv, double timeout_s = 30);

// OK when `path` is executable; else FailedPrecondition naming it and how to get it.
Status CheckWorkerBinary(const std::string& path);

// `qcal-worker --coordinator ADDR --job ID --auth-token-file F [TLS flags] [--threads N]`.
std::vector<std::string> WorkerCommand(const std::string& worker_binary, const LaunchSpec& spec);

// The argument vector LocalMpiLauncher runs (exposed for tests and logs).
std::vector<std::string> LocalMpiCommand(const LocalMpiLauncherOptions& options,
                                         const LaunchSpec& spec);

// Every live descendant of `pid` (children first, then theirs), from /proc.
std::vector<int> DescendantPids(int pid);

// The last `max_lines` lines of a text file ("" when unreadable).
std::string TailOfFile(const std::string& path, int max_lines);

}  // namespace qcal::coordinator
