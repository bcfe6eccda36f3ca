// Checks of a submitted JobSpec, before the job is accepted. Every failure is InvalidArgument
// with a message naming the field, the path and the problem.
#pragma once

#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"
#include "coordinator/identity.h"
#include "proto/qcal.pb.h"

namespace qcal::coordinator {

inline constexpr int kMaxWorkers = 1024;

// Checks (and lexically normalizes, in place) the spec's paths and numbers and parses its
// recipe:
//  * workers in [1, kMaxWorkers]; threads_per_worker and calib_batch >= 0;
//    experts_per_task >= -1; name <= 128 bytes;
//  * recipe_yaml parses and validates (errors name recipe_path);
//  * model_dir absolute, an existing readable directory with a valid config.json;
//  * out_dir and job_dir absolute, neither equal to nor inside model_dir (symlinks resolved),
//    an existing out_dir is a directory, and the nearest existing ancestor is writable;
//  * when the recipe calibrates: data_root is an existing directory and every calibration file
//    exists and is readable.
//  * every string of the spec is free of control characters (a newline or an escape sequence in a
//    path would reach other people's terminals through `qcal list` and the log).
StatusOr<Recipe> ValidateJobSpec(v1::JobSpec* spec);

// The calibration files a validated spec's recipe reads, canonical (none when it does not
// calibrate).
std::vector<std::string> CalibrationPaths(const Recipe& recipe, const v1::JobSpec& spec);

// PermissionDenied naming the file when an entry of `model_dir` resolves (through a link) to a
// place outside the directories `who` may read: the workers would read it for them.
Status CheckModelFilesUnderRoots(const Principal& who, const std::string& model_dir);

}  // namespace qcal::coordinator
