#include "worker/task_loop.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "methods/registry.h"
#include "runner/job_inputs.h"
#include "runner/job_steps.h"
#include "runner/task_executor.h"

namespace qcal::worker {
namespace {

// ": tokens 2.1 s, hessians 545.0 s (peak 10.9 GiB), hessians/forward 402.3 s, ...": where a
// task's seconds went on this rank (its phases, the result's PhaseTiming list), for the log.
std::string PhasesOf(const google::protobuf::RepeatedPtrField<v1::PhaseTiming>& phases) {
  std::string out;
  for (const v1::PhaseTiming& p : phases) {
    absl::StrAppend(&out, out.empty() ? ": " : ", ", p.name(), " ",
                    absl::StrFormat("%.1f", p.seconds()), " s");
    if (p.peak_host_bytes() > 0) {
      absl::StrAppend(&out, " (peak ", absl::StrFormat("%.2f", p.peak_host_bytes() / 1073741824.0),
                      " GiB)");
    }
  }
  return out;
}

std::string HostName() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

// Sends heartbeats every `interval` until stopped; calls on_cancelled / on_lost once.
class HeartbeatThread {
 public:
  HeartbeatThread(CoordinatorClient& client, std::string worker_id,
                  std::chrono::milliseconds interval, int max_missed,
                  std::function<void()> on_cancelled, std::function<void()> on_lost,
                  std::atomic<bool>* cancelled)
      : client_(client),
        worker_id_(std::move(worker_id)),
        interval_(interval),
        max_missed_(max_missed),
        on_cancelled_(std::move(on_cancelled)),
        on_lost_(std::move(on_lost)),
        cancelled_(cancelled),
        thread_([this] { Run(); }) {}
  ~HeartbeatThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Run() {
    int missed = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, interval_, [this] { return stop_; })) {
      lock.unlock();
      auto beat = client_.Heartbeat(worker_id_);
      lock.lock();
      if (beat.ok()) {
        missed = 0;
        if (*beat && !cancelled_->exchange(true)) {
          QCAL_LOG_WARN("worker {}: the job was cancelled (heartbeat)", worker_id_);
          lock.unlock();
          if (on_cancelled_) on_cancelled_();
          lock.lock();
        }
      } else if (++missed == max_missed_) {
        QCAL_LOG_ERROR("worker {}: {} heartbeats failed in a row, last: {}", worker_id_, missed,
                       beat.status().ToString());
        lock.unlock();
        if (on_lost_) on_lost_();
        lock.lock();
      }
    }
  }

  CoordinatorClient& client_;
  const std::string worker_id_;
  const std::chrono::milliseconds interval_;
  const int max_missed_;
  std::function<void()> on_cancelled_, on_lost_;
  std::atomic<bool>* cancelled_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

// Every rank learns whether every rank is fine (collective): the failing rank keeps its error,
// the others get Aborted.
Status AgreeOk(comm::Comm& comm, const Status& local, const std::string& what) {
  int64_t failed = local.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!local.ok()) return local;
  if (failed > 0) return absl::AbortedError(absl::StrCat(what, ": another rank failed"));
  return absl::OkStatus();
}

class Worker {
 public:
  Worker(CoordinatorClient& client, comm::Comm& comm, const TaskLoopOptions& options)
      : client_(client), comm_(comm), options_(options) {}

  StatusOr<TaskLoopResult> Run() {
    v1::RegisterWorkerRequest reg;
    reg.set_job_id(options_.job_id);
    reg.set_rank(comm_.rank());
    reg.set_world_size(comm_.size());
    reg.set_hostname(options_.hostname.empty() ? HostName() : options_.hostname);
    reg.set_pid(::getpid());
    reg.set_device(options_.device);
    QCAL_ASSIGN_OR_RETURN(v1::RegisterWorkerResponse registered, client_.RegisterWorker(reg));
    result_.worker_id = registered.worker_id();
    spec_ = registered.spec();
    inputs_key_ = registered.inputs_key();
    QCAL_LOG_INFO("rank {}/{}: registered as worker {} for job {}", comm_.rank(), comm_.size(),
                  result_.worker_id, options_.job_id);
    const int64_t interval_ms = registered.heartbeat_interval_ms() > 0
                                    ? registered.heartbeat_interval_ms()
                                    : options_.default_heartbeat_ms;
    HeartbeatThread heartbeat(client_, result_.worker_id, std::chrono::milliseconds(interval_ms),
                              options_.max_missed_heartbeats, options_.on_cancelled,
                              options_.on_lost, &cancelled_);
    int retries = 0;
    while (true) {
      if (cancelled_) return absl::CancelledError("the job was cancelled");
      auto task = client_.NextTask(result_.worker_id);
      if (!task.ok()) {
        const bool transient =
            absl::IsUnavailable(task.status()) || absl::IsDeadlineExceeded(task.status());
        if (transient && ++retries <= options_.next_task_retries) {
          QCAL_LOG_WARN("NextTask failed ({}), retry {}", task.status().ToString(), retries);
          std::this_thread::sleep_for(std::chrono::milliseconds(200 * retries));
          continue;
        }
        return task.status();
      }
      retries = 0;
      switch (task->kind()) {
        case v1::TASK_KIND_SHUTDOWN:
          result_.shutdown_reason = task->reason();
          QCAL_LOG_INFO("worker {}: shutdown ({})", result_.worker_id, task->reason());
          return result_;
        case v1::TASK_KIND_WAIT:
          SleepUnlessCancelled(
              std::chrono::milliseconds(std::max<int64_t>(task->retry_after_ms(), 1)));
          break;
        case v1::TASK_KIND_CALIBRATE:
        case v1::TASK_KIND_QUANTIZE_BLOCK:
        case v1::TASK_KIND_FINETUNE_E2E:
        case v1::TASK_KIND_EVALUATE:
          QCAL_RETURN_IF_ERROR(Execute(*task));
          break;
        default:
          QCAL_RETURN_IF_ERROR(client_.FailTask(
              result_.worker_id, task->task_id(),
              absl::StrCat("worker does not know task kind ", static_cast<int>(task->kind())),
              false));
          break;
      }
    }
  }

 private:
  void SleepUnlessCancelled(std::chrono::milliseconds ms) {
    const auto until = std::chrono::steady_clock::now() + ms;
    while (!cancelled_ && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(
          std::min<std::chrono::milliseconds>(ms, std::chrono::milliseconds(50)));
    }
  }

  // The job's steps need the recipe, its method and the (streamed) float model: opened on the
  // first task.
  Status EnsureContext() {
    if (ctx_) return absl::OkStatus();
    v1::JobSpec spec = spec_;
    ResolveJobSpec(&spec);  // as the coordinator resolved it to check it (OpenJob again: a no-op)
    QCAL_ASSIGN_OR_RETURN(Recipe recipe, ParseRecipe(spec.recipe_yaml(), spec.recipe_path()));
    job::RankOptions rank;
    rank.threads = options_.threads;  // the process's --threads, when given
    rank.device_sum = options_.device_sum;
    rank.inputs_key = inputs_key_;
    QCAL_ASSIGN_OR_RETURN(ctx_, job::OpenJob(recipe, spec, rank));
    return absl::OkStatus();
  }

  job::JobEventFn Progress(const v1::Task& task, bool report) {
    if (!report) return nullptr;
    return [this, task_id = task.task_id()](const job::JobEvent& e) {
      v1::ReportProgressRequest req;
      req.set_worker_id(result_.worker_id);
      req.set_task_id(task_id);
      req.set_phase(e.phase);
      req.set_done(e.done);
      req.set_total(e.total);
      req.set_message(e.message);
      auto cancelled = client_.ReportProgress(req);
      if (!cancelled.ok()) {
        QCAL_LOG_WARN("ReportProgress failed: {}", cancelled.status().ToString());
      } else if (*cancelled && !cancelled_.exchange(true)) {
        QCAL_LOG_WARN("worker {}: the job was cancelled (progress report)", result_.worker_id);
        if (options_.on_cancelled) options_.on_cancelled();
      }
    };
  }

  Status Execute(const v1::Task& task) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string what = job::TaskWhat(task);
    StatusOr<v1::CompleteTaskRequest> done = [&]() -> StatusOr<v1::CompleteTaskRequest> {
      if (task.kind() == v1::TASK_KIND_CALIBRATE) {
        // Collective: every rank must reach CalibrateStep's collectives, or agree to give up.
        QCAL_RETURN_IF_ERROR(AgreeOk(comm_, EnsureContext(), "calibration"));
      } else {
        QCAL_RETURN_IF_ERROR(EnsureContext());
      }
      // Calibration reports from rank 0 only (every rank runs the same walk).
      const bool report = task.kind() != v1::TASK_KIND_CALIBRATE || comm_.rank() == 0;
      return job::ExecuteTask(comm_, ctx_.get(), task, Progress(task, report));
    }();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (done.ok()) {
      QCAL_LOG_INFO("worker {}: {} done in {:.1f} s{}", result_.worker_id, what, secs,
                    done->has_calibrate() ? PhasesOf(done->calibrate().phases()) : "");
      ++result_.tasks_completed;
      if (task.kind() == v1::TASK_KIND_QUANTIZE_BLOCK) ++result_.blocks_quantized;
      done->set_worker_id(result_.worker_id);
      return client_.CompleteTask(*done);
    }
    const Status failure = job::AnnotateTaskError(done.status(), what);
    QCAL_LOG_ERROR("worker {}: {}", result_.worker_id, failure.ToString());
    ++result_.tasks_failed;
    return client_.FailTask(result_.worker_id, task.task_id(), std::string(failure.message()),
                            job::IsRetryable(done.status()));
  }

  CoordinatorClient& client_;
  comm::Comm& comm_;
  const TaskLoopOptions options_;
  v1::JobSpec spec_;
  std::string inputs_key_;  // the coordinator's plan's (RegisterWorkerResponse.inputs_key)
  std::unique_ptr<job::JobContext> ctx_;
  TaskLoopResult result_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

StatusOr<TaskLoopResult> RunTaskLoop(CoordinatorClient& client, comm::Comm& comm,
                                     const TaskLoopOptions& options) {
  Worker worker(client, comm, options);
  return worker.Run();
}

}  // namespace qcal::worker
