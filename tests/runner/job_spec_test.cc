// The one record of a job (v1::JobSpec) and the one function that fills its defaults
// (runner/job_inputs.h ResolveJobSpec), which `qcal quantize`, the coordinator's validation and
// the workers all call.
#include "runner/job_inputs.h"

#include <gtest/gtest.h>

#include "runner/job_dir.h"

namespace qcal {
namespace {

TEST(JobSpecTest, ResolveFillsTheDefaultsOnceAndKeepsWhatWasGiven) {
  v1::JobSpec spec;
  spec.set_out_dir("/data/out");
  ResolveJobSpec(&spec);
  EXPECT_EQ(spec.job_dir(), DefaultJobDir("/data/out"));
  EXPECT_EQ(spec.data_root(), kDefaultDataRoot);
  EXPECT_EQ(spec.calib_batch(), kDefaultCalibBatch);
  EXPECT_EQ(spec.recipe_path(), "recipe");
  EXPECT_EQ(spec.workers(), 1);
  // What depends on the node a rank runs on stays for the rank.
  EXPECT_EQ(spec.max_memory_bytes(), 0);
  EXPECT_EQ(spec.threads_per_worker(), 0);
  // Resolving again changes nothing.
  v1::JobSpec again = spec;
  ResolveJobSpec(&again);
  EXPECT_EQ(again.SerializeAsString(), spec.SerializeAsString());

  v1::JobSpec given;
  given.set_out_dir("/data/out");
  given.set_job_dir("/scratch/j");
  given.set_data_root("/data/text");
  given.set_calib_batch(3);
  given.set_recipe_path("jobs/x.yaml");
  given.set_workers(4);
  given.set_threads_per_worker(2);
  v1::JobSpec resolved = given;
  ResolveJobSpec(&resolved);
  EXPECT_EQ(resolved.SerializeAsString(), given.SerializeAsString());
}

}  // namespace
}  // namespace qcal
