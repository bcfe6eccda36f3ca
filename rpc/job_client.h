// The client side of qcal.v1.JobService, behind an interface: the CLI's service commands use it,
// and tests can drive them with a fake. Every call carries the bearer token; unary calls have a
// deadline. Errors keep gRPC's code (abseil's codes are gRPC's); an unreachable coordinator is
// Unavailable naming its address.
//
// Thread-safety: a client may be used from several threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/status.h"
#include "proto/qcal.pb.h"
#include "rpc/auth.h"

namespace qcal::rpc {

class JobClient {
 public:
  virtual ~JobClient() = default;
  virtual StatusOr<std::string> Submit(const v1::JobSpec& spec) = 0;  // the job id
  virtual StatusOr<v1::Job> Get(const std::string& job_id) = 0;
  virtual StatusOr<std::vector<v1::Job>> List() = 0;
  virtual StatusOr<v1::Job> Cancel(const std::string& job_id) = 0;
  // One WatchJob stream: `on_event` for every event after `after_seq`, until the job ends (OK),
  // `on_event` returns false (Cancelled) or the stream breaks (its status).
  virtual Status Watch(const std::string& job_id, int64_t after_seq,
                       const std::function<bool(const v1::JobEvent&)>& on_event) = 0;
};

struct JobClientOptions {
  std::string address;  // host:port
  std::string token;
  ClientTls tls;
  std::chrono::seconds deadline{30};  // of unary calls
};

// Over gRPC. Errors: unreadable TLS files.
StatusOr<std::unique_ptr<JobClient>> MakeGrpcJobClient(const JobClientOptions& options);

}  // namespace qcal::rpc
