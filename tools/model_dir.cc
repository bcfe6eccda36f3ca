#include "tools/model_dir.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/safetensors.h"

namespace qcal::tools {

Status DenseOnly(const std::string& tool, const std::string& model_dir,
                 const LlamaConfig& config) {
  if (!config.is_moe()) return Status();
  return absl::InvalidArgumentError(absl::StrCat(
      model_dir, "/config.json: ", config.architecture, " is a mixture-of-experts model; ", tool,
      " works on dense Llama models (LlamaForCausalLM)"));
}

Status CheckDerivedModelDirs(const std::string& tool, const std::string& model_dir,
                             const LlamaConfig& config, const std::string& out_dir) {
  namespace fs = std::filesystem;
  QCAL_RETURN_IF_ERROR(DenseOnly(tool, model_dir, config));
  if (config.raw.contains("quantization_config")) {
    return absl::InvalidArgumentError(absl::StrCat(
        model_dir, "/config.json: has quantization_config; ", tool, " needs a float model"));
  }
  std::error_code ec;
  if (fs::exists(out_dir, ec) && fs::equivalent(model_dir, out_dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out ", out_dir, " is the input model directory; choose another"));
  }
  return Status();
}

Status WriteDerivedModelDir(const std::string& model_dir, const std::string& out_dir,
                            const std::map<std::string, at::Tensor>& tensors, LlamaConfig config,
                            const std::string& plan_file, const nlohmann::json& plan) {
  namespace fs = std::filesystem;
  QCAL_RETURN_IF_ERROR(MakeDirs(out_dir));
  SafetensorsWriter writer;
  std::vector<at::Tensor> keep;  // the writer reads the data when it writes
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.to(at::kFloat).contiguous());
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    QCAL_RETURN_IF_ERROR(writer.AddF32(name, shape, keep.back().data_ptr<float>()));
  }
  writer.SetMetadata("format", "pt");
  QCAL_RETURN_IF_ERROR(writer.Write(out_dir + "/model.safetensors"));

  // Every other regular file (tokenizer, generation config, ...) is copied unchanged.
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(model_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name == "config.json" || name == plan_file ||
        name == "model.safetensors.index.json" || e.path().extension() == ".safetensors") {
      continue;
    }
    QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFile(e.path().string()));
    QCAL_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/" + name, bytes));
  }
  if (ec) {
    return absl::InternalError(absl::StrCat(model_dir, ": listing files: ", ec.message()));
  }
  config.torch_dtype = "float32";
  nlohmann::json cj = LlamaConfigToJson(config);
  QCAL_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/config.json", cj.dump(2) + "\n"));
  return WriteFileAtomic(out_dir + "/" + plan_file, plan.dump(2) + "\n");
}

}  // namespace qcal::tools
