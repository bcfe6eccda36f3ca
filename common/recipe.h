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
//
// QuaRot (method quarot; jobs/README.md "method quarot"): rotations fused into the weights and
// applied online, simulated activation and KV-cache quantization, weights by RTN or GPTQ:
//
//   method: quarot
//   weights: gptq           # rtn | gptq | none (float weights)
//   bits: 4                 # weight bits 2..8 (not with weights: none)
//   scalar: {group_size: -1, symmetric: true, act_order: false, clip_search: true}
//   rotation: {enabled: true, r1: true, r2: true, r3: true, r4: true, seed: 0}
//   activations: {bits: 4, clip: 0.9, granularity: per_token, static: false}
//   kv_cache: {bits: 4, format: int, granularity: per_group, group: 0, clip: 0.95,
//              symmetric: false, static: false}
//   kv_cache: {bits: 4, format: bfp, group: 4, key_point: pre_rope, k_sort: true}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace qcal {

enum class QuantMethod { kQuip, kRtn, kGptq, kQuarot };
const char* QuantMethodName(QuantMethod method);

struct ScalarGridSpec {
  int64_t group_size = -1;  // -1: per output channel
  bool symmetric = true;
  bool act_order = false;
  bool clip_search = false;
  bool per_tensor = false;  // one scale for the whole matrix (needs group_size -1)
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

// QuaRot rotations (method quarot). R1: randomized Hadamard of the hidden size fused into the
// embeddings, every block's input and output weights and the head (RMSNorm scales fused first);
// R2: per-head Hadamard fused into v_proj / o_proj; R3: online per-head Hadamard on queries and
// keys after RoPE; R4: online Hadamard on the down_proj input (its inverse fused into W_down).
struct RotationSpec {
  bool enabled = true;  // false: no rotation at all (the unrotated twin of a recipe)
  bool r1 = true, r2 = true, r3 = true, r4 = true;
  uint64_t seed = 0;    // random signs of R1
  bool any() const { return enabled && (r1 || r2 || r3 || r4); }
};

// Simulated quantization of every decoder-block linear input (method quarot).
struct ActivationQuantSpec {
  int bits = 16;                          // 16: not quantized; else 2..8
  double clip = 0.9;                      // (0, 1]: scale = clip·max|x| / qmax
  std::string granularity = "per_token";  // per_token | per_tensor
  bool is_static = false;                 // per_tensor only: scales calibrated once ("static")
  bool symmetric = true;
  bool enabled() const { return bits < 16; }
};

// Simulated quantization of the KV cache (method quarot): keys after RoPE (and R3), values.
struct KvCacheSpec {
  int bits = 16;                          // 16: not quantized. int: 2..8; bfp: mantissa bits 2..8
  std::string format = "int";             // int | bfp (block floating point)
  std::string granularity = "per_group";  // int: per_group | per_token | per_tensor
  int64_t group = 0;                      // per_group channels (0 = head_dim); bfp block size
  double clip = 0.95;                     // int only, (0, 1]
  bool symmetric = false;                 // int only (QuaRot: asymmetric)
  bool is_static = false;                 // int per_tensor only: ranges calibrated once
  bool k_sort = false;                    // bfp only: K-sort channel permutation of the keys
  // bfp only: where keys enter the cache: pre_rope (k_proj's output, the K-sort paper's cache)
  // or post_rope (after RoPE and R3, as the int cache and HF's cache hold them).
  std::string key_point = "pre_rope";
  bool enabled() const { return bits < 16; }
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
  // method quarot only: weight rounding ("rtn", "gptq", or "none" for float weights; empty for
  // other methods), rotations, activation and KV-cache quantization.
  std::string weights;
  RotationSpec rotation;
  ActivationQuantSpec activations;
  KvCacheSpec kv_cache;

  // Whether the method needs Hessians (quip, gptq, quarot with gptq weights) — rtn does not
  // calibrate unless fine-tuning.
  bool needs_hessians() const {
    return method == QuantMethod::kQuarot ? weights == "gptq" : method != QuantMethod::kRtn;
  }
  // method quarot: its calibration (GPTQ Hessians, static ranges) runs inside the block tasks,
  // sequentially — block l is calibrated on the outputs of the quantized blocks before it — so
  // block l can start only once block l-1 is done. QuaRot never uses the float-model
  // calibration phase (calibrated_by_block_tasks()).
  bool sequential_calibration() const {
    return method == QuantMethod::kQuarot &&
           (weights == "gptq" || (activations.enabled() && activations.is_static) ||
            (kv_cache.enabled() && kv_cache.is_static));
  }
  bool calibrated_by_block_tasks() const { return method == QuantMethod::kQuarot; }
  // The rounding of the weights: quarot's `weights` mapped onto rtn/gptq (kQuip for quip).
  bool quantizes_weights() const { return method != QuantMethod::kQuarot || weights != "none"; }
  nlohmann::json ToJson() const;
};

// Parses YAML text. `source` names the file in errors ("jobs/x.yaml: key 'bitz' is unknown").
StatusOr<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source);
StatusOr<Recipe> LoadRecipe(const std::string& path);

}  // namespace qcal
