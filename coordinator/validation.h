// Checks of a submitted JobSpec, before the job is accepted. Every failure is InvalidArgument
// with a message naming the field, the path and the problem.
#pragma once

#include "common/recipe.h"
#include "common/status.h"
#include "proto/qcal.pb.h"

namespace qcal::coordinator {

inline constexpr int kMaxWorkers = 1024;

// Checks (and lexically normalizes, in place) the spec's paths and numbers and parses its
// recipe:
//  * workers in [1, kMaxWorkers]; threads_per_worker and calib_batch >= 0; name <= 128 bytes;
//  * recipe_yaml parses and validates (errors name recipe_path);
//  * model_dir absolute, an existing readable directory with a valid config.json;
//  * out_dir and job_dir absolute, neither equal to nor inside model_dir (symlinks resolved),
//    an existing out_dir is a directory, and the nearest existing ancestor is writable;
//  * when the recipe calibrates: data_root is an existing directory and every calibration file
//    exists and is readable.
StatusOr<Recipe> ValidateJobSpec(v1::JobSpec* spec);

}  // namespace qcal::coordinator
