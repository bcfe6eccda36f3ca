#include "common/checkpoint_layout.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/io_util.h"
#include "common/safe_fs.h"

namespace qcal {

std::string ShardName(int64_t shard, int64_t num_blocks) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05lld-of-%05lld.safetensors",
                static_cast<long long>(shard), static_cast<long long>(num_blocks));
  return buf;
}

StatusOr<std::vector<std::string>> WriteNonBlockShard(const std::string& path,
                                                      CheckpointReader& ckpt,
                                                      const LlamaConfig& config) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  std::vector<std::string> names = {config.TensorName("model.embed_tokens.weight"),
                                    config.TensorName("model.norm.weight")};
  if (ckpt.Has(config.TensorName("lm_head.weight"))) {
    names.push_back(config.TensorName("lm_head.weight"));
  }
  if (!config.tensor_prefix.empty()) {
    // The text model of a multimodal checkpoint (Llama4ForConditionalGeneration): everything
    // outside it (the vision tower, the projector) is not qcal's to change and is copied too.
    for (const std::string& name : ckpt.TensorNames()) {
      if (name.compare(0, config.tensor_prefix.size(), config.tensor_prefix) != 0) {
        names.push_back(name);
      }
    }
  }
  for (const std::string& name : names) {
    // As stored (a bf16 128k-vocabulary table stays bf16), streamed from the source file.
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
    QCAL_RETURN_IF_ERROR(AddCopiedTensor(&writer, name, *found.first, *found.second));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return names;
}

nlohmann::json MakeQuantizationConfig(const Recipe& recipe, const LlamaConfig& config,
                                      double code_bits, double stored_bits) {
  nlohmann::json not_quantized = nlohmann::json::array();
  for (const char* m : {"model.embed_tokens", "model.norm", "lm_head"}) {
    not_quantized.push_back(config.TensorName(m));
  }
  if (config.is_moe()) {
    // The routers stay in float: a few thousand weights per block that pick every token's
    // experts.
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      if (!config.IsMoeLayer(l)) continue;
      not_quantized.push_back(config.RouterModule(l));
    }
  }
  if (!config.tensor_prefix.empty()) {
    // Llama4ForConditionalGeneration's modules outside the text model, copied as stored.
    not_quantized.push_back("vision_model");
    not_quantized.push_back("multi_modal_projector");
  }
  nlohmann::json q = {{"quant_method", "qcal"},
                      {"format_version", 1},
                      {"method", recipe.method},
                      {"bits", recipe.bits()},
                      {"bits_per_weight", {{"codes", code_bits}, {"stored", stored_bits}}},
                      {"modules_not_quantized", not_quantized},
                      {"recipe", recipe.ToJson()}};
  if (recipe.config) recipe.config->AddToQuantizationConfig(&q);
  return q;
}

Status WriteShardIndex(const std::string& out_dir, int64_t num_blocks,
                       const std::map<std::string, std::string>& checksums) {
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (int64_t shard = 0; shard <= num_blocks; ++shard) {
    const std::string name = ShardName(shard, num_blocks);
    QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(out_dir + "/" + name));
    for (const TensorInfo& t : file->tensors()) {
      weight_map[t.name] = name;
      total += t.nbytes();
    }
  }
  return WriteCheckpointIndex(out_dir, weight_map, total, checksums);
}

StatusOr<std::string> FileChecksum(const std::string& path) {
  return FileFnv1aHex(path);
}


std::vector<std::string> CopyableRoots(const std::string& model_dir) {
  StatusOr<std::string> real = CanonicalPath(model_dir);
  if (!real.ok()) return {};
  std::vector<std::string> roots = {*real};
  // A Hugging Face cache snapshot (REPO/snapshots/REV) links its files to REPO/blobs/.
  const std::filesystem::path p(*real);
  if (p.parent_path().filename() == "snapshots") {
    roots.push_back(p.parent_path().parent_path().string());
  }
  return roots;
}

namespace {

// The tokenizer files `model_dir` has (a dangling link counts: copying it is refused by name).
std::vector<std::string> PresentTokenizerFiles(const std::string& model_dir) {
  std::vector<std::string> present;
  for (const char* f : {"tokenizer.model", "tokenizer_config.json", "generation_config.json",
                        "tokenizer.json", "special_tokens_map.json"}) {
    struct stat st;
    if (::lstat((model_dir + "/" + f).c_str(), &st) == 0 || errno != ENOENT) present.push_back(f);
  }
  return present;
}

}  // namespace

Status CheckTokenizerFilesCopyable(const std::string& model_dir) {
  const std::vector<std::string> roots = CopyableRoots(model_dir);
  for (const std::string& f : PresentTokenizerFiles(model_dir)) {
    StatusOr<std::string> resolved = ResolveForCopy(model_dir + "/" + f, roots);
    if (!resolved.ok()) return absl::InvalidArgumentError(resolved.status().message());
  }
  return absl::OkStatus();
}

Status CopyTokenizerFiles(const std::string& model_dir, const std::string& out_dir) {
  const std::vector<std::string> roots = CopyableRoots(model_dir);
  for (const std::string& f : PresentTokenizerFiles(model_dir)) {
    QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFileForCopy(model_dir + "/" + f, roots));
    QCAL_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/" + f, bytes));
  }
  return absl::OkStatus();
}

Status FinalizeCheckpoint(const std::string& out_dir, const std::string& model_dir,
                          const LlamaConfig& config, const nlohmann::json& quantization_config,
                          std::map<std::string, std::string> checksums) {
  for (int64_t shard = 0; shard <= config.num_hidden_layers; ++shard) {
    const std::string name = ShardName(shard, config.num_hidden_layers);
    if (checksums.count(name)) continue;
    QCAL_ASSIGN_OR_RETURN(checksums[name], FileFnv1aHex(out_dir + "/" + name));
  }
  QCAL_RETURN_IF_ERROR(WriteShardIndex(out_dir, config.num_hidden_layers, checksums));
  QCAL_RETURN_IF_ERROR(CopyTokenizerFiles(model_dir, out_dir));
  LlamaConfig out = config;
  out.raw["quantization_config"] = quantization_config;
  return WriteFileAtomic(out_dir + "/config.json", LlamaConfigToJson(out).dump(2) + "\n");
}

}  // namespace qcal
