// Job recipes: every parameter of a quantization job, read from a YAML file in jobs/.
//
// A recipe names the method and all its settings; unknown keys and bad values are errors naming
// the file and the key (a typo never silently falls back to a default). Example:
//
//   name: quip-e8p-2bit
//   method: quip            # quip | rtn | gptq
//   bits: 2                 # quip: 2 (e8p, halfint2), 3 (rvq3), 4 (rvq4); rtn/gptq: 2..8
//   codebook: e8p           # quip only: e8p | rvq3_e8p_e8 | rvq4_e8p_e8p | halfint2|3|4
//   incoherence: true       # quip only: randomized Hadamard (RFFT fallback) on W and H
//   scale: row              # quip only: row (one scale per row of the rotated W, RMS(row)/ρ) |
//                           #   matrix (QuIP#'s one scale per matrix, RMS(W)/ρ)
//   seed: 0
//   damp: 0.01              # δ of H + δ·mean(diag H)·I (quip, gptq)
//   scalar:                 # rtn / gptq grid
//     group_size: -1        # -1 = per output channel
//     symmetric: true
//     act_order: false      # gptq only
//     clip_search: false
//   calibration:
//     files: [data/tinystories/TinyStories-valid.sample30k.txt]   # relative to the data root
//     num_sequences: 64
//     seq_len: 128
//     seed: 0
//   finetune:
//     enabled: false
//     block: {epochs: 5, lr: 5.0e-5, batch: 8, holdout: 0.1}
//     end_to_end: {enabled: false, epochs: 3, lr: 5.0e-5, batch: 8, holdout: 0.1}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace qcal {

enum class QuantMethod { kQuip, kRtn, kGptq };
const char* QuantMethodName(QuantMethod method);

struct ScalarGridSpec {
  int64_t group_size = -1;  // -1: per output channel
  bool symmetric = true;
  bool act_order = false;
  bool clip_search = false;
};

struct CalibrationSpec {
  std::vector<std::string> files;  // relative paths are resolved against the data root
  int64_t num_sequences = 64;
  int64_t seq_len = 128;  // tokens per sequence including BOS; capped at the model's max
  uint64_t seed = 0;
};

struct FinetuneStage {
  bool enabled = false;
  int64_t epochs = 5;
  double lr = 5e-5;
  int64_t batch = 8;
  double holdout = 0.1;  // fraction of calibration sequences held out to pick the best epoch
};

struct FinetuneSpec {
  bool enabled = false;   // QuIP# Algorithm 5 within each block
  FinetuneStage block;    // within-block settings (enabled follows FinetuneSpec::enabled)
  FinetuneStage end_to_end;
};

struct Recipe {
  std::string name;
  QuantMethod method = QuantMethod::kQuip;
  int bits = 2;
  std::string codebook = "e8p";  // quip only
  bool incoherence = true;       // quip only
  // quip only: "row" = one codebook scale per row of the rotated weight (RMS(row)/ρ), "matrix" =
  // one per matrix (RMS(W)/ρ, the QuIP# paper's rule). Empty for rtn/gptq.
  std::string scale_mode = "row";
  uint64_t seed = 0;
  double damp = 0.01;
  ScalarGridSpec scalar;
  CalibrationSpec calibration;
  FinetuneSpec finetune;

  // Whether the method needs Hessians (quip, gptq) — rtn does not calibrate unless fine-tuning.
  bool needs_hessians() const { return method != QuantMethod::kRtn; }
  nlohmann::json ToJson() const;
};

// Parses YAML text. `source` names the file in errors ("jobs/x.yaml: key 'bitz' is unknown").
StatusOr<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source);
StatusOr<Recipe> LoadRecipe(const std::string& path);

}  // namespace qcal
