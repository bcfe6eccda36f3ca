// The quantized checkpoint's layout, as methods, export and the job's finalize read and write it:
// shard names, the index, "quantization_config", the copied tokenizer files. Torch-free.
// (Everything a job keeps beside the checkpoint, JOB/ and OUT/.staging, is runner/job_dir.h's.)
//
//   OUT/config.json                      model config + "quantization_config" (written last: its
//                                        presence marks a finished checkpoint)
//   OUT/model.safetensors.index.json     weight_map over the shards (with their checksums)
//   OUT/model-00000-of-0000N.safetensors embeddings, final norm, head
//   OUT/model-0000l-of-0000N.safetensors block l-1
//   OUT/tokenizer.json, ...              copied from the model directory
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/hf_config.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace qcal {

// "model-00003-of-00006.safetensors": shard 0 holds the non-block tensors, shard l+1 block l.
std::string ShardName(int64_t shard, int64_t num_blocks);

// Copies the embeddings, final norm and (untied) head from the float checkpoint as stored (their
// dtype and bytes), streamed: no table is held in memory. Names keep config.tensor_prefix; a
// multimodal checkpoint's tensors outside the text model (Llama 4's vision tower and projector)
// are copied the same way. Returns the names written.
StatusOr<std::vector<std::string>> WriteNonBlockShard(const std::string& path,
                                                      CheckpointReader& float_ckpt,
                                                      const LlamaConfig& config);

// The "quantization_config" object written into config.json. Its modules_not_quantized lists
// the embeddings, final norm and head, a MoE model's routers and a multimodal checkpoint's
// vision modules, under `config`'s tensor names.
nlohmann::json MakeQuantizationConfig(const Recipe& recipe, const LlamaConfig& config,
                                      double code_bits, double stored_bits);

// Copies the tokenizer files a model directory has (tokenizer.model, tokenizer.json,
// tokenizer_config.json, special_tokens_map.json, generation_config.json) into out_dir.
Status CopyTokenizerFiles(const std::string& model_dir, const std::string& out_dir);
// Where a file copied out of `model_dir` may lie once links are resolved: the model directory
// (canonical) and, for a Hugging Face cache snapshot (REPO/snapshots/REV), REPO (its blobs/).
std::vector<std::string> CopyableRoots(const std::string& model_dir);
// InvalidArgument naming the file when a tokenizer file of `model_dir` could not be copied
// (a link out of the model directory, not a regular file, unreadable): checked before a job runs.
Status CheckTokenizerFilesCopyable(const std::string& model_dir);

// Writes the index (from the shards' headers), config.json (last: its presence marks a complete
// checkpoint) and copies the tokenizer files from `model_dir`.
// The index records every shard's checksum (metadata.qcal_fnv1a64, which readers verify):
// those in `checksums` (a job's journaled ones, for the shards accepted attempts wrote), the
// others computed from the files.
Status FinalizeCheckpoint(const std::string& out_dir, const std::string& model_dir,
                          const LlamaConfig& config, const nlohmann::json& quantization_config,
                          std::map<std::string, std::string> checksums = {});

// Writes model.safetensors.index.json over shards 0..num_blocks already in out_dir (from their
// headers). Used before end-to-end fine-tuning (so out_dir reads as a checkpoint) and by
// FinalizeCheckpoint.
// With `checksums`, they are recorded in the index (FinalizeCheckpoint).
Status WriteShardIndex(const std::string& out_dir, int64_t num_blocks,
                       const std::map<std::string, std::string>& checksums = {});

// Fnv1aHex of the file's bytes (the checksum journaled for shards); the read error otherwise.
StatusOr<std::string> FileChecksum(const std::string& path);

}  // namespace qcal
