// Quantized checkpoints in Hugging Face layout (docs/formats.md):
//   config.json                      the model config + "quantization_config"
//   model.safetensors.index.json     weight_map over the shards
//   model-00000-of-0000N.safetensors embeddings, final norm, head (float)
//   model-0000l-of-0000N.safetensors block l-1: norms (float) + quantized linears
//   tokenizer.model, tokenizer_config.json, generation_config.json (copied)
// One shard per block, because the block is the unit of work: a finished block is one atomic
// file, so an interrupted job keeps every finished block.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/job_layout.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "worker/model/llama.h"

namespace qcal::quant {

// Shard naming, the non-block shard, quantization_config and finalization are torch-free and
// shared with the coordinator: common/job_layout.h.
using ::qcal::FinalizeCheckpoint;
using ::qcal::MakeQuantizationConfig;
using ::qcal::ShardName;
using ::qcal::WriteNonBlockShard;

// Writes one block's tensors (norms as F32, each linear as its own format: QuipLinear,
// ScalarQuantLinear, or a dense F32 weight) atomically to `path`. Returns the tensor names.
StatusOr<std::vector<std::string>> WriteBlockShard(const std::string& path, int64_t layer,
                                                   const model::BlockWeights& weights);

// Loads a block whose linears may be quantized, according to config.raw["quantization_config"].
StatusOr<model::BlockWeights> LoadAnyBlockWeights(CheckpointReader& ckpt,
                                                  const LlamaConfig& config, int64_t layer);

// Loads a float or quantized model directory.
StatusOr<std::unique_ptr<model::LlamaModel>> LoadAnyModel(const std::string& dir);

}  // namespace qcal::quant
