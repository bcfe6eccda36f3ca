// Writing a float model directory derived from another (the planting tools' output).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "common/hf_config.h"
#include "common/status.h"

namespace qcal::tools {

// InvalidArgument when `model_dir` holds a quantized model (its config has quantization_config)
// or a mixture-of-experts one (DenseOnly), or `out_dir` is `model_dir`; `tool` names the command
// in the message.
// InvalidArgument naming `tool` and the architecture for a mixture-of-experts model: the
// analysis and planting tools work on dense Llama blocks.
Status DenseOnly(const std::string& tool, const std::string& model_dir, const LlamaConfig& config);
Status CheckDerivedModelDirs(const std::string& tool, const std::string& model_dir,
                             const LlamaConfig& config, const std::string& out_dir);

// Writes out_dir (created if missing): model.safetensors with `tensors` (float32, by name),
// config.json (`config` with torch_dtype float32), `plan_file` holding `plan`, and a copy of
// every other regular file of model_dir (tokenizer.model, tokenizer_config.json, ...) except
// safetensors files, their index, config.json and any earlier plan file of the same name.
Status WriteDerivedModelDir(const std::string& model_dir, const std::string& out_dir,
                            const std::map<std::string, at::Tensor>& tensors, LlamaConfig config,
                            const std::string& plan_file, const nlohmann::json& plan);

}  // namespace qcal::tools
