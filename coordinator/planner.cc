#include "coordinator/planner.h"

namespace qcal::coordinator {

TaskPlan MakeTaskPlan(const Recipe& recipe, const JobPlan& plan) {
  TaskPlan t;
  t.num_blocks = plan.num_blocks;
  for (int64_t l = 0; l < plan.num_blocks; ++l) {
    const bool finished = l < static_cast<int64_t>(plan.block_finished.size()) &&
                          plan.block_finished[l];
    (finished ? t.resumed : t.blocks).push_back(l);
  }
  t.sequential_blocks = recipe.sequential_calibration();
  const bool e2e_enabled = recipe.finetune.end_to_end.enabled;
  t.finetune_e2e = e2e_enabled && (!plan.e2e_finished || !t.blocks.empty());
  t.calibrate = plan.needs_calibration(recipe) && (!t.blocks.empty() || t.finetune_e2e);

  t.phases.push_back(kPhasePlan);
  if (t.calibrate) t.phases.push_back(kPhaseCalibrate);
  if (!t.blocks.empty()) t.phases.push_back(kPhaseQuantize);
  if (t.finetune_e2e) t.phases.push_back(kPhaseFinetune);
  t.phases.push_back(kPhaseFinalize);
  t.phases.push_back(kPhaseDone);
  return t;
}

}  // namespace qcal::coordinator
