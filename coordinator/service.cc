#include "coordinator/service.h"

#include <dlfcn.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/byte_buffer.h>

#include <functional>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "common/log.h"
#include "common/utf8.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "proto/qcal.grpc.pb.h"

namespace qcal::coordinator {
using rpc::ConstantTimeEquals;
using rpc::ToGrpcStatus;

namespace {

// Loads gRPC's reflection library, whose static initializer registers the reflection plugin
// with every ServerBuilder created afterwards in this process. It is not linked: linked, it
// would serve reflection (unauthenticated, a thread per stream) whether asked or not.
Status LoadReflection() {
  static const Status loaded = [] {
    if (dlopen(QCAL_GRPC_REFLECTION_LIBRARY, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--reflection: cannot load ", QCAL_GRPC_REFLECTION_LIBRARY, ": ", dlerror()));
    }
    return absl::OkStatus();
  }();
  return loaded;
}

}  // namespace

grpc::Status PresentedToken(const grpc::ServerContextBase& context, std::string* token) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata");
  }
  const std::string value(it->second.data(), it->second.size());
  static const std::string kBearer = "Bearer ";
  if (value.compare(0, kBearer.size(), kBearer) != 0) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the authorization metadata is not a bearer token");
  }
  *token = value.substr(kBearer.size());
  return grpc::Status::OK;
}

grpc::Status Authorize(const grpc::ServerContextBase& context, const std::string& token) {
  std::string presented;
  grpc::Status s = PresentedToken(context, &presented);
  if (!s.ok()) return s;
  if (token.empty() || !ConstantTimeEquals(presented, token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

namespace {

// Runs `body` (returning absl::Status) once `authorize` accepted the call; exceptions become
// INTERNAL.
template <typename Authorizer, typename Body>
grpc::Status Guarded(const grpc::ServerContextBase* context, Authorizer&& authorize,
                     const char* method, Body&& body) {
  grpc::Status auth = authorize(*context);
  if (!auth.ok()) {
    QCAL_LOG_WARN("{} from {} refused: {}", method, context->peer(), auth.error_message());
    return auth;
  }
  try {
    return ToGrpcStatus(body());
  } catch (const std::exception& e) {
    QCAL_LOG_ERROR("{}: internal error: {}", method, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat(method, ": ", e.what()));
  }
}

// InvalidArgument when a request's job id is not UTF-8 (bytes on the wire: proto/qcal.proto).
Status CheckJobId(const char* method, const std::string& id) {
  if (const std::string where = DescribeInvalidUtf8(id); !where.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        method, ": job_id (", where, ") is not valid UTF-8; job ids look like job-000001"));
  }
  return absl::OkStatus();
}

// A client call: the token must be one of the tokens file's; `*who` is its user.
grpc::Status AuthorizeClient(const grpc::ServerContextBase& context, const TokenTable& tokens,
                             const Principal** who) {
  std::string presented;
  grpc::Status s = PresentedToken(context, &presented);
  if (!s.ok()) return s;
  *who = tokens.Find(presented);
  if (*who == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

}  // namespace

namespace {

std::string ByteBufferToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

std::string FindNonUtf8In(const google::protobuf::UnknownFieldSet& fields,
                          const google::protobuf::Descriptor* descriptor, const std::string& path,
                          int depth) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::UnknownField;
  if (depth > 32) return "";
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& f = fields.field(i);
    const FieldDescriptor* fd = descriptor->FindFieldByNumber(f.number());
    if (fd == nullptr || f.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const std::string name = path.empty() ? fd->name() : path + "." + fd->name();
    if (fd->type() == FieldDescriptor::TYPE_STRING) {
      const std::string where = DescribeInvalidUtf8(f.length_delimited());
      if (!where.empty()) return absl::StrCat(name, " (", where, ")");
    } else if (fd->type() == FieldDescriptor::TYPE_MESSAGE) {
      google::protobuf::UnknownFieldSet inner;
      if (!inner.ParseFromString(f.length_delimited())) continue;
      std::string found = FindNonUtf8In(inner, fd->message_type(), name, depth + 1);
      if (!found.empty()) return found;
    }
  }
  return "";
}

}  // namespace

std::string FindNonUtf8Field(const std::string& bytes,
                             const google::protobuf::Descriptor* descriptor) {
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromString(bytes)) return "";
  return FindNonUtf8In(fields, descriptor, "", 0);
}

// SubmitJob takes the request's raw bytes and parses them itself, so a request protobuf refuses
// (a string field that is not UTF-8) gets INVALID_ARGUMENT naming the field after the auth check,
// not gRPC's INTERNAL with an empty message before it. The other methods are synchronous.
class CoordinatorServer::JobServiceImpl final
    : public v1::JobService::WithRawCallbackMethod_SubmitJob<v1::JobService::Service> {
 public:
  JobServiceImpl(JobManager* m, TokenTable tokens) : m_(m), tokens_(std::move(tokens)) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    const Principal* who = nullptr;
    reactor->Finish(Guarded(ctx, Client(&who), "SubmitJob", [&]() -> Status {
      const std::string bytes = ByteBufferToString(*request);
      v1::SubmitJobRequest req;
      if (!req.ParseFromString(bytes)) {
        const std::string field = FindNonUtf8Field(bytes, v1::SubmitJobRequest::descriptor());
        return absl::InvalidArgumentError(
            field.empty() ? "SubmitJob: the request is not a well-formed SubmitJobRequest"
                          : absl::StrCat("SubmitJob: ", field, " is not valid UTF-8; every "
                                         "string of a job spec must be"));
      }
      QCAL_ASSIGN_OR_RETURN(std::string id, m_->Submit(req.spec(), *who));
      v1::SubmitJobResponse resp;
      resp.set_job_id(id);
      std::string out;
      if (!resp.SerializeToString(&out)) return absl::InternalError("SubmitJob: cannot encode");
      grpc::Slice slice(out);
      *response = grpc::ByteBuffer(&slice, 1);
      return absl::OkStatus();
    }));
    return reactor;
  }
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::Job* resp) override {
    const Principal* who = nullptr;
    return Guarded(ctx, Client(&who), "GetJob", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(CheckJobId("GetJob", req->job_id()));
      QCAL_ASSIGN_OR_RETURN(*resp, m_->Get(req->job_id(), *who));
      return absl::OkStatus();
    });
  }
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override {
    const Principal* who = nullptr;
    return Guarded(ctx, Client(&who), "ListJobs", [&]() -> Status {
      for (v1::Job& job : m_->List(*who)) *resp->add_jobs() = std::move(job);
      return absl::OkStatus();
    });
  }
  grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                         v1::CancelJobResponse* resp) override {
    const Principal* who = nullptr;
    return Guarded(ctx, Client(&who), "CancelJob", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(CheckJobId("CancelJob", req->job_id()));
      QCAL_ASSIGN_OR_RETURN(*resp->mutable_job(), m_->Cancel(req->job_id(), *who));
      return absl::OkStatus();
    });
  }
  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    const Principal* who = nullptr;
    return Guarded(ctx, Client(&who), "WatchJob", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(CheckJobId("WatchJob", req->job_id()));
      return m_->Watch(
          req->job_id(), *who, req->after_seq(),
          [&](const v1::JobEvent& e) { return writer->Write(e); },
          [&] { return ctx->IsCancelled(); });
    });
  }

 private:
  std::function<grpc::Status(const grpc::ServerContextBase&)> Client(const Principal** who) {
    return [this, who](const grpc::ServerContextBase& c) {
      return AuthorizeClient(c, tokens_, who);
    };
  }
  JobManager* m_;
  TokenTable tokens_;
};

// Worker calls carry their job's worker credential (JobManager::WorkerCredentialJob), never a
// client token; a credential opens only the calls of its own job.
class CoordinatorServer::WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(JobManager* m) : m_(m) {}

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse* resp) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "RegisterWorker", [&]() -> Status {
      if (req->job_id() != job) return WrongJob(req->job_id(), job);
      QCAL_ASSIGN_OR_RETURN(*resp, m_->RegisterWorker(*req));
      return absl::OkStatus();
    });
  }
  grpc::Status NextTask(grpc::ServerContext* ctx, const v1::NextTaskRequest* req,
                        v1::Task* resp) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "NextTask", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(m_->CheckWorkerOfJob(req->worker_id(), job));
      QCAL_ASSIGN_OR_RETURN(*resp, m_->NextTask(req->worker_id()));
      return absl::OkStatus();
    });
  }
  grpc::Status ReportProgress(grpc::ServerContext* ctx, const v1::ReportProgressRequest* req,
                              v1::ReportProgressResponse* resp) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "ReportProgress", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(m_->CheckWorkerOfJob(req->worker_id(), job));
      QCAL_ASSIGN_OR_RETURN(bool cancelled, m_->ReportProgress(*req));
      resp->set_cancelled(cancelled);
      return absl::OkStatus();
    });
  }
  grpc::Status CompleteTask(grpc::ServerContext* ctx, const v1::CompleteTaskRequest* req,
                            v1::CompleteTaskResponse*) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "CompleteTask", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(m_->CheckWorkerOfJob(req->worker_id(), job));
      return m_->CompleteTask(*req);
    });
  }
  grpc::Status FailTask(grpc::ServerContext* ctx, const v1::FailTaskRequest* req,
                        v1::FailTaskResponse*) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "FailTask", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(m_->CheckWorkerOfJob(req->worker_id(), job));
      return m_->FailTask(*req);
    });
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    std::string job;
    return Guarded(ctx, Worker(&job), "Heartbeat", [&]() -> Status {
      QCAL_RETURN_IF_ERROR(m_->CheckWorkerOfJob(req->worker_id(), job));
      QCAL_ASSIGN_OR_RETURN(bool cancelled, m_->Heartbeat(req->worker_id()));
      resp->set_cancelled(cancelled);
      return absl::OkStatus();
    });
  }

 private:
  std::function<grpc::Status(const grpc::ServerContextBase&)> Worker(std::string* job) {
    return [this, job](const grpc::ServerContextBase& c) {
      std::string presented;
      grpc::Status s = PresentedToken(c, &presented);
      if (!s.ok()) return s;
      std::optional<std::string> found = m_->WorkerCredentialJob(presented);
      if (!found) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "invalid worker credential (workers use the credential their job's "
                            "coordinator made when it launched them, not a client token)");
      }
      *job = *found;
      return grpc::Status::OK;
    };
  }
  static Status WrongJob(const std::string& asked, const std::string& job) {
    return absl::PermissionDeniedError(absl::StrCat(
        "this worker credential is for job ", job, ", not '", io::Printable(asked, 64), "'"));
  }
  JobManager* m_;
};

StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const ServerOptions& options, JobManager* manager) {
  TokenTable tokens = options.tokens;
  if (tokens.size() == 0) {
    if (options.token.empty()) return absl::InvalidArgumentError("the server needs an auth token");
    tokens = TokenTable::SingleAdmin(options.token);
  }
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
    }
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    QCAL_ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(options.tls_cert_file));
    QCAL_ASSIGN_OR_RETURN(pair.private_key, ReadFile(options.tls_key_file));
    ssl.pem_key_cert_pairs.push_back(pair);
    if (!options.tls_client_ca_file.empty()) {
      QCAL_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_client_ca_file));
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    credentials = grpc::SslServerCredentials(ssl);
  } else {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    credentials = grpc::InsecureServerCredentials();
  }

  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->job_service_ = std::make_unique<JobServiceImpl>(manager, std::move(tokens));
  server->worker_service_ = std::make_unique<WorkerServiceImpl>(manager);
  if (options.max_threads < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-threads must be at least 8, got ", options.max_threads));
  }
  grpc::EnableDefaultHealthCheckService(true);
  if (options.reflection) QCAL_RETURN_IF_ERROR(LoadReflection());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &server->port_);
  builder.RegisterService(server->job_service_.get());
  builder.RegisterService(server->worker_service_.get());
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  grpc::ResourceQuota quota("qcal-coordinator");
  quota.SetMaxThreads(options.max_threads);
  quota.Resize(kMaxTransportMemoryBytes);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  // No bandwidth-delay probing: it grows a connection's receive window ahead of demand, which
  // an unauthenticated sender can fill.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  server->server_ = builder.BuildAndStart();
  if (!server->server_ || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", options.listen, "' (address in use or invalid)"));
  }
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(std::chrono::milliseconds(0)); }

void CoordinatorServer::Shutdown(std::chrono::milliseconds grace) {
  if (shut_down_ || !server_) return;
  shut_down_ = true;
  if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + grace);
}

void CoordinatorServer::Wait() {
  if (server_) server_->Wait();
}

}  // namespace qcal::coordinator
