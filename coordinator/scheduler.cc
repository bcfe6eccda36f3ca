#include "coordinator/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace qcal::coordinator {
namespace {

constexpr char kCalibrateTaskId[] = "calibrate";

std::string Describe(v1::TaskKind kind, int64_t block) {
  if (kind == v1::TASK_KIND_QUANTIZE_BLOCK) return absl::StrCat("block ", block);
  if (kind == v1::TASK_KIND_FINETUNE_E2E) return "end-to-end fine-tuning";
  return "calibration";
}

}  // namespace

std::optional<int64_t> JobScheduler::BlockOfTaskId(const std::string& task_id) {
  static const std::string kPrefix = "block-";
  if (task_id.rfind(kPrefix, 0) != 0) return std::nullopt;
  const size_t dot = task_id.find(".a", kPrefix.size());
  if (dot == std::string::npos || dot == kPrefix.size() || dot - kPrefix.size() > 12) {
    return std::nullopt;
  }
  int64_t layer = 0;
  for (size_t i = kPrefix.size(); i < dot; ++i) {
    if (task_id[i] < '0' || task_id[i] > '9') return std::nullopt;
    layer = layer * 10 + (task_id[i] - '0');
  }
  return layer;
}

JobScheduler::JobScheduler(std::string job_id, int world_size, const TaskPlan& plan,
                           int max_attempts, int64_t wait_ms)
    : job_id_(std::move(job_id)),
      world_size_(world_size),
      max_attempts_(std::max(1, max_attempts)),
      wait_ms_(wait_ms),
      calibrate_(plan.calibrate),
      sequential_(plan.sequential_blocks),
      blocks_(plan.blocks),
      pending_(plan.blocks.begin(), plan.blocks.end()),
      e2e_(plan.finetune_e2e),
      e2e_pending_(plan.finetune_e2e) {
  if (calibrate_) {
    phase_ = kPhaseCalibrate;
  } else if (!blocks_.empty()) {
    phase_ = kPhaseQuantize;
  } else if (e2e_) {
    phase_ = kPhaseFinetune;
  } else {
    phase_ = kPhaseFinalize;
  }
}

std::string JobScheduler::BlockTaskId(int64_t block, int attempt) const {
  return absl::StrCat("block-", block, ".a", attempt);
}

v1::Task JobScheduler::MakeTask(v1::TaskKind kind, const std::string& task_id, int64_t block,
                                int attempt) {
  v1::Task t;
  t.set_task_id(task_id);
  t.set_kind(kind);
  t.set_job_id(job_id_);
  t.set_block(block);
  t.set_attempt(attempt);
  return t;
}

v1::Task JobScheduler::Wait() {
  v1::Task t;
  t.set_kind(v1::TASK_KIND_WAIT);
  t.set_job_id(job_id_);
  t.set_retry_after_ms(wait_ms_);
  return t;
}

void JobScheduler::SetError(const std::string& message) {
  if (error_.empty()) error_ = message;
}

void JobScheduler::AdvancePhase() {
  if (phase_ == kPhaseCalibrate) {
    phase_ = !blocks_.empty() ? kPhaseQuantize : (e2e_ ? kPhaseFinetune : kPhaseFinalize);
  } else if (phase_ == kPhaseQuantize) {
    phase_ = e2e_ ? kPhaseFinetune : kPhaseFinalize;
  } else if (phase_ == kPhaseFinetune) {
    phase_ = kPhaseFinalize;
  }
}

std::map<std::string, std::string> JobScheduler::running() const {
  std::map<std::string, std::string> out;
  for (const auto& [task_id, a] : assigned_) out[a.worker_id] = task_id;
  return out;
}

bool JobScheduler::RequeueAssignment(const std::string& task_id, const std::string& reason,
                                     Requeue* out) {
  auto it = assigned_.find(task_id);
  if (it == assigned_.end()) return true;
  const Assignment a = it->second;
  assigned_.erase(it);
  finished_ids_.insert(task_id);
  out->task_id = task_id;
  out->what = Describe(a.kind, a.block);
  out->next_attempt = a.attempt + 1;
  if (a.attempt >= max_attempts_) {
    SetError(absl::StrCat(out->what, " was attempted ", a.attempt, " times; last: ", reason));
    return false;
  }
  if (a.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    pending_.push_front(a.block);
  } else {
    e2e_pending_ = true;
  }
  return true;
}

v1::Task JobScheduler::Next(const std::string& worker_id, int rank) {
  if (!error_.empty()) {
    v1::Task t;
    t.set_kind(v1::TASK_KIND_SHUTDOWN);
    t.set_job_id(job_id_);
    t.set_reason(error_);
    return t;
  }
  // A worker asking again while it holds a task abandoned it (its previous attempt is void).
  std::vector<std::string> held;
  for (const auto& [task_id, a] : assigned_) {
    if (a.worker_id == worker_id) held.push_back(task_id);
  }
  for (const std::string& task_id : held) {
    Requeue r;
    RequeueAssignment(task_id, absl::StrCat("rank ", rank, " asked for a new task instead"), &r);
  }
  if (!error_.empty()) return Next(worker_id, rank);

  if (phase_ == kPhaseCalibrate) {
    if (calibrate_given_.count(rank) == 0) {
      calibrate_given_.insert(rank);
      return MakeTask(v1::TASK_KIND_CALIBRATE, kCalibrateTaskId, -1, 1);
    }
    if (calibrate_done_.count(rank) == 0) {
      SetError(absl::StrCat("rank ", rank,
                            " asked for a new task before completing the collective calibration"));
      return Next(worker_id, rank);
    }
    return Wait();
  }
  // Sequential blocks: the next one waits until none is held.
  bool block_in_flight = false;
  for (const auto& [task_id, a] : assigned_) {
    block_in_flight = block_in_flight || (sequential_ && a.kind == v1::TASK_KIND_QUANTIZE_BLOCK);
  }
  if (phase_ == kPhaseQuantize && !pending_.empty() && !block_in_flight) {
    const int64_t block = pending_.front();
    pending_.pop_front();
    const int attempt = ++attempts_[block];
    const std::string task_id = BlockTaskId(block, attempt);
    assigned_[task_id] = Assignment{v1::TASK_KIND_QUANTIZE_BLOCK, block, attempt, worker_id};
    return MakeTask(v1::TASK_KIND_QUANTIZE_BLOCK, task_id, block, attempt);
  }
  if (phase_ == kPhaseFinetune && e2e_pending_) {
    e2e_pending_ = false;
    const int attempt = ++e2e_attempts_;
    const std::string task_id = absl::StrCat("e2e.a", attempt);
    assigned_[task_id] = Assignment{v1::TASK_KIND_FINETUNE_E2E, -1, attempt, worker_id};
    return MakeTask(v1::TASK_KIND_FINETUNE_E2E, task_id, -1, attempt);
  }
  return Wait();
}

StatusOr<JobScheduler::Completion> JobScheduler::Complete(const std::string& worker_id, int rank,
                                                          const std::string& task_id) {
  Completion c;
  if (task_id == kCalibrateTaskId) {
    c.kind = v1::TASK_KIND_CALIBRATE;
    if (!calibrate_) {
      return absl::NotFoundError(absl::StrCat("job ", job_id_, " has no calibration task"));
    }
    if (calibrate_given_.count(rank) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, " completes calibration it was never given"));
    }
    if (!calibrate_done_.insert(rank).second) {
      c.duplicate = true;
      return c;
    }
    if (phase_ == kPhaseCalibrate && static_cast<int>(calibrate_done_.size()) == world_size_) {
      AdvancePhase();
      c.phase_finished = true;
    }
    return c;
  }

  // Block and e2e tasks: "block-<l>.a<n>" / "e2e.a<n>".
  v1::TaskKind kind;
  int64_t block = -1;
  auto held = assigned_.find(task_id);
  if (held != assigned_.end()) {
    kind = held->second.kind;
    block = held->second.block;
  } else if (finished_ids_.count(task_id) != 0) {
    // A superseded attempt (its rank was declared dead or abandoned it) that finished anyway.
    if (task_id.rfind("e2e.", 0) == 0) {
      kind = v1::TASK_KIND_FINETUNE_E2E;
    } else {
      kind = v1::TASK_KIND_QUANTIZE_BLOCK;
      block = BlockOfTaskId(task_id).value_or(-1);
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " never handed out task '", task_id, "'"));
  }
  c.kind = kind;
  c.block = block;
  const bool already = kind == v1::TASK_KIND_QUANTIZE_BLOCK ? blocks_done_.count(block) != 0
                                                            : e2e_done_;
  // Retire every attempt of the same work (other ranks may hold a requeued copy).
  for (auto it = assigned_.begin(); it != assigned_.end();) {
    if (it->second.kind == kind && it->second.block == block) {
      finished_ids_.insert(it->first);
      it = assigned_.erase(it);
    } else {
      ++it;
    }
  }
  finished_ids_.insert(task_id);
  if (already) {
    c.duplicate = true;
    return c;
  }
  if (kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    pending_.erase(std::remove(pending_.begin(), pending_.end(), block), pending_.end());
    blocks_done_.insert(block);
    if (phase_ == kPhaseQuantize && blocks_done_.size() == blocks_.size()) {
      AdvancePhase();
      c.phase_finished = true;
    }
  } else {
    e2e_pending_ = false;
    e2e_done_ = true;
    if (phase_ == kPhaseFinetune) {
      AdvancePhase();
      c.phase_finished = true;
    }
  }
  return c;
}

StatusOr<std::vector<JobScheduler::Requeue>> JobScheduler::Fail(const std::string& worker_id,
                                                                int rank,
                                                                const std::string& task_id,
                                                                const std::string& message,
                                                                bool retryable) {
  std::vector<Requeue> out;
  if (task_id == kCalibrateTaskId) {
    SetError(absl::StrCat("rank ", rank, " failed during calibration: ", message));
    return out;
  }
  auto it = assigned_.find(task_id);
  if (it == assigned_.end()) {
    if (finished_ids_.count(task_id) != 0) return out;  // a superseded attempt: ignore
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " never handed out task '", task_id, "'"));
  }
  const std::string what = Describe(it->second.kind, it->second.block);
  if (!retryable) {
    SetError(absl::StrCat(what, " failed on rank ", rank, ": ", message));
    assigned_.erase(it);
    finished_ids_.insert(task_id);
    return out;
  }
  Requeue r;
  if (RequeueAssignment(task_id, absl::StrCat("rank ", rank, ": ", message), &r)) {
    out.push_back(r);
  }
  return out;
}

std::vector<JobScheduler::Requeue> JobScheduler::WorkerLost(const std::string& worker_id,
                                                            int rank) {
  std::vector<Requeue> out;
  if (phase_ == kPhaseCalibrate && calibrate_done_.count(rank) == 0) {
    SetError(absl::StrCat(
        "rank ", rank, " (worker ", worker_id,
        ") was lost during calibration, a collective step every rank takes part in; "
        "resubmit the job to resume from its journal"));
    return out;
  }
  std::vector<std::string> held;
  for (const auto& [task_id, a] : assigned_) {
    if (a.worker_id == worker_id) held.push_back(task_id);
  }
  for (const std::string& task_id : held) {
    Requeue r;
    if (RequeueAssignment(task_id, absl::StrCat("rank ", rank, " (worker ", worker_id,
                                                ") was lost"),
                          &r)) {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace qcal::coordinator
