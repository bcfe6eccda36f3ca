#include "methods/method_factory.h"

#include "absl/strings/str_cat.h"
#include "methods/registry.h"

// One declaration per registered method (generated from QCAL_METHODS).
#define QCAL_METHOD(name)                                                       \
  namespace qcal::methods::name {                                               \
  StatusOr<std::unique_ptr<Method>> Make(const Recipe& recipe,                  \
                                         const LlamaConfig& config,             \
                                         const PhaseProductsByName& products);  \
  }
#include "methods/method_list.inc"
#undef QCAL_METHOD

namespace qcal::methods {
namespace {

class QuantizedSource final : public model::CheckpointSource {
 public:
  QuantizedSource(LlamaConfig config, std::unique_ptr<CheckpointReader> ckpt,
                  std::unique_ptr<Method> method)
      : CheckpointSource(std::move(config), std::move(ckpt)), method_(std::move(method)) {}
  StatusOr<model::BlockWeights> LoadBlockWeights(int64_t layer) override {
    return method_->block_format().LoadBlock(reader(), layer);
  }

 protected:
  Status InstallOnBlock(model::DecoderBlock* block, int64_t layer) override {
    return method_->inference().Install(block, layer);
  }

 private:
  std::unique_ptr<Method> method_;
};

}  // namespace

StatusOr<std::unique_ptr<Method>> MakeMethod(const Recipe& recipe, const LlamaConfig& config,
                                             const PhaseProductsByName& products) {
#define QCAL_METHOD(name) \
  if (recipe.method == #name) return name::Make(recipe, config, products);
#include "methods/method_list.inc"
#undef QCAL_METHOD
  return absl::InvalidArgumentError(
      absl::StrCat("recipe '", recipe.name, "': no worker for method '", recipe.method, "'"));
}

StatusOr<Recipe> CheckpointRecipe(const LlamaConfig& config, const std::string& dir) {
  const std::string where = dir + "/config.json";
  if (!config.raw.contains("quantization_config")) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no quantization_config"));
  }
  const nlohmann::json& q = config.raw["quantization_config"];
  if (!q.is_object() || q.value("quant_method", "") != "qcal") {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": quantization_config is not a qcal one (",
        q.is_object() ? q.value("quant_method", "?") : "not an object", ")"));
  }
  if (!q.contains("recipe") || !q["recipe"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": quantization_config has no recipe"));
  }
  return ParseRecipe(q["recipe"].dump(), where + " quantization_config");
}

StatusOr<std::unique_ptr<Method>> CheckpointMethod(const LlamaConfig& config,
                                                   const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(Recipe recipe, CheckpointRecipe(config, dir));
  return MakeMethod(recipe, config);
}

StatusOr<std::unique_ptr<model::ModelSource>> OpenModel(const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(dir));
  if (!config.raw.contains("quantization_config")) return model::OpenFloatCheckpoint(dir);
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<Method> method, CheckpointMethod(config, dir));
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(dir));
  return std::unique_ptr<model::ModelSource>(
      std::make_unique<QuantizedSource>(std::move(config), std::move(ckpt), std::move(method)));
}

StatusOr<std::unique_ptr<model::LlamaModel>> LoadModel(const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(dir));
  if (!config.raw.contains("quantization_config")) return model::LlamaModel::Load(dir);
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<Method> method, CheckpointMethod(config, dir));
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(dir));
  QCAL_ASSIGN_OR_RETURN(at::Tensor embed,
                        model::LoadTensorF32(*ckpt, config.TensorName("model.embed_tokens.weight"),
                                             {config.vocab_size, config.hidden_size}));
  std::vector<model::DecoderBlock> blocks;
  blocks.reserve(config.num_hidden_layers);
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, method->block_format().LoadBlock(*ckpt, l));
    blocks.emplace_back(config, std::move(w));
    QCAL_RETURN_IF_ERROR(method->inference().Install(&blocks.back(), l));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor norm,
                        model::LoadTensorF32(*ckpt, config.TensorName("model.norm.weight"),
                                             {config.hidden_size}));
  at::Tensor head = embed;
  if (const std::string head_name = config.TensorName("lm_head.weight"); ckpt->Has(head_name)) {
    QCAL_ASSIGN_OR_RETURN(head, model::LoadTensorF32(*ckpt, head_name,
                                                     {config.vocab_size, config.hidden_size}));
  }
  return std::make_unique<model::LlamaModel>(std::move(config), std::move(embed),
                                             std::move(blocks), std::move(norm),
                                             std::make_unique<model::DenseLinear>(head));
}

}  // namespace qcal::methods
