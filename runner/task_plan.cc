#include "runner/task_plan.h"

#include <algorithm>

#include "runner/journal.h"

namespace qcal {

std::vector<ExpertGroup> ExpertGroups(int64_t experts, int64_t per_task) {
  if (per_task < 0 || experts <= 0) return {};
  const int64_t size = per_task == 0 ? kDefaultExpertsPerTask : per_task;
  if (size >= experts) return {};
  std::vector<ExpertGroup> groups;
  for (int64_t begin = 0; begin < experts; begin += size) {
    groups.push_back({begin, std::min(experts, begin + size)});
  }
  return groups;
}

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
  if (needs.expert_parts) {
    for (int64_t l : t.blocks) {
      if (!plan.config.IsMoeLayer(l)) continue;
      std::vector<ExpertGroup> groups =
          ExpertGroups(plan.config.num_experts, plan.experts_per_task);
      if (groups.empty()) continue;
      // Groups an earlier run finished, when this plan has the same group.
      auto done = plan.parts_done.find(l);
      if (done != plan.parts_done.end()) {
        for (const nlohmann::json& entry : done->second) {
          v1::BlockResult r = BlockResultFromEntry(entry);
          for (size_t i = 0; i < groups.size(); ++i) {
            if (r.part().expert_begin() == groups[i].begin &&
                r.part().expert_end() == groups[i].end) {
              r.mutable_part()->set_index(static_cast<int32_t>(i) + 1);
              r.mutable_part()->set_count(static_cast<int32_t>(groups.size()) + 1);
              t.parts_done[l][static_cast<int>(i) + 1] = r;
            }
          }
        }
      }
      t.block_groups[l] = std::move(groups);
    }
  }
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
