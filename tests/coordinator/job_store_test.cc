// The job store: records survive a restart, ids keep growing, bad records do not stop it.
#include "coordinator/job_store.h"

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "tests/coordinator/fakes.h"
#include "tests/test_util.h"

namespace qcal::coordinator {
namespace {

v1::Job MakeJob(const std::string& id, v1::JobState state) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  job.set_phase("quantize");
  job.mutable_spec()->set_model_dir("/models/m");
  job.mutable_spec()->set_out_dir("/out/q");
  job.mutable_spec()->set_workers(3);
  job.set_blocks_total(5);
  job.set_blocks_done(2);
  v1::BlockMetrics* b = job.add_blocks();
  b->set_block(1);
  b->mutable_result()->set_layer(1);
  b->mutable_result()->mutable_shard()->set_name("model-00002-of-00005.safetensors");
  b->set_rank(2);
  job.set_eta_seconds(-1);
  return job;
}

TEST(JobStoreTest, RecordsSurviveARestartOnDisk) {
  const std::string state = qcal::testing::MakeTempDir("store");
  auto fs = MakeLocalStateFs();
  {
    auto store = JobStore::Open(fs.get(), state);
    ASSERT_TRUE(store.ok()) << store.status();
    const std::string a = (*store)->NewJobId();
    const std::string b = (*store)->NewJobId();
    EXPECT_EQ(a, "job-000001");
    EXPECT_EQ(b, "job-000002");
    ASSERT_TRUE((*store)->Put(MakeJob(a, v1::JOB_STATE_SUCCEEDED)).ok());
    ASSERT_TRUE((*store)->Put(MakeJob(b, v1::JOB_STATE_RUNNING)).ok());
    v1::Job updated = MakeJob(b, v1::JOB_STATE_FAILED);
    updated.set_error("rank 1 died");
    ASSERT_TRUE((*store)->Put(updated).ok());
  }
  auto store = JobStore::Open(fs.get(), state);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->load_warnings().empty());
  std::vector<v1::Job> jobs = (*store)->List();
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].SerializeAsString(),
            MakeJob("job-000001", v1::JOB_STATE_SUCCEEDED).SerializeAsString());
  EXPECT_EQ(jobs[1].state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(jobs[1].error(), "rank 1 died");
  EXPECT_EQ(jobs[1].blocks(0).result().shard().name(), "model-00002-of-00005.safetensors");
  ASSERT_NE((*store)->Find("job-000002"), nullptr);
  EXPECT_EQ((*store)->Find("job-000009"), nullptr);
  // New ids continue after the largest stored one.
  EXPECT_EQ((*store)->NewJobId(), "job-000003");
}

TEST(JobStoreTest, UnreadableRecordsAreSkippedWithAWarning) {
  testing::MemStateFs fs;
  {
    auto store = JobStore::Open(&fs, "/state");
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(MakeJob("job-000004", v1::JOB_STATE_SUCCEEDED)).ok());
  }
  fs.Put("/state/jobs/job-000005.json", "{ not json");
  fs.Put("/state/jobs/job-000006.json", R"({"id": "job-000007"})");
  fs.Put("/state/jobs/job-000008.json.tmp.123.0", "partial");  // an interrupted write
  fs.Put("/state/jobs/notes.json", "{}");
  auto store = JobStore::Open(&fs, "/state");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->List().size(), 1u);
  const auto& w = (*store)->load_warnings();
  ASSERT_EQ(w.size(), 3u);
  EXPECT_NE(w[0].find("/state/jobs/job-000005.json: unreadable job record"), std::string::npos)
      << w[0];
  EXPECT_NE(w[1].find("says id 'job-000007'"), std::string::npos) << w[1];
  EXPECT_NE(w[2].find("notes.json: not a job record name"), std::string::npos) << w[2];
  EXPECT_EQ((*store)->NewJobId(), "job-000007");  // never the id of a file on disk
}

TEST(JobStoreTest, AFailedWriteLeavesMemoryUnchanged) {
  testing::MemStateFs fs;
  auto store = JobStore::Open(&fs, "/state");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put(MakeJob("job-000001", v1::JOB_STATE_RUNNING)).ok());
  fs.fail_writes = true;
  Status s = (*store)->Put(MakeJob("job-000001", v1::JOB_STATE_SUCCEEDED));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(s.message()).find("disk full"), std::string::npos);
  EXPECT_EQ((*store)->Find("job-000001")->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ((*store)->Put(MakeJob("bad id", v1::JOB_STATE_RUNNING)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace qcal::coordinator
