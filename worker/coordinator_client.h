// The worker's side of qcal.v1.WorkerService, behind an interface so the task loop runs against a
// fake in unit tests (tests/worker/fake_coordinator_client.h) and against the coordinator over
// gRPC in qcal-worker. Every gRPC call carries `authorization: Bearer <token>`.
//
// Thread-safety: implementations are safe to call from several threads at once (the task loop's
// main thread and its heartbeat thread).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "proto/qcal.pb.h"

namespace qcal::worker {

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  virtual StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request) = 0;
  virtual StatusOr<v1::Task> NextTask(const std::string& worker_id) = 0;
  // Returns whether the job was cancelled.
  virtual StatusOr<bool> ReportProgress(const v1::ReportProgressRequest& request) = 0;
  // request: worker_id, task_id and the task's typed result.
  virtual Status CompleteTask(const v1::CompleteTaskRequest& request) = 0;
  virtual Status FailTask(const std::string& worker_id, const std::string& task_id,
                          const std::string& error, bool retryable) = 0;
  // Returns whether the job was cancelled.
  virtual StatusOr<bool> Heartbeat(const std::string& worker_id) = 0;
};

// Over a gRPC channel (rpc/auth.h MakeChannel). Each call has `rpc_timeout` as deadline;
// errors keep gRPC's code, with the RPC's name prepended ("NextTask: ...").
std::unique_ptr<CoordinatorClient> MakeGrpcCoordinatorClient(
    std::shared_ptr<grpc::Channel> channel, std::string token,
    std::chrono::milliseconds rpc_timeout = std::chrono::seconds(60));

}  // namespace qcal::worker
