#include "rpc/job_client.h"

#include "absl/strings/str_cat.h"
#include "proto/qcal.grpc.pb.h"
#include "rpc/grpc_status.h"

namespace qcal::rpc {
namespace {

class GrpcJobClient final : public JobClient {
 public:
  GrpcJobClient(JobClientOptions options, std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)), stub_(v1::JobService::NewStub(std::move(channel))) {}

  StatusOr<std::string> Submit(const v1::JobSpec& spec) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    QCAL_RETURN_IF_ERROR(Explain(stub_->SubmitJob(&ctx, req, &resp)));
    return resp.job_id();
  }

  StatusOr<v1::Job> Get(const std::string& job_id) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::Job job;
    QCAL_RETURN_IF_ERROR(Explain(stub_->GetJob(&ctx, req, &job)));
    return job;
  }

  StatusOr<std::vector<v1::Job>> List() override {
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    v1::ListJobsResponse resp;
    QCAL_RETURN_IF_ERROR(Explain(stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp)));
    return std::vector<v1::Job>(resp.jobs().begin(), resp.jobs().end());
  }

  StatusOr<v1::Job> Cancel(const std::string& job_id) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    v1::CancelJobRequest req;
    req.set_job_id(job_id);
    v1::CancelJobResponse resp;
    QCAL_RETURN_IF_ERROR(Explain(stub_->CancelJob(&ctx, req, &resp)));
    return resp.job();
  }

  Status Watch(const std::string& job_id, int64_t after_seq,
               const std::function<bool(const v1::JobEvent&)>& on_event) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, false);
    v1::WatchJobRequest req;
    req.set_job_id(job_id);
    req.set_after_seq(after_seq);
    auto reader = stub_->WatchJob(&ctx, req);
    v1::JobEvent e;
    while (reader->Read(&e)) {
      if (!on_event(e)) {
        ctx.TryCancel();
        reader->Finish();
        return absl::CancelledError("the watcher stopped");
      }
    }
    return Explain(reader->Finish());
  }

 private:
  void Prepare(grpc::ClientContext* ctx, bool unary) const {
    AddBearerToken(ctx, options_.token);
    if (unary) ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline);
  }
  Status Explain(const grpc::Status& s) const {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ",
                                                 options_.address, ": ", s.error_message()));
    }
    return FromGrpcStatus(s);
  }

  const JobClientOptions options_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

}  // namespace

StatusOr<std::unique_ptr<JobClient>> MakeGrpcJobClient(const JobClientOptions& options) {
  QCAL_ASSIGN_OR_RETURN(auto channel, MakeChannel(options.address, options.tls));
  return std::unique_ptr<JobClient>(std::make_unique<GrpcJobClient>(options, std::move(channel)));
}

}  // namespace qcal::rpc
