// A global phase's result in the job directory (runner/phase_products.h): its training curve
// travels beside its products, so a phase reused on resume journals the curve it saved; a phase
// that trains nothing has none.
#include "runner/phase_products.h"

#include <gtest/gtest.h>

#include <string>

#include <ATen/ATen.h>

#include "tests/test_util.h"

namespace qcal {
namespace {

TEST(PhaseResultTest, TheCurveTravelsWithTheProductsAndAnUntrainedPhaseHasNone) {
  const std::string root = testing::MakeTempDir("phase-result");
  methods::PhaseResult r;
  r.products["r1"] = at::arange(4, at::kDouble).reshape({2, 2});
  r.curve.losses = {0.7, 0.6};
  r.curve.validation = {{2, 0.65}};
  const std::string path = root + "/learned.safetensors";
  ASSERT_TRUE(job::SavePhaseResult(path, r, "learned", "key").ok());
  auto back = job::LoadPhaseResult(path, "learned", "key");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(at::equal(back->products.at("r1"), r.products["r1"]));
  EXPECT_EQ(back->products.size(), 1u);  // the curve is not a product
  EXPECT_EQ(back->curve.losses, r.curve.losses);
  EXPECT_EQ(back->curve.validation, r.curve.validation);
  auto curve = job::CurveOf("learned", back->curve);
  ASSERT_TRUE(curve.has_value());
  EXPECT_EQ(curve->losses_size(), 2);
  EXPECT_EQ(job::LoadPhaseResult(path, "learned", "other").status().code(),
            absl::StatusCode::kFailedPrecondition);

  methods::PhaseResult search;
  search.products["prefix"] = at::ones({2}, at::kDouble);
  const std::string path2 = root + "/search.safetensors";
  ASSERT_TRUE(job::SavePhaseResult(path2, search, "search", "key").ok());
  auto back2 = job::LoadPhaseResult(path2, "search", "key");
  ASSERT_TRUE(back2.ok()) << back2.status();
  EXPECT_TRUE(back2->curve.empty());
  EXPECT_FALSE(job::CurveOf("search", back2->curve).has_value());
}

}  // namespace
}  // namespace qcal
