// The CLI's job views against a fake coordinator (tests/client/fake_job_client.h): the watcher
// reconnects from the last event after a broken stream without repeating events, stops on errors
// that a retry cannot fix, and gives up after 10 broken streams in a row; the perplexity table of
// `qcal run` is made from the evaluations the workers reported in the job.
#include "client/job_view.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/client/fake_job_client.h"

namespace qcal::client {
namespace {

using testing::FakeJobClient;

int CountOf(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + 1)) {
    ++n;
  }
  return n;
}

TEST(JobWatcherTest, ReconnectsAfterABrokenStreamWithoutRepeatingEvents) {
  FakeJobClient client;
  client.AddJob("j1", v1::JOB_STATE_SUCCEEDED, {"e1", "e2", "e3", "e4", "e5"});
  client.scripts.push_back({3, absl::UnavailableError("connection reset")});
  client.scripts.push_back({1, absl::UnavailableError("connection reset")});
  JobWatcher watcher(client, /*json=*/true);
  watcher.set_reconnect_delay(std::chrono::milliseconds(0));
  ::testing::internal::CaptureStdout();
  auto job = watcher.Follow("j1");
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(client.watch_after_seq, (std::vector<int64_t>{0, 3, 4}));
  for (const char* e : {"\"e1\"", "\"e2\"", "\"e3\"", "\"e4\"", "\"e5\""}) {
    EXPECT_EQ(CountOf(out, e), 1) << e << " in\n" << out;
  }
}

TEST(JobWatcherTest, AnErrorARetryCannotFixEndsTheWatch) {
  FakeJobClient client;
  client.AddJob("j1", v1::JOB_STATE_RUNNING, {"e1"});
  client.scripts.push_back({0, absl::UnauthenticatedError("invalid bearer token")});
  JobWatcher watcher(client, true);
  watcher.set_reconnect_delay(std::chrono::milliseconds(0));
  auto job = watcher.Follow("j1");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client.watch_after_seq.size(), 1u);
}

TEST(JobWatcherTest, GivesUpAfterTenBrokenStreamsInARow) {
  FakeJobClient client;
  client.AddJob("j1", v1::JOB_STATE_RUNNING, {});
  for (int i = 0; i < 20; ++i) client.scripts.push_back({0, absl::UnavailableError("down")});
  JobWatcher watcher(client, true);
  watcher.set_reconnect_delay(std::chrono::milliseconds(0));
  auto job = watcher.Follow("j1");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(job.status().message().find("lost the event stream of j1"), std::string::npos);
  EXPECT_EQ(client.watch_after_seq.size(), 11u);
}

TEST(JobWatcherTest, AStreamThatEndsBeforeTheJobIsFinalIsFollowedAgain) {
  FakeJobClient client;
  client.AddJob("j1", v1::JOB_STATE_RUNNING, {"e1", "e2"});
  client.scripts.push_back({1, Status()});  // the first stream ends after e1, job still running
  client.after_watch = [&](size_t call) {
    if (call == 1) client.jobs["j1"].set_state(v1::JOB_STATE_FAILED);
  };
  JobWatcher watcher(client, true);
  watcher.set_reconnect_delay(std::chrono::milliseconds(0));
  ::testing::internal::CaptureStdout();
  auto job = watcher.Follow("j1");
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(ExitCodeFor(job->state()), 1);
  EXPECT_EQ(client.watch_after_seq, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(CountOf(out, "\"e2\""), 1) << out;
}

v1::EvalResult Eval(const std::string& model, const std::string& label, double ppl,
                    int64_t scored) {
  v1::EvalResult e;
  e.mutable_params()->set_model(model);
  e.mutable_params()->set_label(label);
  e.mutable_params()->set_path("/data/" + label + ".txt");
  e.mutable_params()->set_ctx(512);
  e.mutable_params()->set_max_tokens(-1);
  e.set_scored(scored);
  e.set_perplexity(ppl);
  return e;
}

TEST(EvalTableTest, OneRowPerFileWithTheWorkersPerplexities) {
  v1::Job job;
  *job.add_evals() = Eval("float", "wikitext2", 12.5, 1000);
  *job.add_evals() = Eval("float", "tinystories", 3.25, 2000);
  *job.add_evals() = Eval("quantized", "wikitext2", 14.0625, 1000);
  *job.add_evals() = Eval("quantized", "tinystories", 3.5, 2000);
  ::testing::internal::CaptureStdout();
  PrintEvalTable(job);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(out,
            "\nperplexity (ctx 512, non-overlapping windows)\n"
            "data               tokens        float    quantized\n"
            "wikitext2            1000      12.5000      14.0625\n"
            "tinystories          2000       3.2500       3.5000\n");
  const nlohmann::json j = JobToJson(job);
  ASSERT_EQ(j["evals"].size(), 4u);
  EXPECT_EQ(j["evals"][2]["model"], "quantized");
  EXPECT_EQ(j["evals"][2]["perplexity"], 14.0625);

  v1::Job none;
  ::testing::internal::CaptureStdout();
  PrintEvalTable(none);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
}

TEST(EvalTableTest, AMissingQuantizedRowShowsNan) {
  v1::Job job;
  *job.add_evals() = Eval("float", "ptb", 20.0, 10);
  ::testing::internal::CaptureStdout();
  PrintEvalTable(job);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("ptb"), std::string::npos);
  EXPECT_NE(out.find("nan"), std::string::npos) << out;
}

}  // namespace
}  // namespace qcal::client

namespace qcal::client {
namespace {

// Strings other people chose reach this terminal escaped: no newline starts a fake line, no
// escape sequence clears or recolours the screen.
TEST(ShownTest, ControlCharactersAreEscapedAndTheRestIsKept) {
  EXPECT_EQ(Shown("/scratch/a\nmallory::0:0"), "/scratch/a\\x0amallory::0:0");
  EXPECT_EQ(Shown("\x1b[2Jq\x7f"), "\\x1b[2Jq\\x7f");
  EXPECT_EQ(Shown("/data/modèle-ü"), "/data/modèle-ü");  // UTF-8 stays readable
}

}  // namespace
}  // namespace qcal::client
