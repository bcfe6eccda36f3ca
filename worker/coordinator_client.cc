#include "worker/coordinator_client.h"

#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "proto/qcal.grpc.pb.h"

namespace qcal::worker {
namespace {

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  GrpcCoordinatorClient(std::shared_ptr<grpc::Channel> channel, std::string token,
                        std::chrono::milliseconds timeout)
      : stub_(v1::WorkerService::NewStub(channel)), token_(std::move(token)), timeout_(timeout) {}

  StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request) override {
    v1::RegisterWorkerResponse response;
    QCAL_RETURN_IF_ERROR(Call("RegisterWorker", [&](grpc::ClientContext* c) {
      return stub_->RegisterWorker(c, request, &response);
    }));
    return response;
  }

  StatusOr<v1::Task> NextTask(const std::string& worker_id) override {
    v1::NextTaskRequest request;
    request.set_worker_id(worker_id);
    v1::Task task;
    QCAL_RETURN_IF_ERROR(Call(
        "NextTask", [&](grpc::ClientContext* c) { return stub_->NextTask(c, request, &task); }));
    return task;
  }

  StatusOr<bool> ReportProgress(const v1::ReportProgressRequest& request) override {
    v1::ReportProgressResponse response;
    QCAL_RETURN_IF_ERROR(Call("ReportProgress", [&](grpc::ClientContext* c) {
      return stub_->ReportProgress(c, request, &response);
    }));
    return response.cancelled();
  }

  Status CompleteTask(const v1::CompleteTaskRequest& request) override {
    v1::CompleteTaskResponse response;
    return Call("CompleteTask",
                [&](grpc::ClientContext* c) { return stub_->CompleteTask(c, request, &response); });
  }

  Status FailTask(const std::string& worker_id, const std::string& task_id,
                  const std::string& error, bool retryable) override {
    v1::FailTaskRequest request;
    request.set_worker_id(worker_id);
    request.set_task_id(task_id);
    request.set_error(error);
    request.set_retryable(retryable);
    v1::FailTaskResponse response;
    return Call("FailTask",
                [&](grpc::ClientContext* c) { return stub_->FailTask(c, request, &response); });
  }

  StatusOr<bool> Heartbeat(const std::string& worker_id) override {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id);
    v1::HeartbeatResponse response;
    QCAL_RETURN_IF_ERROR(Call("Heartbeat", [&](grpc::ClientContext* c) {
      return stub_->Heartbeat(c, request, &response);
    }));
    return response.cancelled();
  }

 private:
  template <typename Fn>
  Status Call(const char* rpc, Fn&& fn) {
    grpc::ClientContext context;
    rpc::AddBearerToken(&context, token_);
    context.set_deadline(std::chrono::system_clock::now() + timeout_);
    return Annotate(rpc::FromGrpcStatus(fn(&context)), rpc);
  }

  std::unique_ptr<v1::WorkerService::Stub> stub_;
  const std::string token_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<CoordinatorClient> MakeGrpcCoordinatorClient(
    std::shared_ptr<grpc::Channel> channel, std::string token,
    std::chrono::milliseconds rpc_timeout) {
  return std::make_unique<GrpcCoordinatorClient>(std::move(channel), std::move(token), rpc_timeout);
}

}  // namespace qcal::worker
