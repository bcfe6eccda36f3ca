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

namespace qcal {

struct JobInputs {
  std::string model_dir;
  std::string out_dir;
  std::string job_dir;    // resolved (JobDirFor: DefaultJobDir(out_dir) by default)
  std::string data_root;  // what relative calibration paths are read under
  std::string recipe_source;  // the recipe's file, for messages
  bool overwrite = false;     // replace a checkpoint in out_dir that job_dir did not write
};

// Where a job's relative calibration paths resolve when it names no data root: ../shared beside
// the working directory (the bundled data). The one default; DataRootOr applies it.
inline constexpr char kDefaultDataRoot[] = "../shared";
inline std::string DataRootOr(const std::string& data_root) {
  return data_root.empty() ? std::string(kDefaultDataRoot) : data_root;
}

// InvalidArgument naming the field (model_dir, out_dir, job_dir, data_root, calibration file),
// the path and the problem; the model's config on success. An out_dir that already holds a
// checkpoint (config.json, an index or model.safetensors) is refused unless job_dir's journal
// names a run into it (the same job, resumed or rerun) or `overwrite` is set.
StatusOr<LlamaConfig> CheckJobInputs(const Recipe& recipe, const JobInputs& inputs);

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
