#include "rpc/auth.h"

#include <sys/stat.h>

#include <fstream>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/log.h"

namespace qcal::rpc {

StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("no auth token file given");
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  const size_t begin = text.find_first_not_of(" \t\r\n");
  const size_t end = text.find_last_not_of(" \t\r\n");
  std::string token = begin == std::string::npos ? "" : text.substr(begin, end - begin + 1);
  if (token.size() < 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": the auth token must be at least 16 characters (found ", token.size(), ")"));
  }
  for (unsigned char c : token) {
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": the auth token must be printable ASCII without spaces"));
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    QCAL_LOG_WARN("{}: the auth token file is readable by other users (chmod 600 it)", path);
  }
  return token;
}

StatusOr<std::string> NewRandomToken() {
  std::ifstream f("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!f.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return absl::UnavailableError("/dev/urandom: cannot read random bytes");
  }
  static const char* hex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(hex[b >> 4]);
    token.push_back(hex[b & 15]);
  }
  return token;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::string& longer = a.size() >= b.size() ? a : b;
  for (size_t i = 0; i < longer.size(); ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

void AddBearerToken(grpc::ClientContext* context, const std::string& token) {
  context->AddMetadata("authorization", "Bearer " + token);
}

StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                     const ClientTls& tls) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (tls.ca_file.empty()) {
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions ssl;
  QCAL_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(tls.ca_file));
  if (!tls.cert_file.empty()) {
    QCAL_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(tls.cert_file));
    QCAL_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(tls.key_file));
  }
  return grpc::CreateCustomChannel(address, grpc::SslCredentials(ssl), args);
}

Status WaitForHealthy(const std::shared_ptr<grpc::Channel>& channel,
                      std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::system_clock::now() + timeout;
  grpc::GenericStub stub(channel);
  std::string last = "no answer";
  while (std::chrono::system_clock::now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::min(deadline, std::chrono::system_clock::now() +
                                                std::chrono::seconds(2)));
    context.set_wait_for_ready(true);
    grpc::CompletionQueue cq;
    // HealthCheckRequest{service: ""} serializes to zero bytes.
    grpc::ByteBuffer request, response;
    grpc::Slice empty("");
    request = grpc::ByteBuffer(&empty, 1);
    auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &cq);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    if (status.ok()) {
      std::vector<grpc::Slice> slices;
      std::string bytes;
      if (response.Dump(&slices).ok()) {
        for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      // HealthCheckResponse{status: SERVING (1)} is field 1, varint 1: bytes 08 01.
      if (bytes == std::string("\x08\x01", 2)) return absl::OkStatus();
      last = "not serving yet";
    } else {
      last = status.error_message();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("the coordinator did not become healthy in ", timeout.count(), " ms: ", last));
}

}  // namespace qcal::rpc
