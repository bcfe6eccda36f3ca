#include "runner/task_plan.h"

namespace qcal {

TaskPlan MakeTaskPlan(const Recipe& recipe, const JobPlan& plan,
                      const std::vector<v1::EvalParams>& evals) {
  TaskPlan t;
  t.num_blocks = plan.num_blocks;
  for (int64_t l = 0; l < plan.num_blocks; ++l) {
    const bool finished = l < static_cast<int64_t>(plan.block_finished.size()) &&
                          plan.block_finished[l];
    (finished ? t.resumed : t.blocks).push_back(l);
  }
  const MethodNeeds needs = recipe.needs();
  t.sequential_blocks = needs.sequential;
  t.finetune_e2e = needs.end_to_end && (!plan.e2e_finished || !t.blocks.empty());
  t.calibrate = plan.has_calibrate_task(recipe) && (!t.blocks.empty() || t.finetune_e2e);
  if (t.calibrate) {
    t.calibrate_params.set_hessians(needs.float_hessians && !t.blocks.empty());
    t.calibrate_params.set_activations(needs.float_activations && !t.blocks.empty());
    t.calibrate_params.set_phases(!needs.global_phases.empty() && !t.blocks.empty());
  }
  t.evals = evals;

  t.phases.push_back(kPhasePlan);
  if (t.calibrate) t.phases.push_back(kPhaseCalibrate);
  if (!t.blocks.empty()) t.phases.push_back(kPhaseQuantize);
  if (t.finetune_e2e) t.phases.push_back(kPhaseFinetune);
  t.phases.push_back(kPhaseFinalize);
  if (!t.evals.empty()) t.phases.push_back(kPhaseEvaluate);
  t.phases.push_back(kPhaseDone);
  return t;
}

}  // namespace qcal
