// The gRPC layer in process: every RPC needs the bearer token, health needs none, errors keep
// their codes and messages, and an open WatchJob stream does not block shutdown.
#include "coordinator/service.h"

#include <chrono>
#include <cstdlib>
#include <set>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "rpc/auth.h"
#include "proto/qcal.grpc.pb.h"
#include "tests/coordinator/fakes.h"
#include "tests/coordinator/test_env.h"

namespace qcal::coordinator {
namespace {

using namespace qcal::rpc;  // NOLINT: the RPC helpers under test

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = testing::TestEnv::Make("service");
    auto store = JobStore::Open(&fs_, "/state");
    ASSERT_TRUE(store.ok());
    ManagerOptions o;
    o.tick_s = 0.05;
    manager_ = std::make_unique<JobManager>(
        o, &clock_, &launcher_,
        [] { return std::make_unique<testing::FakeWorkspace>(
                 std::make_shared<testing::FakeWorkspaceState>()); },
        std::move(*store));
    ASSERT_TRUE(manager_->Start().ok());
    ServerOptions so;
    so.listen = "127.0.0.1:0";
    so.token = kToken;
    so.reflection = true;  // HealthAndReflectionNeedNoToken... reads it
    auto server = CoordinatorServer::Start(so, manager_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    manager_->SetWorkerAddress(address_);
    channel_ = *MakeChannel(address_);
    jobs_ = v1::JobService::NewStub(channel_);
    workers_ = v1::WorkerService::NewStub(channel_);
  }
  void TearDown() override {
    manager_->Shutdown();
    server_->Shutdown();
  }

  testing::TestEnv env_;
  testing::FakeClock clock_;
  testing::FakeLauncher launcher_;
  testing::MemStateFs fs_;
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<CoordinatorServer> server_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

// Calls every RPC of both services with `prepare` applied to its context; returns the codes.
std::vector<std::pair<std::string, grpc::Status>> CallEveryRpc(
    v1::JobService::Stub& jobs, v1::WorkerService::Stub& workers,
    const std::function<void(grpc::ClientContext*)>& prepare) {
  std::vector<std::pair<std::string, grpc::Status>> out;
  auto call = [&](const char* name, auto&& fn) {
    grpc::ClientContext ctx;
    prepare(&ctx);
    out.emplace_back(name, fn(&ctx));
  };
  call("SubmitJob", [&](grpc::ClientContext* c) {
    v1::SubmitJobRequest q;
    v1::SubmitJobResponse r;
    return jobs.SubmitJob(c, q, &r);
  });
  call("GetJob", [&](grpc::ClientContext* c) {
    v1::GetJobRequest q;
    v1::Job r;
    return jobs.GetJob(c, q, &r);
  });
  call("ListJobs", [&](grpc::ClientContext* c) {
    v1::ListJobsRequest q;
    v1::ListJobsResponse r;
    return jobs.ListJobs(c, q, &r);
  });
  call("CancelJob", [&](grpc::ClientContext* c) {
    v1::CancelJobRequest q;
    v1::CancelJobResponse r;
    return jobs.CancelJob(c, q, &r);
  });
  call("WatchJob", [&](grpc::ClientContext* c) {
    v1::WatchJobRequest q;
    auto reader = jobs.WatchJob(c, q);
    v1::JobEvent e;
    while (reader->Read(&e)) {
    }
    return reader->Finish();
  });
  call("RegisterWorker", [&](grpc::ClientContext* c) {
    v1::RegisterWorkerRequest q;
    v1::RegisterWorkerResponse r;
    return workers.RegisterWorker(c, q, &r);
  });
  call("NextTask", [&](grpc::ClientContext* c) {
    v1::NextTaskRequest q;
    v1::Task r;
    return workers.NextTask(c, q, &r);
  });
  call("ReportProgress", [&](grpc::ClientContext* c) {
    v1::ReportProgressRequest q;
    v1::ReportProgressResponse r;
    return workers.ReportProgress(c, q, &r);
  });
  call("CompleteTask", [&](grpc::ClientContext* c) {
    v1::CompleteTaskRequest q;
    v1::CompleteTaskResponse r;
    return workers.CompleteTask(c, q, &r);
  });
  call("FailTask", [&](grpc::ClientContext* c) {
    v1::FailTaskRequest q;
    v1::FailTaskResponse r;
    return workers.FailTask(c, q, &r);
  });
  call("Heartbeat", [&](grpc::ClientContext* c) {
    v1::HeartbeatRequest q;
    v1::HeartbeatResponse r;
    return workers.Heartbeat(c, q, &r);
  });
  return out;
}


// The raw answer of server reflection's list_services (a ServerReflectionResponse), through a
// generic bidi call: the reflection stubs are not installed, the bytes are enough.
std::string ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  void* tag;
  bool ok = false;
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  std::string out;
  if (ok) {
    const std::string request("\x3a\x00", 2);  // ServerReflectionRequest{list_services: ""}
    grpc::Slice slice(request);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    grpc::ByteBuffer response;
    call->Read(&response, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    std::vector<grpc::Slice> slices;
    if (ok && response.Dump(&slices).ok()) {
      for (const auto& sl : slices) out.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return out;
}

TEST_F(ServiceTest, EveryRpcRefusesCallsWithoutTheToken) {
  const std::vector<std::pair<const char*, std::function<void(grpc::ClientContext*)>>> cases = {
      {"no metadata", [](grpc::ClientContext*) {}},
      {"wrong token", [](grpc::ClientContext* c) { AddBearerToken(c, "not-the-token-at-all!"); }},
      {"token prefix", [](grpc::ClientContext* c) { AddBearerToken(c, "0123456789abcdef"); }},
      {"not bearer", [](grpc::ClientContext* c) { c->AddMetadata("authorization", kToken); }},
  };
  for (const auto& [what, prepare] : cases) {
    auto results = CallEveryRpc(*jobs_, *workers_, prepare);
    ASSERT_EQ(results.size(), 11u);
    for (const auto& [rpc, status] : results) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << rpc << " with " << what << ": " << status.error_message();
    }
  }
  // With the token the same (empty) client requests get past authentication; the worker calls
  // do not: workers use their job's own credential, never a client token.
  auto results = CallEveryRpc(*jobs_, *workers_,
                              [](grpc::ClientContext* c) { AddBearerToken(c, kToken); });
  const std::set<std::string> worker_rpcs = {"RegisterWorker", "NextTask",  "ReportProgress",
                                             "CompleteTask",   "FailTask", "Heartbeat"};
  for (const auto& [rpc, status] : results) {
    if (worker_rpcs.count(rpc)) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << rpc << ": " << status.error_message();
    } else {
      EXPECT_NE(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << rpc << ": " << status.error_message();
    }
  }
  EXPECT_TRUE(manager_->List().empty());  // nothing was submitted by refused calls
}

TEST_F(ServiceTest, HealthAndReflectionNeedNoTokenAndErrorsKeepTheirMessages) {
  EXPECT_TRUE(WaitForHealthy(channel_, std::chrono::seconds(5)).ok());
  const std::string services = ReflectionListServices(channel_);
  EXPECT_NE(services.find("qcal.v1.JobService"), std::string::npos) << services;
  EXPECT_NE(services.find("qcal.v1.WorkerService"), std::string::npos) << services;
  EXPECT_NE(services.find("grpc.health.v1.Health"), std::string::npos) << services;

  grpc::ClientContext ctx;
  AddBearerToken(&ctx, kToken);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = env_.Spec(2);
  req.mutable_spec()->set_model_dir(env_.root + "/no-such-model");
  v1::SubmitJobResponse resp;
  grpc::Status s = jobs_->SubmitJob(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "model_dir '" + env_.root + "/no-such-model' does not exist");

  grpc::ClientContext ctx2;
  AddBearerToken(&ctx2, kToken);
  v1::GetJobRequest get;
  get.set_job_id("job-000042");
  v1::Job job;
  s = jobs_->GetJob(&ctx2, get, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "unknown job 'job-000042'");
}

TEST_F(ServiceTest, SubmitWatchAndCancelOverTheWire) {
  grpc::ClientContext ctx;
  AddBearerToken(&ctx, kToken);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = env_.Spec(1);
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(jobs_->SubmitJob(&ctx, req, &resp).ok());
  const std::string id = resp.job_id();

  std::vector<v1::JobEvent> events;
  std::thread watcher([&] {
    grpc::ClientContext wctx;
    AddBearerToken(&wctx, kToken);
    v1::WatchJobRequest w;
    w.set_job_id(id);
    auto reader = jobs_->WatchJob(&wctx, w);
    v1::JobEvent e;
    while (reader->Read(&e)) events.push_back(e);
    EXPECT_TRUE(reader->Finish().ok());
  });
  // Wait until the job runs, then cancel it.
  for (int i = 0; i < 400; ++i) {
    if (manager_->Get(id)->state() == v1::JOB_STATE_RUNNING) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  grpc::ClientContext cctx;
  AddBearerToken(&cctx, kToken);
  v1::CancelJobRequest c;
  c.set_job_id(id);
  v1::CancelJobResponse cr;
  ASSERT_TRUE(jobs_->CancelJob(&cctx, c, &cr).ok());
  EXPECT_EQ(cr.job().state(), v1::JOB_STATE_CANCELLED);
  watcher.join();  // the stream ends with the job
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().state(), v1::JOB_STATE_CANCELLED);
}

// A string protobuf refuses to parse (not UTF-8) is INVALID_ARGUMENT naming the field, after
// the token check, not gRPC's INTERNAL with an empty message; a good submit still works.
TEST_F(ServiceTest, SubmitJobWithNonUtf8StringsNamesTheField) {
  v1::SubmitJobRequest req;
  *req.mutable_spec() = env_.Spec(1);
  req.mutable_spec()->set_name(std::string("job \xff\xfe", 6));
  {
    grpc::ClientContext ctx;  // no token: refused first, revealing nothing about the request
    v1::SubmitJobResponse resp;
    EXPECT_EQ(jobs_->SubmitJob(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  for (const char* field : {"name", "model_dir", "recipe_yaml"}) {
    v1::SubmitJobRequest bad;
    *bad.mutable_spec() = env_.Spec(1);
    const std::string broken = std::string("x\xc3(", 3);
    if (std::string(field) == "name") bad.mutable_spec()->set_name(broken);
    if (std::string(field) == "model_dir") bad.mutable_spec()->set_model_dir(broken);
    if (std::string(field) == "recipe_yaml") bad.mutable_spec()->set_recipe_yaml(broken);
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, kToken);
    v1::SubmitJobResponse resp;
    const grpc::Status s = jobs_->SubmitJob(&ctx, bad, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << ": "
                                                                  << s.error_message();
    EXPECT_NE(s.error_message().find(std::string("spec.") + field + " (line 1, byte 2 (0xc3))"),
              std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find("is not valid UTF-8"), std::string::npos)
        << s.error_message();
  }
  EXPECT_EQ(FindNonUtf8Field("\x0a\x02\x08\x01", v1::SubmitJobRequest::descriptor()), "");
  grpc::ClientContext ctx;
  AddBearerToken(&ctx, kToken);
  v1::SubmitJobRequest good;
  *good.mutable_spec() = env_.Spec(1);
  v1::SubmitJobResponse resp;
  const grpc::Status ok = jobs_->SubmitJob(&ctx, good, &resp);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_FALSE(resp.job_id().empty());
}

TEST_F(ServiceTest, ShutdownDoesNotWaitForeverOnOpenWatchStreams) {
  grpc::ClientContext ctx;
  AddBearerToken(&ctx, kToken);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = env_.Spec(1);
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(jobs_->SubmitJob(&ctx, req, &resp).ok());
  std::vector<std::thread> watchers;
  std::atomic<int> ended{0};
  for (int i = 0; i < 8; ++i) {
    watchers.emplace_back([&] {
      grpc::ClientContext wctx;
      AddBearerToken(&wctx, kToken);
      v1::WatchJobRequest w;
      w.set_job_id(resp.job_id());
      auto reader = jobs_->WatchJob(&wctx, w);
      v1::JobEvent e;
      while (reader->Read(&e)) {
      }
      reader->Finish();
      ++ended;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  manager_->Shutdown();
  server_->Shutdown(std::chrono::milliseconds(2000));
  for (auto& t : watchers) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ended.load(), 8);
  EXPECT_LT(seconds, 5.0);
}

TEST(AuthTest, TokenFilesAreChecked) {
  const std::string dir = qcal::testing::MakeTempDir("token");
  ASSERT_TRUE(WriteFileAtomic(dir + "/short", "abc\n").ok());
  auto t = ReadTokenFile(dir + "/short");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.status().message(),
            dir + "/short: the auth token must be at least 16 characters (found 3)");
  ASSERT_TRUE(WriteFileAtomic(dir + "/good", "  0123456789abcdef0123\n").ok());
  EXPECT_EQ(*ReadTokenFile(dir + "/good"), "0123456789abcdef0123");
  EXPECT_EQ(ReadTokenFile(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
  auto fresh = NewRandomToken();
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->size(), 64u);
  EXPECT_NE(*fresh, *NewRandomToken());
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
}


// TLS: a client that trusts the server's certificate gets through; a plaintext client does not;
// with a client CA, a client without a certificate is refused.
TEST(TlsTest, ServesTlsAndOptionallyRequiresClientCertificates) {
  if (!qcal::testing::HaveOpenssl()) GTEST_SKIP() << "no openssl CLI";
  const std::string dir = qcal::testing::MakeTempDir("tls");
  for (const char* who : {"server", "client"}) {
    ASSERT_TRUE(qcal::testing::MakeSelfSignedCert(dir, who)) << who;
  }
  testing::FakeClock clock;
  testing::FakeLauncher launcher;
  testing::MemStateFs fs;
  for (bool mutual : {false, true}) {
    auto store = JobStore::Open(&fs, "/state");
    ASSERT_TRUE(store.ok());
    JobManager manager(ManagerOptions(), &clock, &launcher, nullptr, std::move(*store));
    ASSERT_TRUE(manager.Start().ok());
    ServerOptions so;
    so.listen = "127.0.0.1:0";
    so.token = kToken;
    so.tls_cert_file = dir + "/server.pem";
    so.tls_key_file = dir + "/server.key";
    if (mutual) so.tls_client_ca_file = dir + "/client.pem";
    auto server = CoordinatorServer::Start(so, &manager);
    ASSERT_TRUE(server.ok()) << server.status();
    const std::string address = "localhost:" + std::to_string((*server)->port());
    auto list = [&](const ClientTls& tls) {
      auto channel = MakeChannel(address, tls);
      EXPECT_TRUE(channel.ok());
      auto stub = v1::JobService::NewStub(*channel);
      grpc::ClientContext ctx;
      AddBearerToken(&ctx, kToken);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::ListJobsResponse resp;
      return stub->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    };
    ClientTls server_only{dir + "/server.pem", "", ""};
    ClientTls with_cert{dir + "/server.pem", dir + "/client.pem", dir + "/client.key"};
    EXPECT_EQ(list({}).error_code(), grpc::StatusCode::UNAVAILABLE) << "plaintext to a TLS server";
    if (mutual) {
      EXPECT_EQ(list(server_only).error_code(), grpc::StatusCode::UNAVAILABLE)
          << "no client certificate";
      grpc::Status ok = list(with_cert);
      EXPECT_TRUE(ok.ok()) << ok.error_message();
    } else {
      grpc::Status ok = list(server_only);
      EXPECT_TRUE(ok.ok()) << ok.error_message();
    }
    manager.Shutdown();
    (*server)->Shutdown();
  }
}

}  // namespace
}  // namespace qcal::coordinator
