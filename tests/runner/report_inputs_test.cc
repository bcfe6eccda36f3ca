// What the job report reads from a job directory (runner/workspace.h ReportInputsOf): its
// journal, and the products of any global phase that trained, plotted by the phase's name
// (the report names no method).
#include "runner/workspace.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/safetensors.h"
#include "common/safe_fs.h"
#include "report/report.h"
#include "runner/job_dir.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

TEST(ReportInputsTest, PlotsATrainedPhaseFromTheJobDirectoryByItsName) {
  const std::string root = testing::MakeTempDir("report-inputs");
  const JobPaths paths(root + "/job");
  ASSERT_TRUE(MakeDirs(paths.phases).ok());
  ASSERT_TRUE(WriteFileAtomic(paths.journal,
                              "{\"event\":\"job_start\",\"recipe\":\"r\",\"out\":\"/o\"}\n")
                  .ok());
  const report::ReportInputs in = job::ReportInputsOf(paths.dir, "");
  EXPECT_EQ(in.journal, paths.journal);
  EXPECT_EQ(in.phases_dir, paths.phases);

  auto plain = report::RenderReport(in);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->find("training-"), std::string::npos);

  // A phase that trained ("losses", "validation" as (step, loss) pairs), and one that did not.
  SafetensorsWriter trained;
  const std::vector<float> losses = {0.5f, 0.4f, 0.3f}, validation = {1, 0.45f, 3, 0.35f};
  ASSERT_TRUE(trained.AddF32("losses", {3}, losses.data()).ok());
  ASSERT_TRUE(trained.AddF32("validation", {2, 2}, validation.data()).ok());
  ASSERT_TRUE(trained.Write(paths.PhaseProducts("learned")).ok());
  SafetensorsWriter other;
  const std::vector<float> prefix = {1, 2};
  ASSERT_TRUE(other.AddF32("prefix", {2}, prefix.data()).ok());
  ASSERT_TRUE(other.Write(paths.PhaseProducts("search")).ok());

  auto html = report::RenderReport(in);
  ASSERT_TRUE(html.ok()) << html.status();
  EXPECT_NE(html->find("id=\"training-learned\""), std::string::npos);
  EXPECT_NE(html->find("Training in the 'learned' phase"), std::string::npos);
  EXPECT_NE(html->find("held-out loss"), std::string::npos);
  EXPECT_EQ(html->find("training-search"), std::string::npos);

  auto journaled = report::ReadJournaledJob(paths.journal);
  ASSERT_TRUE(journaled.ok()) << journaled.status();
  EXPECT_EQ(journaled->out_dir, "/o");
}

}  // namespace
}  // namespace qcal
