// Recipe sections that several methods share (torch-free): the scalar weight grid of rtn, gptq
// and quarot; QuaRot's rotations and its simulated activation and KV-cache quantization, which
// the rotation methods share. Each has its reader (strict, line-numbered errors:
// common/recipe_section.h) and its JSON form; the methods decide which sections they accept.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "common/recipe_section.h"
#include "common/status.h"

namespace qcal {

// The integer grid of rtn / gptq weights.
struct ScalarGridSpec {
  int64_t group_size = -1;  // -1: per output channel
  bool symmetric = true;
  bool act_order = false;   // gptq only
  bool clip_search = false;
  bool per_tensor = false;  // one scale for the whole matrix (needs group_size -1)
  // "f16": scales rounded to IEEE half before the codes are chosen, so the GPTQ format (fp16
  // scales) and fp16 inference kernels hold exactly the quantizer's grid (the rtn and gptq
  // default); "f32": float32 scales (QuaRot's simulated-quantization default).
  std::string scale_dtype = "f32";
};
// Reads the `scalar` section of `top` over the defaults in *out. `act_order_error` non-empty:
// act_order: true is refused with that text ("applies only to method gptq").
Status ReadScalarGrid(const RecipeSection& top, const std::string& act_order_error,
                      ScalarGridSpec* out);
nlohmann::json ScalarGridJson(const ScalarGridSpec& grid);
// quantization_config of a checkpoint whose linears are in the scalar format
// (docs/formats.md): format "scalar", group_size, symmetric, desc_act.
void AddScalarFormat(const ScalarGridSpec& grid, nlohmann::json* q);

// `bits` of a scalar weight grid: 2..8 (default 2), "must be in 2..8 for method <method>".
Status ReadScalarBits(const RecipeSection& top, const std::string& method, int* bits);
// `incoherence` for methods that quantize the weights as they are: false is accepted (the JSON
// form of every recipe carries it), true is an error.
Status RefuseIncoherence(const RecipeSection& top, const std::string& method);

// Hessian damping δ of H + δ·mean(diag H)·I, key `damp` in (0, 1].
Status ReadDamp(const RecipeSection& top, double* damp);
// Refinement sweeps after LDLQ / GPTQ / BlockLDLQ (kernels::RefineRounding), key
// `refine_sweeps`, 0..100 (0: none).
Status ReadRefineSweeps(const RecipeSection& top, int* sweeps);

// QuaRot rotations. R1: randomized Hadamard of the hidden size fused into the embeddings, every
// block's input and output weights and the head (RMSNorm scales fused first); R2: per-head
// Hadamard fused into v_proj / o_proj; R3: online per-head Hadamard on queries and keys after
// RoPE; R4: online Hadamard on the down_proj input (its inverse fused into W_down).
struct RotationSpec {
  bool enabled = true;  // false: no rotation at all (the unrotated twin of a recipe)
  bool r1 = true, r2 = true, r3 = true, r4 = true;
  // R4's form: 0, QuaRot's Hadamard of the whole intermediate size (H_{2^k} ⊗ H_m); a power of
  // two b dividing it: the block-diagonal Sylvester Hadamard with blocks of b (H_b/√b on each
  // run of b inputs), the transform compressed-tensors' "hadamard" type with head_dim b
  // describes, so that the recipe exports with R4 online (docs/formats.md); kR4BlockAuto
  // ("auto" in a recipe): the largest such power of two, at most 4096.
  static constexpr int64_t kR4BlockAuto = -1;
  int64_t r4_block = 0;
  uint64_t seed = 0;    // random signs of R1
  bool any() const { return enabled && (r1 || r2 || r3 || r4); }
};

// Simulated quantization of every decoder-block linear input.
struct ActivationQuantSpec {
  int bits = 16;                          // 16: not quantized; else 2..8
  double clip = 0.9;                      // (0, 1]: scale = clip·max|x| / qmax
  std::string granularity = "per_token";  // per_token | per_tensor
  bool is_static = false;                 // per_tensor only: scales calibrated once ("static")
  bool symmetric = true;
  // How a dynamic per-token scale and code are computed:
  //   qcal:    s = clip·max|x| / qmax (double, rounded to float), code = clamp(nearbyint(x / s))
  //            with x / s in double (kernels/scalar_quant.h's grid);
  //   humming: vLLM's Humming input quantization (int4 and int8, symmetric, dynamic, per token,
  //            unclipped): in float32, s = max(max(max x, 1e-30) / (qmax + 0.49),
  //            -min(min x, -1e-30) / (qmax + 1.49)), code = nearbyint(x · (1 / s)), no clamp
  //            (docs/formats.md, "4-bit activations"). What a compressed-tensors W4A4 / W4A8
  //            checkpoint computes when vLLM serves it.
  std::string rule = "qcal";
  bool enabled() const { return bits < 16; }
};

// Simulated quantization of the KV cache: keys after RoPE (and R3), values.
struct KvCacheSpec {
  int bits = 16;                          // 16: not quantized. int: 2..8; bfp: mantissa bits 2..8;
                                          // fp8: 8
  // int | bfp (block floating point) | fp8 (E4M3 with static per-tensor scales per layer and
  // role, compressed-tensors' kv_cache_scheme: granularity per_tensor, is_static, always)
  std::string format = "int";
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

// The sections `rotation`, `activations` and `kv_cache` of `top` (their cross-checks included:
// K-sort with R3 is refused).
Status ReadRotationSections(const RecipeSection& top, RotationSpec* rotation,
                            ActivationQuantSpec* activations, KvCacheSpec* kv_cache);
nlohmann::json RotationJson(const RotationSpec& rotation);
nlohmann::json ActivationsJson(const ActivationQuantSpec& activations);
nlohmann::json KvCacheJson(const KvCacheSpec& kv_cache);

}  // namespace qcal
