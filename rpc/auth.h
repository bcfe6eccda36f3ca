// Bearer-token authentication for every qcal.v1 RPC ("authorization: Bearer <token>" metadata),
// and the TLS credentials of both ends. Shared by the coordinator, the client and the workers
// (library qcal_service_client: no LibTorch, no coordinator internals).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace qcal::rpc {

// The token in `path` (surrounding whitespace trimmed). InvalidArgument when empty or shorter
// than 16 characters; NotFound / PermissionDenied name the file. Logs a warning when the file
// is readable by group or others.
StatusOr<std::string> ReadTokenFile(const std::string& path);

// A fresh random token (32 bytes from /dev/urandom, hex).
StatusOr<std::string> NewRandomToken();

// Compares in time independent of where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// Attaches the bearer token to a call.
void AddBearerToken(grpc::ClientContext* context, const std::string& token);

struct ClientTls {
  std::string ca_file;    // empty: plaintext
  std::string cert_file;  // client certificate (mutual TLS), optional
  std::string key_file;
};
// A channel to `address` (host:port), plaintext or TLS. Errors name unreadable files.
StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                     const ClientTls& tls = {});

// Polls the standard gRPC health service (grpc.health.v1.Health/Check, service "") until it
// answers SERVING or `timeout` passes. Unavailable / DeadlineExceeded otherwise.
Status WaitForHealthy(const std::shared_ptr<grpc::Channel>& channel,
                      std::chrono::milliseconds timeout);

}  // namespace qcal::rpc
