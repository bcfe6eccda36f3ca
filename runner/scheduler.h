// The scheduler of one job: which task a worker gets when it asks (NextTask), and what happens
// when a task completes, fails, or its worker dies. Pure logic, no clock and no I/O.
//
// Policy
//  * CALIBRATE is collective: every rank of the world receives the same task (with the plan's
//    CalibrateParams) and the phase ends when every rank completed it. Meanwhile ranks that are
//    done (or ask early) get WAIT. If a rank dies or fails during it, the job fails (the MPI
//    collective cannot go on without it; a resubmitted job resumes from the journal and the
//    cached calibration products).
//  * QUANTIZE_BLOCK tasks are pulled: whichever rank asks gets the next pending block (lowest
//    layer first; with TaskPlan::sequential_blocks only once no other block is in flight). Fast
//    ranks therefore take more blocks than slow ones; nothing is assigned to a rank in advance
//    (no round-robin). A dead rank's block, or a block that failed with `retryable`, returns to
//    the front of the queue with attempt + 1, for any rank; after `max_attempts` hand-outs the
//    job fails.
//  * A MoE block split over tasks (TaskPlan::block_groups) is a QUANTIZE_BLOCK task per expert
//    group (Task.part 1..), pulled like blocks by any rank, and its assembling part 0, handed out
//    only once every group of the block is done. A group is requeued, attempted and retired on
//    its own; the block counts as done when part 0 completes.
//  * FINETUNE_E2E is one task for one rank, after the last block (it carries the finished
//    blocks' results); requeued like a block.
//  * Then the job waits in phase finalize (workers get WAIT) until the manager has written the
//    checkpoint and calls FinalizeDone; EVALUATE tasks (one per model and file of the plan) are
//    pulled like blocks; then the job is done.
//  * Every task id the scheduler hands out is remembered with its work and attempt, so a result
//    names its block by the record, never by parsing the id. A task completed twice (a rank
//    declared dead that was only slow, and the rank that took over), or by a superseded attempt
//    after the work was done, is a duplicate: the manager ignores it and commits nothing (only
//    one attempt's files ever enter the output).
//
// Not thread-safe: the JobManager calls it under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "runner/task_plan.h"
#include "proto/qcal.pb.h"

namespace qcal::job {

class JobScheduler {
 public:
  JobScheduler(std::string job_id, int world_size, const TaskPlan& plan, int max_attempts = 3,
               int64_t wait_ms = 200);

  // kPhaseCalibrate, kPhaseQuantize, kPhaseFinetune, kPhaseFinalize (waiting for the manager),
  // kPhaseEvaluate, kPhaseDone.
  const std::string& phase() const { return phase_; }
  bool awaiting_finalize() const { return phase_ == kPhaseFinalize; }
  bool done() const { return phase_ == kPhaseDone; }
  // The manager wrote the checkpoint: on to evaluation, or done.
  void FinalizeDone();
  // Non-empty when the job must fail (collective broken, attempts exhausted, protocol error).
  const std::string& error() const { return error_; }

  // The next task for `worker_id` (of `rank`). A worker asking while it holds a task abandoned
  // it: that task is requeued first. Returns WAIT when nothing is ready and SHUTDOWN once the
  // job failed. The manager adds what the task needs (finished blocks) before sending it.
  v1::Task Next(const std::string& worker_id, int rank);

  // What a handed-out task id stands for; `done`: its work was completed (by this or another
  // attempt), so a result for it is a duplicate. NotFound for an id never handed out.
  struct TaskInfo {
    v1::TaskKind kind = v1::TASK_KIND_UNSPECIFIED;
    int64_t index = -1;  // block, or evaluation index
    int part = -1;       // QUANTIZE_BLOCK of a split block: its part (0 assembles); else -1
    int attempt = 0;
    bool done = false;
  };
  StatusOr<TaskInfo> Lookup(const std::string& task_id) const;

  struct Completion {
    v1::TaskKind kind = v1::TASK_KIND_UNSPECIFIED;
    int64_t block = -1;             // QUANTIZE_BLOCK
    int part = -1;                  // an expert group (>= 1) or the assembly (0) of a split block
    int64_t eval = -1;              // EVALUATE: index into TaskPlan::evals
    int attempt = 0;
    bool duplicate = false;         // already completed: ignore the result, commit nothing
    bool phase_finished = false;    // this completion ended the phase
  };
  // NotFound for a task id this job never handed out; FailedPrecondition when `rank` did not
  // receive the collective task it completes.
  StatusOr<Completion> Complete(const std::string& worker_id, int rank, const std::string& task_id);

  struct Requeue {
    std::string task_id;  // the task that returns to the queue
    std::string what;     // "block 3" / "end-to-end fine-tuning" / "evaluation 2"
    int next_attempt = 0;
  };
  // A task failed on the worker. Retryable failures requeue it (returned); otherwise, or when the
  // attempts are used up, error() is set.
  StatusOr<std::vector<Requeue>> Fail(const std::string& worker_id, int rank,
                                      const std::string& task_id, const std::string& message,
                                      bool retryable);

  // `worker_id` (of `rank`) is gone. Its task returns to the queue. During the collective
  // calibration nothing can go on without it: needs_new_group() turns true (the manager
  // replaces the whole worker group, or fails the job when it may not).
  std::vector<Requeue> WorkerLost(const std::string& worker_id, int rank);

  // The whole worker group is gone (a rank killed takes the MPI world with it; mpirun or srun
  // died; a node was lost) and a new one is being launched: every held task returns to the
  // queue (counting as an attempt, so a block that kills its group every time still ends the
  // job after max_attempts), and an unfinished calibration starts over for the new world (its
  // complete cached products are reused by the workers). Clears needs_new_group().
  std::vector<Requeue> GroupLost(const std::string& reason);
  bool needs_new_group() const { return needs_new_group_; }

  int64_t blocks_total() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t blocks_done() const { return static_cast<int64_t>(blocks_done_.size()); }
  // Blocks with a part (or the whole block) not handed out.
  int64_t blocks_pending() const;
  // Tasks currently held by workers, by worker id.
  std::map<std::string, std::string> running() const;
  int calibrate_ranks_done() const { return static_cast<int>(calibrate_done_.size()); }

 private:
  struct Assignment {
    v1::TaskKind kind;
    int64_t index = -1;  // block, or evaluation index
    int part = -1;       // a split block's part; -1: the whole block (or not a block)
    int attempt = 1;
    std::string worker_id;
  };
  // A QUANTIZE_BLOCK unit of work: a block, or one part of a split block.
  struct Unit {
    int64_t block = 0;
    int part = -1;
  };
  // Whether `u` may be handed out now: an assembly waits for its block's groups.
  bool Ready(const Unit& u) const;
  bool UnitDone(const Unit& u) const;
  std::string Describe(v1::TaskKind kind, int64_t index, int part) const;
  v1::Task MakeTask(const std::string& task_id, const Assignment& a);
  v1::Task Wait();
  void SetError(const std::string& message);
  void AdvancePhase();
  bool HasWork(const std::string& phase) const;
  // Moves `task_id` (held by a worker) back to the queue. Returns false when attempts are used.
  bool RequeueAssignment(const std::string& task_id, const std::string& reason, Requeue* out);
  std::string Hand(v1::TaskKind kind, int64_t index, int part, const std::string& worker_id);

  std::string job_id_;
  int world_size_;
  int max_attempts_;
  int64_t wait_ms_;
  std::string phase_;
  std::string error_;

  bool calibrate_ = false;
  v1::CalibrateParams calibrate_params_;
  bool sequential_ = false;  // one block task in flight at a time, in layer order
  std::set<int> calibrate_given_;  // ranks that received CALIBRATE
  std::set<int> calibrate_done_;
  bool needs_new_group_ = false;

  std::vector<int64_t> blocks_;          // all blocks this run quantizes
  std::map<int64_t, std::vector<ExpertGroup>> groups_;  // split blocks' expert groups
  std::deque<Unit> pending_;             // not handed out (or requeued)
  std::set<int64_t> blocks_done_;
  std::set<std::pair<int64_t, int>> parts_done_;  // (block, part >= 1) of split blocks

  bool e2e_ = false;
  bool e2e_pending_ = false;
  bool e2e_done_ = false;

  std::vector<v1::EvalParams> evals_;
  std::deque<int64_t> evals_pending_;
  std::set<int64_t> evals_done_;

  std::map<std::tuple<int, int64_t, int>, int> attempts_;  // hand-outs per (kind, index, part)
  std::map<std::string, Assignment> assigned_;  // task id -> current holder
  std::map<std::string, Assignment> handed_;    // every task id ever handed out
};

}  // namespace qcal::job
