// The JobManager owns every job of the coordinator: their records (JobStore), their events,
// the per-job schedulers, the worker registry and the worker groups (Launcher). The gRPC layer
// (service.h) is a thin shell over it; tests drive it directly with fakes.
//
// Job life:
//   SubmitJob validates the spec (InvalidArgument with a precise message otherwise), stores the
//   job QUEUED and starts its driver thread, which plans it (JobWorkspace::Open, MakeTaskPlan),
//   launches the workers (state RUNNING), waits until the scheduler reports every task done,
//   finalizes the checkpoint and marks the job SUCCEEDED. Any error along the way marks only
//   that job FAILED with the message; the coordinator keeps serving the others.
//   CancelJob marks the job CANCELLED at once: Heartbeat/ReportProgress answer cancelled=true,
//   NextTask answers SHUTDOWN, and a worker group still running `kill_grace_s` after the job
//   ended gets SIGTERM, then SIGKILL after as long again.
//   A worker silent for heartbeat_timeout_s is dead: its task returns to the queue (during the
//   collective calibration, which cannot go on without it, the whole group is replaced).
//
// Recovery: when a job's worker group dies before the job ended (a rank killed takes the MPI
//   world with it; mpirun or srun died; a node was lost), the manager relaunches it, up to
//   max_group_restarts times (a WARNING event each time): held tasks return to the queue as new
//   attempts, an unfinished calibration starts over (the workers reuse its complete cached
//   products), finished blocks are never redone (the journal). After that the job fails with
//   the tail of JOB/workers.log. A coordinator started on a state directory whose jobs were
//   QUEUED or RUNNING resumes them from their journals (stopping any workers the previous
//   coordinator left behind first, Launcher::StopLeftovers); Shutdown leaves them resumable.
//
// Thread-safety: every public method is thread-safe (one mutex). Watch blocks the calling thread
// until events arrive; it wakes on a per-job condition variable, and returns when the job ended,
// the caller's `cancelled()` turns true, or the manager shuts down.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"
#include "coordinator/clock.h"
#include "coordinator/identity.h"
#include "coordinator/job_store.h"
#include "coordinator/launcher.h"
#include "coordinator/worker_pool.h"
#include "proto/qcal.pb.h"
#include "rpc/job_state.h"
#include "runner/job_run.h"
#include "runner/scheduler.h"
#include "runner/workspace.h"

namespace qcal::coordinator {

// The job runner's torch-free parts (runner/): the task scheduler and the job directory.
using job::JobRun;
using job::JobScheduler;
using job::JobWorkspace;
using job::MakeDiskWorkspace;
using job::WorkspaceFactory;
using job::JobDirOf;

struct ManagerOptions {
  // Where each job's worker credential is written for its workers (STATE/credentials, 0700;
  // <job>.token, 0600). Empty (tests with fake launchers): the credential lives in memory only
  // and the workers are handed auth_token_file.
  std::string credentials_dir;
  std::string state_dir;              // no job's out_dir or job_dir may overlap it
  std::string auth_token_file;        // see credentials_dir
  std::string worker_tls_ca;          // handed to the workers (--tls-ca); empty: plaintext
  std::string worker_tls_cert;        // handed to the workers (--tls-cert/--tls-key) for a
  std::string worker_tls_key;         //   coordinator that requires client certificates
  double heartbeat_timeout_s = 10;    // silence after which a worker is dead
  int64_t heartbeat_interval_ms = 1000;  // told to workers at registration
  double kill_grace_s = 5;            // see the class comment
  int max_attempts = 3;               // hand-outs of one block before the job fails
  int max_group_restarts = 3;         // relaunches of a job's dead worker group before it fails
  int64_t wait_ms = 200;              // WAIT tasks: ask again after this long
  double tick_s = 0.2;                // monitor period; 0: no monitor thread (tests call Tick)
  size_t max_events_per_job = 20000;  // older events are dropped from memory
};

using rpc::IsFinalState;  // SUCCEEDED, FAILED or CANCELLED
using rpc::JobStateName;  // "QUEUED", "RUNNING", ...

class JobManager {
 public:
  // `clock` and `launcher` must outlive the manager.
  JobManager(ManagerOptions options, const Clock* clock, Launcher* launcher,
             WorkspaceFactory workspaces, std::unique_ptr<JobStore> store);
  ~JobManager();  // Shutdown()
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  // Jobs a previous coordinator left QUEUED or RUNNING resume from their journals (a WARNING
  // event says so; their launch waits for SetWorkerAddress). Starts the monitor thread.
  Status Start();
  // The address workers dial (known once the server listens).
  void SetWorkerAddress(const std::string& address);
  // Wakes every Watch (Unavailable), joins the threads, stops every worker group. Unfinished
  // jobs stay QUEUED/RUNNING in the store: a coordinator started again on the same state
  // directory resumes them. Idempotent.
  void Shutdown();

  // --- JobService, on behalf of `who` (identity.h): a job records its submitter as owner; a
  // user sees and acts on its own jobs only (another's is "unknown", like a missing one), an
  // admin on all. Submit also checks the spec's paths against the user's roots. The overloads
  // without a principal act as the local admin (tests, `qcal run`'s private coordinator).
  StatusOr<std::string> Submit(v1::JobSpec spec, const Principal& who);
  StatusOr<v1::Job> Get(const std::string& job_id, const Principal& who);
  std::vector<v1::Job> List(const Principal& who);
  StatusOr<v1::Job> Cancel(const std::string& job_id, const Principal& who);
  // Calls `send` for every event with seq > after_seq, in order, as they happen, until the job
  // ends (OK), `send` returns false or `cancelled()` returns true (Cancelled), or the manager
  // shuts down (Unavailable). `send` runs without the lock held.
  Status Watch(const std::string& job_id, const Principal& who, int64_t after_seq,
               const std::function<bool(const v1::JobEvent&)>& send,
               const std::function<bool()>& cancelled);
  StatusOr<std::string> Submit(v1::JobSpec spec) { return Submit(std::move(spec), LocalAdmin()); }
  StatusOr<v1::Job> Get(const std::string& job_id) { return Get(job_id, LocalAdmin()); }
  std::vector<v1::Job> List() { return List(LocalAdmin()); }
  StatusOr<v1::Job> Cancel(const std::string& job_id) { return Cancel(job_id, LocalAdmin()); }
  Status Watch(const std::string& job_id, int64_t after_seq,
               const std::function<bool(const v1::JobEvent&)>& send,
               const std::function<bool()>& cancelled) {
    return Watch(job_id, LocalAdmin(), after_seq, send, cancelled);
  }
  static const Principal& LocalAdmin();

  // --- Worker credentials: the job whose workers hold `token` (constant-time comparison with
  // every running job's), nullopt for any other token; PermissionDenied when the worker is not
  // one of `job_id`'s.
  std::optional<std::string> WorkerCredentialJob(const std::string& token);
  Status CheckWorkerOfJob(const std::string& worker_id, const std::string& job_id);
  // Test hook: the credential the job's workers were given ("" before its launch).
  std::string WorkerCredentialOf(const std::string& job_id);

  // --- WorkerService
  StatusOr<v1::RegisterWorkerResponse> RegisterWorker(const v1::RegisterWorkerRequest& request);
  StatusOr<v1::Task> NextTask(const std::string& worker_id);
  StatusOr<bool> ReportProgress(const v1::ReportProgressRequest& request);  // cancelled
  Status CompleteTask(const v1::CompleteTaskRequest& request);
  Status FailTask(const v1::FailTaskRequest& request);
  StatusOr<bool> Heartbeat(const std::string& worker_id);                    // cancelled

  // One monitor step: expire silent workers, poll worker groups, stop the groups of ended jobs.
  void Tick();

  // Test hooks.
  void WaitForDrivers();  // joins the driver threads of every job that reached a final state
  std::vector<WorkerInfo> WorkersOf(const std::string& job_id);

 private:
  struct JobRuntime {
    v1::Job job;
    std::deque<v1::JobEvent> events;
    int64_t next_seq = 1;
    std::condition_variable cv;  // new event, or the scheduler finished
    Recipe recipe;
    std::unique_ptr<JobWorkspace> workspace;
    std::unique_ptr<JobRun> run;  // the scheduler and the finished blocks (runner/job_run.h)
    std::unique_ptr<WorkerGroup> group;
    LaunchSpec launch;             // how the group was launched (relaunches reuse it)
    int group_restarts = 0;        // relaunches so far
    std::thread driver;
    double ended_at = -1;          // monotonic, when the job reached a final state
    int stop_stage = 0;            // 1: SIGTERM sent to the group, 2: SIGKILL sent
    double phase_started_at = 0;   // monotonic
    double quantize_started_at = -1;
    int64_t blocks_done_this_run = 0;
    std::string inputs_key;                        // the plan's (handed to registering workers)
    std::string worker_token;                      // the job's worker credential (at launch)
    std::vector<v1::EvalParams> evals;             // the evaluation phase's tasks
    std::vector<v1::EvalResult> eval_results;      // by task index (params unset: not done)
    // Work (kind:index) whose result an attempt is committing or has committed: one attempt
    // commits each block (CompleteTask).
    std::set<std::string> committing;
    // Held (never with mu_ held after it: lock order mu_, then files_mu) while a result's staged
    // files are checked, committed and journaled, and while the workspace is closed.
    std::mutex files_mu;
  };
  using Lock = std::unique_lock<std::mutex>;

  void Drive(const std::shared_ptr<JobRuntime>& rt);
  void DriveUnsafe(const std::shared_ptr<JobRuntime>& rt);
  std::shared_ptr<JobRuntime> FindLocked(const std::string& job_id);
  // FindLocked, for `who`: another user's job is NotFound, as a missing one.
  StatusOr<std::shared_ptr<JobRuntime>> FindForLocked(const std::string& job_id,
                                                      const Principal& who);
  // Makes the job's worker credential (and its file) for rt.launch.
  Status MakeWorkerCredentialLocked(JobRuntime& rt);
  // The worker (touched: counts as a heartbeat) and its job's runtime.
  StatusOr<std::pair<WorkerInfo, std::shared_ptr<JobRuntime>>> WorkerAndJobLocked(
      const std::string& worker_id);
  v1::JobEvent& EmitLocked(JobRuntime& rt, v1::JobEventKind kind, const std::string& message);
  void SaveLocked(JobRuntime& rt);
  void SetPhaseLocked(JobRuntime& rt, const std::string& phase);
  void SetStateLocked(JobRuntime& rt, v1::JobState state, const std::string& error);
  void FailLocked(JobRuntime& rt, const std::string& error);
  void ApplySchedulerErrorLocked(JobRuntime& rt);
  void WarnRequeuesLocked(JobRuntime& rt, const std::vector<JobScheduler::Requeue>& requeues,
                          const std::string& why);
  void UpdateEtaLocked(JobRuntime& rt);
  // A worker's result that does not fit its task, or whose staged files are not there: a failed
  // attempt (the work returns to the queue); InvalidArgument for the worker.
  Status RejectResultLocked(JobRuntime& rt, const WorkerInfo& w, const std::string& task_id,
                            const Status& why);
  // The scheduler and the job's record after an accepted result (its files committed and
  // journaled).
  Status RecordCompletionLocked(JobRuntime* rt, const WorkerInfo& w,
                                const v1::CompleteTaskRequest& request);
  v1::Task ShutdownTask(const JobRuntime& rt) const;
  // Stops what a previous group of the job left behind and launches rt.launch.
  Status LaunchGroupLocked(JobRuntime& rt);
  // The group died (`how`) before the job ended: relaunch it, or fail the job when the
  // relaunches are used up.
  void GroupDiedLocked(JobRuntime& rt, const std::string& how);

  const ManagerOptions options_;
  const Clock* clock_;
  Launcher* launcher_;
  WorkspaceFactory workspaces_;

  std::mutex mu_;
  std::unique_ptr<JobStore> store_;  // guarded by mu_
  WorkerPool workers_;          // guarded by mu_
  std::map<std::string, std::shared_ptr<JobRuntime>> jobs_;  // guarded by mu_
  std::string worker_address_;       // guarded by mu_
  bool started_ = false;             // guarded by mu_
  bool shutting_down_ = false;       // guarded by mu_
  std::condition_variable monitor_cv_;
  std::thread monitor_;
};

}  // namespace qcal::coordinator
