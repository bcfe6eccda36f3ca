// The checks of a job's inputs that need no model loaded, shared by `qcal quantize` and the
// coordinator's validation of a submitted job, so that both accept and refuse the same jobs with
// the same messages, before anything is created: the model directory and its config.json, the
// output and job directories (outside the model, directories or creatable), and, when the recipe
// calibrates, its calibration files.
#pragma once

#include <string>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/status.h"
#include "proto/job.pb.h"

namespace qcal {

// Where a job's relative calibration paths resolve when it names no data root: ../shared beside
// the working directory (the bundled data). The one default; DataRootOr applies it.
inline constexpr char kDefaultDataRoot[] = "../shared";
inline std::string DataRootOr(const std::string& data_root) {
  return data_root.empty() ? std::string(kDefaultDataRoot) : data_root;
}

// Sequences per calibration forward when the spec names none.
inline constexpr int kDefaultCalibBatch = 8;

// The job record's defaults, filled in by the one function every driver (`qcal quantize`, the
// coordinator's validation) and the worker call: job_dir JobDirFor(job_dir, out_dir), data_root
// DataRootOr, calib_batch kDefaultCalibBatch, recipe_path "recipe", workers 1. What depends on
// the node a rank runs on (max_memory_bytes 0: the node's default, threads 0: automatic) stays
// for the rank to resolve.
void ResolveJobSpec(v1::JobSpec* spec);

// The checks of a resolved spec (ResolveJobSpec). InvalidArgument naming the field (model_dir,
// out_dir, job_dir, data_root, calibration file), the path and the problem; the model's config on
// success. An out_dir that already holds a checkpoint (config.json, an index or
// model.safetensors) is refused unless job_dir's journal names a run into it (the same job,
// resumed or rerun) or `overwrite` is set. Messages name the recipe by spec.recipe_path().
StatusOr<LlamaConfig> CheckJobInputs(const Recipe& recipe, const v1::JobSpec& spec);

// Every block 0..num_hidden_layers-1 has tensors in the model's checkpoint (index or
// model.safetensors; not checked when neither opens). InvalidArgument naming config.json, the
// declared count and the first missing layer; likewise an untied head (tie_word_embeddings
// false) without lm_head.weight.
Status CheckLayerTensors(const LlamaConfig& config, const std::string& model_dir);

// `what` 'path' exists, is a regular file and is readable; InvalidArgument otherwise.
Status CheckReadableFile(const std::string& what, const std::string& path);
// `field` 'path' exists, is a directory and is readable.
Status CheckReadableDirectory(const std::string& field, const std::string& path);

}  // namespace qcal
