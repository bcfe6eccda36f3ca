// What a job's products are computed from, by content: the model's files (config, shards,
// tokenizer), the calibration text, the recipe and the format of the job directory. Every cached
// product (Hessians, activations, phase products, sequential inputs) carries a key derived from
// it, and the journal's finished blocks count only under a job_start with the same key, so a job
// directory reused for another model, changed data or an edited model file recomputes instead of
// reusing (docs/service.md, "Job directories").
//
// Hashing 140 GB of shards takes minutes, so each file's content hash is kept in
// JOB/inputs.json beside its size, modification and change times, inode and device, and reused
// while all of them are unchanged (a change time cannot be set back by a user, so an in-place
// edit is always seen); any other file is hashed again.
#pragma once

#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "common/recipe.h"
#include "common/status.h"

namespace qcal {

// Raised whenever what a cached product means changes (a new Hessian layout, a new way of
// sampling calibration tokens): products of an older format are then recomputed.
inline constexpr int kJobFormatVersion = 2;

struct InputsFingerprint {
  // Fnv1aHex over the format version, the recipe's hash and every file's label and hash.
  std::string key;
  // Label -> content hash (16 hex digits): "model/config.json", "model/model.safetensors",
  // "model/tokenizer.model", "data/<path as the recipe writes it>".
  std::map<std::string, std::string> files;
  std::string recipe_hash;
  nlohmann::json FilesJson() const;
};

// Fnv1aHex of the recipe's canonical JSON (the journal's recipe_hash).
std::string RecipeHash(const Recipe& recipe);

// The model's files: config.json, every shard the index names (or model.safetensors), the
// index, and the tokenizer files present. Labels are "model/<file name>".
StatusOr<std::map<std::string, std::string>> ModelFiles(const std::string& model_dir);

// Fingerprints the job's inputs. `cache_path` (JOB/inputs.json; empty: none) holds the hashes
// of earlier runs; it is rewritten when a file was hashed. Calibration files count only when the
// recipe reads (MethodNeeds::reads_calibration_text), resolved under data_root unless
// absolute. Errors name the file.
StatusOr<InputsFingerprint> FingerprintInputs(const Recipe& recipe, const std::string& model_dir,
                                              const std::string& data_root,
                                              const std::string& cache_path);

// What differs between an earlier run's files (a job_start's "inputs") and now, for messages:
// "model/model.safetensors changed, data/x.txt added". "the recipe or qcal's job format
// changed" when the files are the same.
std::string DescribeInputsChange(const nlohmann::json& before, const InputsFingerprint& now);

// The content hash (common/hash.h ContentHash) of a file, in 16 hex digits, read in 8 MiB
// pieces; the read error naming the file otherwise.
StatusOr<std::string> FileContentHash(const std::string& path);

}  // namespace qcal
