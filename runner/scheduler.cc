#include "runner/scheduler.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace qcal::job {
namespace {

constexpr char kCalibrateTaskId[] = "calibrate";

std::string TaskIdPrefix(v1::TaskKind kind, int64_t index, int part) {
  if (kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    return part < 0 ? absl::StrCat("block-", index) : absl::StrCat("block-", index, ".p", part);
  }
  if (kind == v1::TASK_KIND_EVALUATE) return absl::StrCat("eval-", index);
  return "e2e";
}

}  // namespace

std::string JobScheduler::Describe(v1::TaskKind kind, int64_t index, int part) const {
  if (kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    auto g = groups_.find(index);
    if (part > 0 && g != groups_.end() && part <= static_cast<int>(g->second.size())) {
      const ExpertGroup& group = g->second[part - 1];
      return absl::StrCat("block ", index, " experts [", group.begin, ", ", group.end, ")");
    }
    if (part == 0) return absl::StrCat("block ", index, " (assembly of its expert groups)");
    return absl::StrCat("block ", index);
  }
  if (kind == v1::TASK_KIND_FINETUNE_E2E) return "end-to-end fine-tuning";
  if (kind == v1::TASK_KIND_EVALUATE) return absl::StrCat("evaluation ", index);
  return "calibration";
}

bool JobScheduler::UnitDone(const Unit& u) const {
  return u.part > 0 ? parts_done_.count({u.block, u.part}) != 0 : blocks_done_.count(u.block) != 0;
}

bool JobScheduler::Ready(const Unit& u) const {
  if (u.part != 0) return true;
  auto g = groups_.find(u.block);
  if (g == groups_.end()) return true;
  for (int part = 1; part <= static_cast<int>(g->second.size()); ++part) {
    if (parts_done_.count({u.block, part}) == 0) return false;
  }
  return true;
}

int64_t JobScheduler::blocks_pending() const {
  std::set<int64_t> blocks;
  for (const Unit& u : pending_) blocks.insert(u.block);
  return static_cast<int64_t>(blocks.size());
}

JobScheduler::JobScheduler(std::string job_id, int world_size, const TaskPlan& plan,
                           int max_attempts, int64_t wait_ms)
    : job_id_(std::move(job_id)),
      world_size_(world_size),
      max_attempts_(std::max(1, max_attempts)),
      wait_ms_(wait_ms),
      calibrate_(plan.calibrate),
      calibrate_params_(plan.calibrate_params),
      sequential_(plan.sequential_blocks),
      blocks_(plan.blocks),
      e2e_(plan.finetune_e2e),
      e2e_pending_(plan.finetune_e2e),
      evals_(plan.evals) {
  for (int64_t i = 0; i < static_cast<int64_t>(evals_.size()); ++i) evals_pending_.push_back(i);
  // A split block's groups first (those an earlier run finished count as done), then its
  // assembly; other blocks whole.
  for (int64_t block : blocks_) {
    auto g = plan.block_groups.find(block);
    if (g == plan.block_groups.end() || g->second.empty()) {
      pending_.push_back({block, -1});
      continue;
    }
    groups_[block] = g->second;
    auto done = plan.parts_done.find(block);
    for (int part = 1; part <= static_cast<int>(g->second.size()); ++part) {
      if (done != plan.parts_done.end() && done->second.count(part) != 0) {
        parts_done_.insert({block, part});
      } else {
        pending_.push_back({block, part});
      }
    }
    pending_.push_back({block, 0});
  }
  phase_ = kPhaseCalibrate;
  if (!calibrate_) AdvancePhase();
}

bool JobScheduler::HasWork(const std::string& phase) const {
  if (phase == kPhaseCalibrate) return calibrate_;
  if (phase == kPhaseQuantize) return !blocks_.empty();
  if (phase == kPhaseFinetune) return e2e_;
  if (phase == kPhaseEvaluate) return !evals_.empty();
  return true;  // finalize and done always happen
}

void JobScheduler::AdvancePhase() {
  // The worker phases in order; finalize waits for the manager (FinalizeDone).
  static const char* const kOrder[] = {kPhaseCalibrate, kPhaseQuantize, kPhaseFinetune,
                                       kPhaseFinalize};
  size_t i = 0;
  while (i < 4 && phase_ != kOrder[i]) ++i;
  for (++i; i < 4; ++i) {
    if (HasWork(kOrder[i])) {
      phase_ = kOrder[i];
      return;
    }
  }
}

void JobScheduler::FinalizeDone() {
  if (phase_ != kPhaseFinalize) return;
  phase_ = evals_.empty() ? kPhaseDone : kPhaseEvaluate;
}

v1::Task JobScheduler::MakeTask(const std::string& task_id, const Assignment& a) {
  v1::Task t;
  t.set_task_id(task_id);
  t.set_kind(a.kind);
  t.set_job_id(job_id_);
  t.set_attempt(a.attempt);
  t.set_attempt_token(task_id);
  if (a.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    t.set_block(a.index);
    auto g = groups_.find(a.index);
    if (a.part >= 0 && g != groups_.end()) {
      v1::BlockPart* part = t.mutable_part();
      part->set_index(a.part);
      part->set_count(static_cast<int32_t>(g->second.size()) + 1);
      if (a.part > 0) {
        part->set_expert_begin(g->second[a.part - 1].begin);
        part->set_expert_end(g->second[a.part - 1].end);
      }
    }
  }
  if (a.kind == v1::TASK_KIND_EVALUATE) *t.mutable_eval() = evals_[a.index];
  if (a.kind == v1::TASK_KIND_CALIBRATE) *t.mutable_calibrate() = calibrate_params_;
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

std::map<std::string, std::string> JobScheduler::running() const {
  std::map<std::string, std::string> out;
  for (const auto& [task_id, a] : assigned_) out[a.worker_id] = task_id;
  return out;
}

std::string JobScheduler::Hand(v1::TaskKind kind, int64_t index, int part,
                               const std::string& worker_id) {
  const int attempt = ++attempts_[{static_cast<int>(kind), index, part}];
  const std::string task_id = absl::StrCat(TaskIdPrefix(kind, index, part), ".a", attempt);
  const Assignment a{kind, index, part, attempt, worker_id};
  assigned_[task_id] = a;
  handed_[task_id] = a;
  return task_id;
}

bool JobScheduler::RequeueAssignment(const std::string& task_id, const std::string& reason,
                                     Requeue* out) {
  auto it = assigned_.find(task_id);
  if (it == assigned_.end()) return true;
  const Assignment a = it->second;
  assigned_.erase(it);
  out->task_id = task_id;
  out->what = Describe(a.kind, a.index, a.part);
  out->next_attempt = a.attempt + 1;
  if (a.attempt >= max_attempts_) {
    SetError(absl::StrCat(out->what, " was attempted ", a.attempt, " times; last: ", reason));
    return false;
  }
  if (a.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    pending_.push_front({a.index, a.part});
  } else if (a.kind == v1::TASK_KIND_EVALUATE) {
    evals_pending_.push_front(a.index);
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
      const Assignment a{v1::TASK_KIND_CALIBRATE, -1, -1, 1, worker_id};
      handed_[kCalibrateTaskId] = a;
      return MakeTask(kCalibrateTaskId, a);
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
  if (phase_ == kPhaseQuantize && !block_in_flight) {
    // The first unit that may run: an assembly waits for its block's expert groups.
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (!Ready(*it)) continue;
      const Unit u = *it;
      pending_.erase(it);
      const std::string id = Hand(v1::TASK_KIND_QUANTIZE_BLOCK, u.block, u.part, worker_id);
      return MakeTask(id, assigned_[id]);
    }
  }
  if (phase_ == kPhaseFinetune && e2e_pending_) {
    e2e_pending_ = false;
    const std::string id = Hand(v1::TASK_KIND_FINETUNE_E2E, -1, -1, worker_id);
    return MakeTask(id, assigned_[id]);
  }
  if (phase_ == kPhaseEvaluate && !evals_pending_.empty()) {
    const int64_t e = evals_pending_.front();
    evals_pending_.pop_front();
    const std::string id = Hand(v1::TASK_KIND_EVALUATE, e, -1, worker_id);
    return MakeTask(id, assigned_[id]);
  }
  return Wait();
}

StatusOr<JobScheduler::TaskInfo> JobScheduler::Lookup(const std::string& task_id) const {
  auto it = handed_.find(task_id);
  if (it == handed_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " never handed out task '", task_id, "'"));
  }
  TaskInfo info;
  info.kind = it->second.kind;
  info.index = it->second.index;
  info.part = it->second.part;
  info.attempt = it->second.attempt;
  switch (info.kind) {
    case v1::TASK_KIND_QUANTIZE_BLOCK: info.done = UnitDone({info.index, info.part}); break;
    case v1::TASK_KIND_EVALUATE: info.done = evals_done_.count(info.index) != 0; break;
    case v1::TASK_KIND_FINETUNE_E2E: info.done = e2e_done_; break;
    default: info.done = false; break;  // calibration: per rank, see Complete
  }
  return info;
}

StatusOr<JobScheduler::Completion> JobScheduler::Complete(const std::string& worker_id, int rank,
                                                          const std::string& task_id) {
  Completion c;
  if (task_id == kCalibrateTaskId) {
    c.kind = v1::TASK_KIND_CALIBRATE;
    c.attempt = 1;
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

  auto rec = handed_.find(task_id);
  if (rec == handed_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " never handed out task '", task_id, "'"));
  }
  const Assignment a = rec->second;
  c.kind = a.kind;
  c.attempt = a.attempt;
  if (a.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    c.block = a.index;
    c.part = a.part;
  }
  if (a.kind == v1::TASK_KIND_EVALUATE) c.eval = a.index;
  const bool already = a.kind == v1::TASK_KIND_QUANTIZE_BLOCK ? UnitDone({a.index, a.part})
                       : a.kind == v1::TASK_KIND_EVALUATE     ? evals_done_.count(a.index) != 0
                                                              : e2e_done_;
  // Retire every attempt of the same work (other ranks may hold a requeued copy).
  for (auto it = assigned_.begin(); it != assigned_.end();) {
    if (it->second.kind == a.kind && it->second.index == a.index && it->second.part == a.part) {
      it = assigned_.erase(it);
    } else {
      ++it;
    }
  }
  if (already) {
    c.duplicate = true;
    return c;
  }
  if (a.kind == v1::TASK_KIND_QUANTIZE_BLOCK) {
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [&a](const Unit& u) {
                                    return u.block == a.index && u.part == a.part;
                                  }),
                   pending_.end());
    if (a.part > 0) {
      parts_done_.insert({a.index, a.part});
      return c;
    }
    blocks_done_.insert(a.index);
    if (phase_ == kPhaseQuantize && blocks_done_.size() == blocks_.size()) {
      AdvancePhase();
      c.phase_finished = true;
    }
  } else if (a.kind == v1::TASK_KIND_EVALUATE) {
    evals_pending_.erase(std::remove(evals_pending_.begin(), evals_pending_.end(), a.index),
                         evals_pending_.end());
    evals_done_.insert(a.index);
    if (phase_ == kPhaseEvaluate && evals_done_.size() == evals_.size()) {
      phase_ = kPhaseDone;
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
    if (handed_.count(task_id) != 0) return out;  // a superseded attempt: ignore
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " never handed out task '", task_id, "'"));
  }
  const std::string what = Describe(it->second.kind, it->second.index, it->second.part);
  if (!retryable) {
    SetError(absl::StrCat(what, " failed on rank ", rank, ": ", message));
    assigned_.erase(it);
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
  if (phase_ == kPhaseCalibrate) {
    // The collective cannot finish without this rank (and the ranks that finished wait for the
    // others): only a new world can calibrate.
    needs_new_group_ = true;
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

std::vector<JobScheduler::Requeue> JobScheduler::GroupLost(const std::string& reason) {
  needs_new_group_ = false;
  if (phase_ == kPhaseCalibrate) {
    calibrate_given_.clear();
    calibrate_done_.clear();
  }
  std::vector<std::string> held;
  for (const auto& [task_id, a] : assigned_) held.push_back(task_id);
  std::vector<Requeue> out;
  for (const std::string& task_id : held) {
    Requeue r;
    if (RequeueAssignment(task_id, reason, &r)) out.push_back(r);
  }
  // Lowest layer (and evaluation) first again, whatever order the tasks were held in; a split
  // block's groups before its assembly.
  std::sort(pending_.begin(), pending_.end(), [](const Unit& x, const Unit& y) {
    const int px = x.part == 0 ? std::numeric_limits<int>::max() : x.part;
    const int py = y.part == 0 ? std::numeric_limits<int>::max() : y.part;
    return std::tie(x.block, px) < std::tie(y.block, py);
  });
  std::sort(evals_pending_.begin(), evals_pending_.end());
  return out;
}

}  // namespace qcal::job
