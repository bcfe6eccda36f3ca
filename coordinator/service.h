// The coordinator's gRPC server: qcal.v1.JobService and qcal.v1.WorkerService over a JobManager,
// plus the standard health service (grpc.health.v1) and server reflection, which need no token.
//
// Every qcal.v1 RPC first checks "authorization: Bearer <token>" (UNAUTHENTICATED otherwise),
// then calls the JobManager; absl::Status converts to grpc::Status in exactly one place
// (grpc_status.h). An exception inside a handler becomes INTERNAL for that call only.
#pragma once

#include <memory>
#include <string>

#include <google/protobuf/descriptor.h>
#include <grpcpp/grpcpp.h>

#include "common/status.h"
#include "coordinator/identity.h"
#include "coordinator/job_manager.h"

namespace qcal::coordinator {

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  // Who may call the JobService (identity.h). Empty: `token` alone, as one admin.
  TokenTable tokens;
  std::string token;                   // the single admin token (when `tokens` is empty)
  std::string tls_cert_file;           // with tls_key_file: serve TLS
  std::string tls_key_file;
  std::string tls_client_ca_file;      // require client certificates signed by this CA
  // Limits that hold before a call is authenticated (docs/service.md, "Limits"):
  //  * a request message may be at most kMaxRequestBytes (a JobSpec with the largest recipe
  //    qcal accepts, 1 MiB, and its paths); a larger one is refused with RESOURCE_EXHAUSTED from
  //    its length prefix, before it is buffered;
  //  * at most max_threads threads serve calls (gRPC's sync-server quota; a call beyond it gets
  //    RESOURCE_EXHAUSTED), and kMaxStreamsPerConnection concurrent calls per connection;
  //  * server reflection (unauthenticated, a thread per open stream) only when asked for.
  int max_threads = 512;
  bool reflection = false;
};

inline constexpr int kMaxRequestBytes = (1 << 20) + (64 << 10);
inline constexpr int kMaxStreamsPerConnection = 64;
inline constexpr size_t kMaxTransportMemoryBytes = size_t{16} << 20;

// The bearer token a call carries ("authorization: Bearer <token>"); UNAUTHENTICATED when it
// carries none.
grpc::Status PresentedToken(const grpc::ServerContextBase& context, std::string* token);
// UNAUTHENTICATED unless the call carries "authorization: Bearer <token>".
grpc::Status Authorize(const grpc::ServerContextBase& context, const std::string& token);

// For a request that does not parse as `descriptor`'s message: the first string field (at any
// depth) whose bytes are not UTF-8, as "spec.model_dir (byte 3 (0xff))"; empty when none is
// (the bytes are malformed otherwise). Protobuf refuses such strings while parsing, before any
// handler runs, and gRPC would answer INTERNAL with no message.
std::string FindNonUtf8Field(const std::string& bytes,
                             const google::protobuf::Descriptor* descriptor);

class CoordinatorServer {
 public:
  // Builds and starts the server. `manager` must outlive it. Errors name the address or file.
  static StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options,
                                                            JobManager* manager);
  ~CoordinatorServer();
  int port() const { return port_; }
  // Health turns NOT_SERVING, then in-flight calls get `grace` to finish before cancellation.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(3000));
  void Wait();

 private:
  CoordinatorServer() = default;
  class JobServiceImpl;
  class WorkerServiceImpl;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace qcal::coordinator
