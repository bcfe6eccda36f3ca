// Limits that hold before authentication (issue 18): the real qcal-coordinator (a process of its
// own, so its resident memory is measured alone) under 50 concurrent unauthenticated 15 MB
// SubmitJob calls and 300 unauthenticated streams stays small and keeps serving a client with
// the token, and serves no reflection unless asked.
#include <gtest/gtest.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/atomic_file.h"
#include "proto/qcal.grpc.pb.h"
#include "rpc/auth.h"
#include "tests/test_util.h"

extern char** environ;

namespace qcal {
namespace {

constexpr char kToken[] = "limits-test-token";
constexpr int kMaxThreads = 64;  // the coordinator's --max-threads in these tests

// "VmRSS" / "VmHWM" / "Threads" of /proc/<pid>/status (kB for the memory fields); -1 if absent.
int64_t ProcStatus(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

class CoordinatorLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTempDir("limits");
    const std::string token_file = root_ + "/token";
    ASSERT_TRUE(WriteFileAtomic(token_file, kToken).ok());
    ::chmod(token_file.c_str(), 0600);
    const std::string address_file = root_ + "/address";
    std::vector<std::string> args = {testing::BuildDir() + "/coordinator/qcal-coordinator",
                                     "--listen", "127.0.0.1:0", "--state", root_ + "/state",
                                     "--auth-token-file", token_file, "--address-file",
                                     address_file, "--log-level", "error", "--max-threads",
                                     std::to_string(kMaxThreads)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ASSERT_EQ(::posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ), 0)
        << argv[0];
    for (int i = 0; i < 300 && address_.empty(); ++i) {
      auto a = ReadFile(address_file);
      if (a.ok() && !a->empty()) address_ = a->substr(0, a->find('\n'));
      else std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_FALSE(address_.empty()) << "the coordinator did not write " << address_file;
    auto channel = rpc::MakeChannel(address_);
    ASSERT_TRUE(channel.ok()) << channel.status();
    ASSERT_TRUE(rpc::WaitForHealthy(*channel, std::chrono::seconds(30)).ok());
    channel_ = *channel;
  }
  void TearDown() override {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }

  // A fresh connection (its own HTTP/2 connection, as another client would have) that may send
  // large messages.
  std::shared_ptr<grpc::Channel> NewConnection(int id) {
    grpc::ChannelArguments args;
    args.SetInt("qcal.test_connection_id", id);  // distinct args: no shared subchannel
    args.SetMaxSendMessageSize(-1);
    return grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
  }

  // An authenticated ListJobs: OK within 10 s.
  grpc::Status AuthenticatedList() {
    auto stub = v1::JobService::NewStub(channel_);
    grpc::ClientContext ctx;
    rpc::AddBearerToken(&ctx, kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListJobsRequest req;
    v1::ListJobsResponse resp;
    return stub->ListJobs(&ctx, req, &resp);
  }

  std::string root_;
  pid_t pid_ = -1;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(CoordinatorLimitsTest, UnauthenticatedLargeRequestsStayCheap) {
  const int64_t rss_before = ProcStatus(pid_, "VmRSS");
  // One 15 MB payload shared by every call (a static slice: the test does not hold 50 copies).
  static const std::string payload(15 << 20, 'x');
  constexpr int kCalls = 50;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::GenericClientAsyncResponseReader>> calls;
  std::vector<grpc::ByteBuffer> responses(kCalls);
  std::vector<grpc::Status> statuses(kCalls);
  grpc::CompletionQueue cq;
  for (int i = 0; i < kCalls; ++i) {
    channels.push_back(NewConnection(i));
    stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::Slice slice(payload.data(), payload.size(), grpc::Slice::STATIC_SLICE);
    grpc::ByteBuffer request(&slice, 1);
    calls.push_back(stubs.back()->PrepareUnaryCall(
        contexts.back().get(), "/qcal.v1.JobService/SubmitJob", request, &cq));
    calls.back()->StartCall();
    calls.back()->Finish(&responses[i], &statuses[i], reinterpret_cast<void*>(intptr_t{i}));
  }
  int64_t peak_threads = 0;
  for (int done = 0; done < kCalls; ++done) {
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    peak_threads = std::max(peak_threads, ProcStatus(pid_, "Threads"));
  }
  for (int i = 0; i < kCalls; ++i) {
    // Refused: from the length prefix (RESOURCE_EXHAUSTED), by the missing token
    // (UNAUTHENTICATED), or with its connection closed when the transport's memory quota ran
    // out (UNAVAILABLE, GOAWAY); never accepted.
    EXPECT_TRUE(statuses[i].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                statuses[i].error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                statuses[i].error_code() == grpc::StatusCode::UNAVAILABLE)
        << i << ": " << statuses[i].error_code() << " " << statuses[i].error_message();
  }
  const int64_t hwm_kb = ProcStatus(pid_, "VmHWM");
  std::printf("coordinator: resident %lld kB before, peak %lld kB after %d unauthenticated 15 MB "
              "calls; at most %lld threads\n",
              static_cast<long long>(rss_before), static_cast<long long>(hwm_kb), kCalls,
              static_cast<long long>(peak_threads));
  EXPECT_LT(hwm_kb, 200 * 1024) << "peak resident memory of the coordinator";
  const grpc::Status s = AuthenticatedList();
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

// Opens `n` streams of `method` without a token (and without sending a message) over
// connections of 50 streams each; returns when every stream has started. The caller cancels them.
struct OpenStreams {
  grpc::CompletionQueue cq;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::GenericClientAsyncReaderWriter>> streams;
  ~OpenStreams() {
    for (auto& c : contexts) c->TryCancel();
    cq.Shutdown();
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
    }
  }
};

TEST_F(CoordinatorLimitsTest, UnauthenticatedStreamsStayBounded) {
  constexpr int kStreams = 300;
  auto open = [&](const char* method, int first_id) {
    auto s = std::make_unique<OpenStreams>();
    for (int i = 0; i < kStreams; ++i) {
      if (i % 50 == 0) {
        s->channels.push_back(NewConnection(first_id + i));
        s->stubs.push_back(std::make_unique<grpc::GenericStub>(s->channels.back()));
      }
      s->contexts.push_back(std::make_unique<grpc::ClientContext>());
      s->contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      s->streams.push_back(s->stubs.back()->PrepareCall(s->contexts.back().get(), method, &s->cq));
      s->streams.back()->StartCall(reinterpret_cast<void*>(intptr_t{i}));
    }
    for (int i = 0; i < kStreams; ++i) {
      void* tag = nullptr;
      bool ok = false;
      EXPECT_TRUE(s->cq.Next(&tag, &ok));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return s;
  };
  {
    // qcal's own streaming call, without a token: no thread is held while its request is
    // awaited, and the auth check refuses it before any work once it arrives.
    auto streams = open("/qcal.v1.JobService/WatchJob", 1000);
    const int64_t threads = ProcStatus(pid_, "Threads");
    std::printf("coordinator: %lld threads with %d unauthenticated WatchJob streams open\n",
                static_cast<long long>(threads), kStreams);
    EXPECT_LT(threads, 40);
    const grpc::Status s = AuthenticatedList();
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  }
  {
    // A method the server does not serve — server reflection without --reflection, or any
    // unknown name — is answered UNIMPLEMENTED without holding a thread. (Until this was
    // fixed, linking gRPC's reflection library served reflection whether asked or not, and
    // every such stream held a server thread: 300 streams took the --max-threads cap and
    // authenticated calls were refused with RESOURCE_EXHAUSTED.)
    auto streams =
        open("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", 2000);
    const int64_t threads = ProcStatus(pid_, "Threads");
    std::printf("coordinator: %lld threads with %d unauthenticated unknown-method streams open "
                "(--max-threads %d)\n",
                static_cast<long long>(threads), kStreams, kMaxThreads);
    EXPECT_LT(threads, 40);
    const grpc::Status s = AuthenticatedList();
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  }
}

// Without --reflection the coordinator does not serve reflection: the call ends UNIMPLEMENTED.
TEST_F(CoordinatorLimitsTest, ReflectionIsOffUnlessAsked) {
  grpc::GenericStub stub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace qcal
