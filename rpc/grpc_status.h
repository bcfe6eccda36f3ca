// The one place where absl::Status becomes grpc::Status and back (abseil's codes are gRPC's).
#pragma once

#include <string>

#include <grpcpp/support/status.h>

#include "common/status.h"

namespace qcal::rpc {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace qcal::rpc
