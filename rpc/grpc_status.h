// The one place where absl::Status becomes grpc::Status and back (abseil's codes are gRPC's).
#pragma once

#include <string>

#include <grpcpp/support/status.h>

#include "common/status.h"

namespace qcal::rpc {

// Never an error without a message: a status that lost its text says so, with its code.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message(status.message());
  if (message.empty()) {
    message = "error without a message (" + absl::StatusCodeToString(status.code()) + ")";
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), message);
}

// gRPC's own failures (a message that could not be serialised or parsed, a connection that
// dropped) may come without text; those get one naming the code.
inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  std::string message = status.error_message();
  if (message.empty()) {
    message = "the RPC failed with " + absl::StatusCodeToString(code) +
              " and no message (a message that could not be serialised or parsed, or a "
              "connection that broke)";
  }
  return absl::Status(code, message);
}

}  // namespace qcal::rpc
