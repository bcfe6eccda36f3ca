// Identities (issue 51): a tokens file maps tokens to users with roles and directory roots; jobs
// belong to their submitter; workers authenticate with their job's own credential, never a
// client token; active jobs' directories cannot collide; control characters are refused.
#include "coordinator/identity.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "coordinator/service.h"
#include "proto/qcal.grpc.pb.h"
#include "rpc/auth.h"
#include "tests/coordinator/fakes.h"
#include "tests/coordinator/test_env.h"

namespace qcal::coordinator {
namespace {

namespace fs = std::filesystem;
using rpc::AddBearerToken;

constexpr char kAlice[] = "alice-token-0123456789";
constexpr char kBob[] = "bob-token-0123456789abc";
constexpr char kAdmin[] = "admin-token-0123456789";

std::string Message(const Status& s) { return std::string(s.message()); }

TEST(TokenTableTest, LoadsUsersAndRefusesBadEntriesByName) {
  const std::string dir = qcal::testing::MakeTempDir("tokens");
  const std::string path = dir + "/tokens.yaml";
  ASSERT_TRUE(WriteFileAtomic(path, absl::StrCat(
      "users:\n"
      "  - {name: alice, token: ", kAlice, ", read: [", dir, "], write: [", dir, "/w]}\n"
      "  - {name: root, token: ", kAdmin, ", role: admin}\n")).ok());
  StatusOr<TokenTable> t = TokenTable::Load(path);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  const Principal* alice = t->Find(kAlice);
  ASSERT_NE(alice, nullptr);
  EXPECT_EQ(alice->name, "alice");
  EXPECT_FALSE(alice->admin);
  EXPECT_EQ(alice->write_roots, std::vector<std::string>{fs::canonical(dir).string() + "/w"});
  const Principal* admin = t->Find(kAdmin);
  ASSERT_NE(admin, nullptr);
  EXPECT_TRUE(admin->admin);
  EXPECT_EQ(admin->write_roots, std::vector<std::string>{"/"});
  EXPECT_EQ(t->Find("alice-token-012345678"), nullptr);  // a prefix
  EXPECT_EQ(t->Find(""), nullptr);

  const std::pair<std::string, std::string> bad[] = {
      {"users:\n  - {name: bob, token: short}\n", "at least 16 characters"},
      {absl::StrCat("users:\n  - {name: bob, token: ", kBob, "}\n"), "needs 'read' and 'write'"},
      {absl::StrCat("users:\n  - {name: bob, token: ", kBob, ", role: root}\n"),
       "role must be user or admin"},
      {absl::StrCat("users:\n  - {name: bob, token: ", kBob, ", role: admin, rootz: 1}\n"),
       "unknown key 'rootz'"},
      {absl::StrCat("users:\n  - {name: a, token: ", kBob, ", role: admin}\n  - {name: b, token: ",
                    kBob, ", role: admin}\n"),
       "same as another user's"},
      {absl::StrCat("users:\n  - {name: 'bad name', token: ", kBob, ", role: admin}\n"),
       "name must be"},
      {"users: []\n", "at least one entry"},
  };
  for (const auto& [text, phrase] : bad) {
    ASSERT_TRUE(WriteFileAtomic(path, text).ok());
    StatusOr<TokenTable> r = TokenTable::Load(path);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(Message(r.status()).find(phrase), std::string::npos) << r.status();
    EXPECT_NE(Message(r.status()).find(path), std::string::npos) << r.status();
  }
}

// The gRPC service over a manager with fakes, with three users: alice and bob (each with their
// own directories) and an admin.
class IdentityServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = testing::TestEnv::Make("identity");
    bob_root_ = env_.root + "/bob";
    ASSERT_TRUE(MakeDirs(bob_root_).ok());
    const std::string tokens = env_.root + "/tokens.yaml";
    ASSERT_TRUE(WriteFileAtomic(tokens, absl::StrCat(
        "users:\n"
        "  - {name: alice, token: ", kAlice, ", read: [", env_.model_dir, ", ", env_.data_root,
        "], write: [", env_.root, "/out, ", env_.root, "/out.job, ", env_.root, "/alice]}\n"
        "  - {name: bob, token: ", kBob, ", read: [", env_.root, "], write: [", bob_root_, "]}\n"
        "  - {name: ops, token: ", kAdmin, ", role: admin}\n")).ok());
    fs::permissions(tokens, fs::perms::owner_read | fs::perms::owner_write);
    auto table = TokenTable::Load(tokens);
    ASSERT_TRUE(table.ok()) << table.status();
    auto store = JobStore::Open(&fs_, "/state");
    ASSERT_TRUE(store.ok());
    ManagerOptions o;
    o.tick_s = 0.05;
    o.state_dir = env_.root + "/state";
    manager_ = std::make_unique<JobManager>(
        o, &clock_, &launcher_,
        [] { return std::make_unique<testing::FakeWorkspace>(
                 std::make_shared<testing::FakeWorkspaceState>()); },
        std::move(*store));
    ASSERT_TRUE(manager_->Start().ok());
    ServerOptions so;
    so.listen = "127.0.0.1:0";
    so.tokens = std::move(*table);
    auto server = CoordinatorServer::Start(so, manager_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    const std::string address = "127.0.0.1:" + std::to_string(server_->port());
    manager_->SetWorkerAddress(address);
    auto channel = *rpc::MakeChannel(address);
    jobs_ = v1::JobService::NewStub(channel);
    workers_ = v1::WorkerService::NewStub(channel);
  }
  void TearDown() override {
    manager_->Shutdown();
    server_->Shutdown();
  }
  grpc::Status Submit(const char* token, const v1::JobSpec& spec, std::string* id = nullptr) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, req, &resp);
    if (id) *id = resp.job_id();
    return s;
  }
  grpc::Status Get(const char* token, const std::string& id, v1::Job* job) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::GetJobRequest req;
    req.set_job_id(id);
    return jobs_->GetJob(&ctx, req, job);
  }
  int List(const char* token) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::ListJobsResponse resp;
    EXPECT_TRUE(jobs_->ListJobs(&ctx, v1::ListJobsRequest(), &resp).ok());
    return resp.jobs_size();
  }
  grpc::Status Cancel(const char* token, const std::string& id) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::CancelJobRequest req;
    req.set_job_id(id);
    v1::CancelJobResponse resp;
    return jobs_->CancelJob(&ctx, req, &resp);
  }
  grpc::Status Watch(const char* token, const std::string& id) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent e;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (reader->Read(&e)) ctx.TryCancel();  // streaming: it was allowed
    return reader->Finish();
  }
  std::string CredentialOf(const std::string& id) {
    for (int i = 0; i < 200; ++i) {
      const std::string c = manager_->WorkerCredentialOf(id);
      if (!c.empty()) return c;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "";
  }

  testing::TestEnv env_;
  std::string bob_root_;
  testing::FakeClock clock_;
  testing::FakeLauncher launcher_;
  testing::MemStateFs fs_;
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

#define ASSERT_SUBMITTED(token, spec, id)          \
  do {                                             \
    grpc::Status submitted = Submit(token, spec, id); \
    ASSERT_TRUE(submitted.ok()) << submitted.error_message(); \
  } while (0)

TEST_F(IdentityServiceTest, JobsBelongToTheirSubmitterAndOthersCannotSeeOrCancelThem) {
  std::string id;
  ASSERT_SUBMITTED(kAlice, env_.Spec(1), &id);
  v1::Job job;
  ASSERT_TRUE(Get(kAlice, id, &job).ok());
  EXPECT_EQ(job.owner(), "alice");
  EXPECT_EQ(List(kAlice), 1);
  // Bob: the job does not exist for him (the same answer as an unknown id).
  EXPECT_EQ(List(kBob), 0);
  grpc::Status s = Get(kBob, id, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(s.error_message().find(env_.out_dir), std::string::npos);
  EXPECT_EQ(Cancel(kBob, id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Watch(kBob, id).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(Get(kAlice, id, &job).ok());
  EXPECT_FALSE(rpc::IsFinalState(job.state())) << "bob's cancel reached the job";
  // The admin sees every job and may cancel it.
  EXPECT_EQ(List(kAdmin), 1);
  ASSERT_TRUE(Cancel(kAdmin, id).ok());
  ASSERT_TRUE(Get(kAlice, id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(IdentityServiceTest, PathsOutsideTheUsersRootsAreRefusedNamingThem) {
  v1::JobSpec spec = env_.Spec(1, bob_root_ + "/q");  // bob's directory, alice's token
  grpc::Status s = Submit(kAlice, spec);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("out_dir '" + bob_root_ + "/q' is outside the directories "
                                   "user 'alice' may write"),
            std::string::npos)
      << s.error_message();
  // A model file that links to something the user may not read (the workers would read it).
  const std::string secret = bob_root_ + "/secret.safetensors";
  ASSERT_TRUE(WriteFileAtomic(secret, "x").ok());
  fs::create_symlink(secret, env_.model_dir + "/extra.safetensors");
  s = Submit(kAlice, env_.Spec(1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("extra.safetensors resolves to a file outside"),
            std::string::npos)
      << s.error_message();
}

TEST_F(IdentityServiceTest, WorkersUseTheirJobsCredentialNeverAClientToken) {
  std::string id, other;
  ASSERT_SUBMITTED(kAlice, env_.Spec(1), &id);
  ASSERT_SUBMITTED(kAdmin, env_.Spec(1, env_.root + "/alice/second"), &other);
  const std::string credential = CredentialOf(id);
  ASSERT_FALSE(credential.empty()) << "the job was never launched";
  ASSERT_NE(credential, CredentialOf(other));
  auto register_as = [&](const std::string& token, const std::string& job) {
    grpc::ClientContext ctx;
    AddBearerToken(&ctx, token);
    v1::RegisterWorkerRequest req;
    req.set_job_id(job);
    req.set_world_size(1);
    req.set_hostname("test");
    v1::RegisterWorkerResponse resp;
    return workers_->RegisterWorker(&ctx, req, &resp);
  };
  for (const char* client : {kAlice, kAdmin}) {
    grpc::Status s = register_as(client, id);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  grpc::Status s = register_as(credential, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = register_as(credential, id);
  EXPECT_TRUE(s.ok()) << s.error_message();
  // The credential opens no client call.
  EXPECT_EQ(Cancel(credential.c_str(), id).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(IdentityServiceTest, DirectoriesOfActiveJobsAndTheStateDirectoryCannotBeShared) {
  std::string id;
  ASSERT_SUBMITTED(kAlice, env_.Spec(1), &id);
  // Inside the running job's staging area, its job directory, or containing its output.
  for (const std::string& out :
       {env_.out_dir + "/.staging/b", env_.out_dir + ".job/b", env_.out_dir}) {
    grpc::Status s = Submit(kAdmin, env_.Spec(1, out));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << out;
    EXPECT_NE(s.error_message().find("of job " + id), std::string::npos) << s.error_message();
  }
  // A job directory that contains another active job's output.
  std::string inner;
  ASSERT_SUBMITTED(kAlice, env_.Spec(1, env_.root + "/alice/inner/o"), &inner);
  v1::JobSpec contains = env_.Spec(1, env_.root + "/alice/x");
  contains.set_job_dir(env_.root + "/alice/inner");
  grpc::Status c = Submit(kAdmin, contains);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << c.error_message();
  EXPECT_NE(c.error_message().find("contains the out_dir"), std::string::npos)
      << c.error_message();
  // Bob is told which job, not its paths.
  grpc::Status s = Submit(kBob, env_.Spec(1, bob_root_ + "/q"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  // The coordinator's own state directory.
  s = Submit(kAdmin, env_.Spec(1, env_.root + "/state/jobs-out"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("state directory"), std::string::npos) << s.error_message();
}

TEST_F(IdentityServiceTest, AFinishedCheckpointIsReplacedOnlyWhenTheRequestSaysOverwrite) {
  // A checkpoint in out_dir that the job directory's journal did not write (a fresh job_dir).
  const std::string out = env_.root + "/alice/done";
  ASSERT_TRUE(MakeDirs(out).ok());
  ASSERT_TRUE(WriteFileAtomic(out + "/config.json", testing::kTinyConfig).ok());
  v1::JobSpec spec = env_.Spec(1, out);
  spec.set_job_dir(env_.root + "/alice/fresh.job");
  grpc::Status s = Submit(kAlice, spec);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("already holds a checkpoint that job directory '" +
                                   env_.root + "/alice/fresh.job' did not write"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("pass --overwrite"), std::string::npos);
  spec.set_overwrite(true);
  std::string id;
  ASSERT_SUBMITTED(kAlice, spec, &id);
  v1::Job job;
  ASSERT_TRUE(Get(kAlice, id, &job).ok());
  EXPECT_TRUE(job.spec().overwrite()) << "the job records that it may replace the checkpoint";
}

TEST_F(IdentityServiceTest, AJobIdThatIsNotUtf8IsNamedNotAnEmptyInternalError) {
  v1::Job job;
  grpc::Status s = Get(kAlice, "job-\xff", &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("GetJob: job_id (line 1, byte 5 (0xff)) is not valid UTF-8"),
            std::string::npos)
      << s.error_message();
  s = Cancel(kAlice, "\xc3");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  s = Watch(kAlice, "\xfe");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
}

TEST_F(IdentityServiceTest, ControlCharactersAreRefusedInEveryString) {
  for (const std::string& out : {env_.root + "/alice/a\nmallory::0:0::/root:/bin/bash",
                                 env_.root + "/alice/\x1b[2J"}) {
    grpc::Status s = Submit(kAlice, env_.Spec(1, out));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("out_dir contains a control character"), std::string::npos)
        << s.error_message();
  }
  v1::JobSpec spec = env_.Spec(1, env_.root + "/alice/n");
  spec.set_name("evil\x07");
  EXPECT_EQ(Submit(kAlice, spec).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace qcal::coordinator
