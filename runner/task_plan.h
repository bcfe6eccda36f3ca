// The task plan: recipe + the job directory's state (runner/job_plan.h JobPlan) → the phases
// of a job and its tasks. One plan for every driver: the coordinator hands these tasks to its
// workers, `qcal quantize` runs the same tasks in process (runner/quantize_job.h), so the two
// calibrate, quantize and fine-tune under the same conditions. Pure: no I/O, so it is unit-tested
// on hand-made JobPlans.
//
//   plan → [calibrate] → quantize (one QUANTIZE_BLOCK task per pending block; in layer order, one
//        at a time, when the method calibrates sequentially) → [finetune] → finalize
//        → [evaluate] → done
//
// calibrate is present when some pending work still needs Hessians or activations
// (JobPlan::has_calibrate_task), with the CalibrateParams saying which; finetune (FINETUNE_E2E)
// when the recipe enables end-to-end fine-tuning and the journal holds no valid e2e_done (or any
// block is redone, since the stage rewrites every block shard); evaluate when the job spec asks
// for perplexities (one EVALUATE task per model and file). Only the method's needs are read,
// never its name.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runner/job_plan.h"
#include "common/recipe.h"
#include "proto/job.pb.h"

namespace qcal {

inline constexpr char kPhasePlan[] = "plan";
inline constexpr char kPhaseCalibrate[] = "calibrate";
inline constexpr char kPhaseQuantize[] = "quantize";
inline constexpr char kPhaseFinetune[] = "finetune";
inline constexpr char kPhaseFinalize[] = "finalize";
inline constexpr char kPhaseEvaluate[] = "evaluate";
inline constexpr char kPhaseDone[] = "done";

// Routed experts per task of a MoE block split over tasks when the job spec names none.
inline constexpr int64_t kDefaultExpertsPerTask = 8;
// The help of every command's --experts-per-task (JobSpec::experts_per_task).
inline constexpr char kExpertsPerTaskHelp[] =
    "routed experts per task of a mixture-of-experts block, for methods that round experts on "
    "their own (rtn, gptq, quip without block fine-tuning): 0 = 8, -1 = one task per block";

// The routed experts [begin, end) of one expert-group task.
struct ExpertGroup {
  int64_t begin = 0, end = 0;
};
// `experts` split into consecutive groups of `per_task` (0: kDefaultExpertsPerTask; the last
// group may be smaller). Empty when the block stays one task: per_task < 0, or one group.
std::vector<ExpertGroup> ExpertGroups(int64_t experts, int64_t per_task);

struct TaskPlan {
  int64_t num_blocks = 0;
  bool calibrate = false;             // one collective CALIBRATE task for every rank, first
  v1::CalibrateParams calibrate_params;  // what it produces
  std::vector<int64_t> blocks;        // QUANTIZE_BLOCK tasks, ascending layer order
  std::vector<int64_t> resumed;       // blocks finished by an earlier run (journal + shard)
  // Block l may start only after block l-1 completed (QuaRot's sequential calibration:
  // Recipe::sequential_calibration); the scheduler then hands out one block at a time.
  bool sequential_blocks = false;
  // MoE blocks split over tasks (MethodNeeds::expert_parts, more than one group): layer -> its
  // expert groups. Part i >= 1 quantizes groups[i - 1] (any rank, in parallel); part 0 the
  // block's other weights, once every group is done, and assembles the block's shard.
  std::map<int64_t, std::vector<ExpertGroup>> block_groups;
  // Groups an earlier run finished (JobPlan::parts_done matched to this plan's groups): layer ->
  // part index -> its result.
  std::map<int64_t, std::map<int, v1::BlockResult>> parts_done;
  bool finetune_e2e = false;          // one FINETUNE_E2E task after the last block
  std::vector<v1::EvalParams> evals;  // EVALUATE tasks after finalize
  std::vector<std::string> phases;    // in order, from kPhasePlan to kPhaseDone

  // No task for the workers: the job goes straight from plan to finalize (no launch).
  bool needs_workers() const {
    return calibrate || !blocks.empty() || finetune_e2e || !evals.empty();
  }
};

// `evals`: the spec's evaluation (EvalParams for the float then the quantized model, per file).
TaskPlan MakeTaskPlan(const Recipe& recipe, const JobPlan& plan,
                      const std::vector<v1::EvalParams>& evals = {});

}  // namespace qcal
