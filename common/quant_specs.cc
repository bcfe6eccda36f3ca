#include "common/quant_specs.h"

#include "absl/strings/str_cat.h"

namespace qcal {

Status ReadScalarGrid(const RecipeSection& top, const std::string& act_order_error,
                      ScalarGridSpec* out) {
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection scalar,
      top.ReadSection("scalar", {"group_size", "symmetric", "act_order", "clip_search",
                                 "per_tensor", "scale_dtype"}));
  QCAL_RETURN_IF_ERROR(scalar.ReadInt("group_size", &out->group_size));
  QCAL_RETURN_IF_ERROR(scalar.RequireRange(
      "group_size", out->group_size == -1 || out->group_size > 0,
      "-1 (per output channel) or a positive group size", std::to_string(out->group_size)));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("symmetric", &out->symmetric));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("act_order", &out->act_order));
  if (out->act_order && !act_order_error.empty()) {
    return scalar.KeyError("act_order", act_order_error);
  }
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("clip_search", &out->clip_search));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("per_tensor", &out->per_tensor));
  QCAL_RETURN_IF_ERROR(scalar.ReadChoice("scale_dtype", {"f16", "f32"}, &out->scale_dtype));
  if (out->per_tensor && out->group_size != -1) {
    return scalar.KeyError("per_tensor", absl::StrCat("cannot be combined with group_size ",
                                                      out->group_size, " (line ",
                                                      scalar.Line("group_size"), ")"));
  }
  return Status();
}

nlohmann::json ScalarGridJson(const ScalarGridSpec& grid) {
  nlohmann::json j = {{"group_size", grid.group_size},
                      {"symmetric", grid.symmetric},
                      {"act_order", grid.act_order},
                      {"clip_search", grid.clip_search}};
  if (grid.per_tensor) j["per_tensor"] = true;  // left out when off (older JSON)
  if (grid.scale_dtype != "f32") j["scale_dtype"] = grid.scale_dtype;  // likewise
  return j;
}

void AddScalarFormat(const ScalarGridSpec& grid, nlohmann::json* q) {
  (*q)["format"] = "scalar";
  (*q)["group_size"] = grid.group_size;
  (*q)["symmetric"] = grid.symmetric;
  (*q)["desc_act"] = grid.act_order;
}

Status ReadScalarBits(const RecipeSection& top, const std::string& method, int* bits) {
  int64_t value = 2;
  QCAL_RETURN_IF_ERROR(top.ReadInt("bits", &value));
  if (top.Has("bits") && (value < 2 || value > 8)) {
    return top.KeyError("bits", absl::StrCat("must be in 2..8 for method ", method, ", got ",
                                             value));
  }
  *bits = static_cast<int>(value);
  return Status();
}

Status RefuseIncoherence(const RecipeSection& top, const std::string& method) {
  bool incoherence = false;
  QCAL_RETURN_IF_ERROR(top.ReadBool("incoherence", &incoherence));
  if (!incoherence) return Status();
  return top.KeyError("incoherence",
                      absl::StrCat("applies only to method quip; method ", method,
                                   " quantizes the weights as they are (remove the key or set it "
                                   "to false)"));
}

Status ReadDamp(const RecipeSection& top, double* damp) {
  QCAL_RETURN_IF_ERROR(top.ReadDouble("damp", damp));
  return top.RequireRange("damp", *damp > 0 && *damp <= 1, "in (0, 1]", FormatDouble(*damp));
}

Status ReadRefineSweeps(const RecipeSection& top, int* sweeps) {
  int64_t value = *sweeps;
  QCAL_RETURN_IF_ERROR(top.ReadInt("refine_sweeps", &value));
  QCAL_RETURN_IF_ERROR(top.RequireRange("refine_sweeps", value >= 0 && value <= 100, "in 0..100",
                                        std::to_string(value)));
  *sweeps = static_cast<int>(value);
  return Status();
}

Status ReadRotationSections(const RecipeSection& top, RotationSpec* rot,
                            ActivationQuantSpec* a, KvCacheSpec* k) {
  // --- rotation ---
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection rotation,
      top.ReadSection("rotation", {"enabled", "r1", "r2", "r3", "r4", "r4_block", "seed"}));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("enabled", &rot->enabled));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r1", &rot->r1));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r2", &rot->r2));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r3", &rot->r3));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r4", &rot->r4));
  QCAL_RETURN_IF_ERROR(rotation.ReadUint("seed", &rot->seed));
  if (rotation.Has("r4_block")) {
    if (rotation.ReadInt("r4_block", &rot->r4_block).ok()) {
      const int64_t b = rot->r4_block;
      QCAL_RETURN_IF_ERROR(rotation.RequireRange(
          "r4_block", b == 0 || (b >= 2 && (b & (b - 1)) == 0),
          "0 (the whole Hadamard), a power of two >= 2 or auto", std::to_string(b)));
    } else {
      std::string word;
      QCAL_RETURN_IF_ERROR(rotation.ReadChoice("r4_block", {"auto"}, &word));
      rot->r4_block = RotationSpec::kR4BlockAuto;
    }
  }

  // --- activations ---
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection act, top.ReadSection("activations",
                                         {"bits", "clip", "granularity", "static", "symmetric",
                                          "rule"}));
  if (top.Has("activations") && !act.Has("bits")) {
    return top.KeyError("activations", "needs 'bits' (2..8, or 16 for float activations)");
  }
  int64_t bits = a->bits;
  QCAL_RETURN_IF_ERROR(act.ReadInt("bits", &bits));
  QCAL_RETURN_IF_ERROR(act.RequireRange("bits", (bits >= 2 && bits <= 8) || bits == 16,
                                        "2..8, or 16 (not quantized)", std::to_string(bits)));
  a->bits = static_cast<int>(bits);
  QCAL_RETURN_IF_ERROR(act.ReadDouble("clip", &a->clip));
  QCAL_RETURN_IF_ERROR(act.RequireRange("clip", a->clip > 0 && a->clip <= 1, "in (0, 1]",
                                        FormatDouble(a->clip)));
  QCAL_RETURN_IF_ERROR(act.ReadChoice("granularity", {"per_token", "per_tensor"},
                                      &a->granularity));
  QCAL_RETURN_IF_ERROR(act.ReadBool("static", &a->is_static));
  if (a->is_static && a->granularity != "per_tensor") {
    return act.KeyError("static", "applies only to granularity per_tensor (per-token scales are "
                                  "computed from each token)");
  }
  QCAL_RETURN_IF_ERROR(act.ReadBool("symmetric", &a->symmetric));
  QCAL_RETURN_IF_ERROR(act.ReadChoice("rule", {"qcal", "humming"}, &a->rule));
  if (a->rule == "humming") {
    // Humming quantizes int4 and int8 inputs, symmetric, dynamic, per token, with no clipping
    // ratio (its scale is the token's own range).
    const char* why = nullptr;
    if (a->bits != 4 && a->bits != 8) {
      why = "needs bits 4 or 8 (Humming's integer input widths)";
    } else if (a->is_static || a->granularity != "per_token") {
      why = "needs granularity per_token, dynamic (Humming computes each token's scale)";
    } else if (!a->symmetric) {
      why = "needs symmetric: true (Humming's inputs are symmetric)";
    } else if (a->clip != 1.0) {
      why = "needs clip: 1.0 (Humming's scale is the token's whole range)";
    }
    if (why != nullptr) return act.KeyError("rule", absl::StrCat("humming ", why));
  }

  // --- kv_cache ---
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection kv, top.ReadSection("kv_cache", {"bits", "format", "granularity", "group",
                                                     "clip", "symmetric", "static", "k_sort",
                                                     "key_point"}));
  if (top.Has("kv_cache") && !kv.Has("bits")) {
    return top.KeyError("kv_cache", "needs 'bits' (2..8, or 16 for a float cache)");
  }
  QCAL_RETURN_IF_ERROR(kv.ReadChoice("format", {"int", "bfp", "fp8"}, &k->format));
  const bool bfp = k->format == "bfp";
  if (k->format == "fp8") {
    // E4M3 with one static scale per layer and role, as vLLM serves compressed-tensors'
    // kv_cache_scheme: nothing else to choose.
    bits = k->bits;
    QCAL_RETURN_IF_ERROR(kv.ReadInt("bits", &bits));
    QCAL_RETURN_IF_ERROR(kv.RequireRange("bits", bits == 8 || bits == 16,
                                         "8 (E4M3), or 16 (not quantized)", std::to_string(bits)));
    k->bits = static_cast<int>(bits);
    for (const char* key : {"granularity", "group", "clip", "symmetric", "k_sort", "key_point"}) {
      if (kv.Has(key)) {
        return kv.KeyError(key, "does not apply to format fp8 (E4M3 with one static scale per "
                                "layer for keys and one for values)");
      }
    }
    bool is_static = true;
    QCAL_RETURN_IF_ERROR(kv.ReadBool("static", &is_static));
    if (!is_static) {
      return kv.KeyError("static", "must be true for format fp8 (its scales are calibrated once, "
                                   "as compressed-tensors' kv_cache_scheme stores them)");
    }
    k->granularity = "per_tensor";
    k->is_static = true;
    return Status();
  }
  bits = k->bits;
  QCAL_RETURN_IF_ERROR(kv.ReadInt("bits", &bits));
  QCAL_RETURN_IF_ERROR(kv.RequireRange(
      "bits", (bits >= 2 && bits <= 8) || bits == 16,
      bfp ? "2..8 (mantissa bits, sign included), or 16 (not quantized)"
          : "2..8, or 16 (not quantized)",
      std::to_string(bits)));
  k->bits = static_cast<int>(bits);
  QCAL_RETURN_IF_ERROR(kv.ReadInt("group", &k->group));
  QCAL_RETURN_IF_ERROR(kv.RequireRange("group", k->group >= 0,
                                       "0 (= head_dim) or a positive channel count",
                                       std::to_string(k->group)));
  if (bfp) {
    for (const char* key : {"granularity", "clip", "symmetric", "static"}) {
      if (kv.Has(key)) {
        return kv.KeyError(key, "applies only to format int (bfp blocks of 'group' channels "
                                "share one exponent)");
      }
    }
    k->granularity = "per_group";
    QCAL_RETURN_IF_ERROR(kv.ReadChoice("key_point", {"pre_rope", "post_rope"}, &k->key_point));
  } else {
    if (kv.Has("key_point")) {
      return kv.KeyError("key_point", "applies only to format bfp (an int cache holds keys after "
                                      "RoPE and R3, as QuaRot quantizes them)");
    }
    QCAL_RETURN_IF_ERROR(kv.ReadChoice("granularity", {"per_group", "per_token", "per_tensor"},
                                       &k->granularity));
    QCAL_RETURN_IF_ERROR(kv.ReadDouble("clip", &k->clip));
    QCAL_RETURN_IF_ERROR(kv.RequireRange("clip", k->clip > 0 && k->clip <= 1, "in (0, 1]",
                                         FormatDouble(k->clip)));
    QCAL_RETURN_IF_ERROR(kv.ReadBool("symmetric", &k->symmetric));
    QCAL_RETURN_IF_ERROR(kv.ReadBool("static", &k->is_static));
    if (k->granularity == "per_tensor" && !k->is_static && k->enabled()) {
      return kv.KeyError("granularity", "per_tensor needs 'static: true' (a dynamic per-tensor "
                                        "scale would let later tokens change cached entries)");
    }
    if (k->is_static && k->granularity != "per_tensor") {
      return kv.KeyError("static", "applies only to granularity per_tensor");
    }
    if (kv.Has("group") && k->granularity != "per_group") {
      return kv.KeyError("group", "applies only to granularity per_group");
    }
  }
  QCAL_RETURN_IF_ERROR(kv.ReadBool("k_sort", &k->k_sort));
  if (k->k_sort && !bfp) {
    return kv.KeyError("k_sort", "applies only to format bfp");
  }
  if (k->k_sort && rot->enabled && rot->r3) {
    return kv.KeyError("k_sort", absl::StrCat(
        "cannot be combined with rotation.r3 (R3's Hadamard mixes every channel of a head after "
        "RoPE, so the sorted order never reaches the cache); set r3: false",
        rotation.Has("r3") ? absl::StrCat(" (line ", rotation.Line("r3"), ")") : ""));
  }
  return Status();
}

nlohmann::json RotationJson(const RotationSpec& r) {
  nlohmann::json j = {{"enabled", r.enabled}, {"r1", r.r1}, {"r2", r.r2},
                      {"r3", r.r3},           {"r4", r.r4}, {"seed", r.seed}};
  // Absent when 0: the recipes written before it hash the same.
  if (r.r4_block == RotationSpec::kR4BlockAuto) j["r4_block"] = "auto";
  if (r.r4_block > 0) j["r4_block"] = r.r4_block;
  return j;
}

nlohmann::json ActivationsJson(const ActivationQuantSpec& a) {
  nlohmann::json j = {{"bits", a.bits},
                      {"clip", a.clip},
                      {"granularity", a.granularity},
                      {"static", a.is_static},
                      {"symmetric", a.symmetric}};
  if (a.rule != "qcal") j["rule"] = a.rule;  // absent by default: older recipes hash the same
  return j;
}

nlohmann::json KvCacheJson(const KvCacheSpec& k) {
  if (k.format == "fp8") return {{"bits", k.bits}, {"format", k.format}};
  nlohmann::json kv = {{"bits", k.bits}, {"format", k.format}, {"k_sort", k.k_sort}};
  if (k.format == "bfp" || k.granularity == "per_group") kv["group"] = k.group;
  if (k.format == "bfp") kv["key_point"] = k.key_point;
  if (k.format != "bfp") {
    kv["granularity"] = k.granularity;
    kv["clip"] = k.clip;
    kv["symmetric"] = k.symmetric;
    kv["static"] = k.is_static;
  }
  return kv;
}

}  // namespace qcal
