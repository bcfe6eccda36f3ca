// What the job report reads from a job directory (runner/workspace.h ReportInputsOf): its
// journal, whose phase_done entries (runner/journal.h, from calibration results:
// runner/task_results.h JournalEntries) are plotted by the phase's name (the report names no
// method).
#include "runner/workspace.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/safe_fs.h"
#include "report/report.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/task_results.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

TEST(ReportInputsTest, PlotsATrainedPhaseFromTheJournalByItsName) {
  const std::string root = testing::MakeTempDir("report-inputs");
  const JobPaths paths(root + "/job");
  ASSERT_TRUE(MakeDirs(paths.dir).ok());
  const std::string start = "{\"event\":\"job_start\",\"recipe\":\"r\",\"out\":\"/o\"}\n";
  ASSERT_TRUE(WriteFileAtomic(paths.journal, start).ok());
  const report::ReportInputs in = job::ReportInputsOf(paths.dir, "");
  EXPECT_EQ(in.journal, paths.journal);

  auto plain = report::RenderReport(in);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->find("training-"), std::string::npos);

  // Rank 0's calibration result: a phase that trained (a NaN loss journaled as null), and its
  // phase_done entry read back unchanged.
  v1::CompleteTaskRequest result;
  v1::PhaseCurve* c = result.mutable_calibrate()->add_curves();
  c->set_phase("learned");
  for (double v : {0.5, std::numeric_limits<double>::quiet_NaN(), 0.3}) c->add_losses(v);
  c->add_validation_steps(1);
  c->add_validation_losses(0.45);
  c->add_validation_steps(3);
  c->add_validation_losses(0.35);
  const std::vector<nlohmann::json> entries = job::JournalEntries(result);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0]["event"], "phase_done");
  EXPECT_TRUE(entries[0]["losses"][1].is_null());
  auto back = PhaseCurveFromEntry(entries[0]);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->phase(), "learned");
  ASSERT_EQ(back->losses_size(), 3);
  EXPECT_TRUE(std::isnan(back->losses(1)));
  EXPECT_EQ(back->validation_steps(1), 3);
  EXPECT_DOUBLE_EQ(back->validation_losses(1), 0.35);
  EXPECT_FALSE(PhaseCurveFromEntry({{"event", "phase_done"}}).ok());
  // Evaluation adds nothing to the journal.
  v1::CompleteTaskRequest eval;
  eval.mutable_eval();
  EXPECT_TRUE(job::JournalEntries(eval).empty());

  // A phase that trained nothing leaves no entry; an older entry of the same phase is replaced.
  nlohmann::json older = entries[0];
  older["losses"] = {9.0};
  ASSERT_TRUE(WriteFileAtomic(paths.journal, start + older.dump() + "\n" + entries[0].dump() +
                                                 "\n")
                  .ok());
  auto html = report::RenderReport(in);
  ASSERT_TRUE(html.ok()) << html.status();
  EXPECT_NE(html->find("id=\"training-learned\""), std::string::npos);
  EXPECT_NE(html->find("Training in the 'learned' phase"), std::string::npos);
  EXPECT_NE(html->find("held-out loss"), std::string::npos);
  EXPECT_EQ(html->find("training-search"), std::string::npos);
  // Plotted once, from the latest entry.
  const size_t first = html->find("id=\"training-learned\"");
  EXPECT_EQ(html->find("id=\"training-learned\"", first + 1), std::string::npos);

  auto journaled = report::ReadJournaledJob(paths.journal);
  ASSERT_TRUE(journaled.ok()) << journaled.status();
  EXPECT_EQ(journaled->out_dir, "/o");
}

}  // namespace
}  // namespace qcal
