#include "methods/prefixquant/prefixquant_spec.h"

#include "absl/strings/str_cat.h"

namespace qcal::methods::prefixquant {
namespace {

// `bits` of `section` (the top level or a sub-section): 2..8, or 16.
Status ReadBits(const RecipeSection& section, const std::string& key, int* bits) {
  int64_t b = *bits;
  QCAL_RETURN_IF_ERROR(section.ReadInt(key, &b));
  QCAL_RETURN_IF_ERROR(section.RequireRange(key, (b >= 2 && b <= 8) || b == 16,
                                            "2..8, or 16 (not quantized)", std::to_string(b)));
  *bits = static_cast<int>(b);
  return Status();
}

class PrefixquantSpec final : public MethodSpec {
 public:
  const char* name() const override { return "prefixquant"; }
  std::vector<std::string> keys() const override {
    return {"bits", "incoherence", "activations", "kv_cache", "rotation", "prefix",
            "grid_search", "search_sequences", "block_ft"};
  }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe&) const override {
    auto c = std::make_shared<PrefixquantConfig>();
    QCAL_RETURN_IF_ERROR(ReadBits(top, "bits", &c->bits));
    QCAL_RETURN_IF_ERROR(RefuseIncoherence(top, "prefixquant"));
    QCAL_ASSIGN_OR_RETURN(RecipeSection act, top.ReadSection("activations", {"bits"}));
    QCAL_RETURN_IF_ERROR(ReadBits(act, "bits", &c->act_bits));
    QCAL_ASSIGN_OR_RETURN(RecipeSection kv, top.ReadSection("kv_cache", {"bits"}));
    QCAL_RETURN_IF_ERROR(ReadBits(kv, "bits", &c->kv_bits));
    QCAL_ASSIGN_OR_RETURN(
        RecipeSection rotation,
        top.ReadSection("rotation", {"enabled", "r1", "r2", "r3", "r4", "seed"}));
    QCAL_RETURN_IF_ERROR(rotation.ReadBool("enabled", &c->rotation.enabled));
    QCAL_RETURN_IF_ERROR(rotation.ReadBool("r1", &c->rotation.r1));
    QCAL_RETURN_IF_ERROR(rotation.ReadBool("r2", &c->rotation.r2));
    QCAL_RETURN_IF_ERROR(rotation.ReadBool("r3", &c->rotation.r3));
    QCAL_RETURN_IF_ERROR(rotation.ReadBool("r4", &c->rotation.r4));
    QCAL_RETURN_IF_ERROR(rotation.ReadUint("seed", &c->rotation.seed));
    QCAL_ASSIGN_OR_RETURN(RecipeSection prefix, top.ReadSection("prefix", {"enabled", "threshold"}));
    QCAL_RETURN_IF_ERROR(prefix.ReadBool("enabled", &c->prefix));
    QCAL_RETURN_IF_ERROR(prefix.ReadDouble("threshold", &c->threshold));
    QCAL_RETURN_IF_ERROR(prefix.RequireRange("threshold", c->threshold > 1, "> 1",
                                             FormatDouble(c->threshold)));
    if (!c->prefix && prefix.Has("threshold")) {
      return prefix.KeyError("threshold", "does not apply with 'enabled: false' (no prefix)");
    }
    QCAL_RETURN_IF_ERROR(top.ReadBool("grid_search", &c->grid_search));
    QCAL_RETURN_IF_ERROR(top.ReadInt("search_sequences", &c->search_sequences));
    QCAL_RETURN_IF_ERROR(top.RequireRange("search_sequences", c->search_sequences >= 1, ">= 1",
                                          std::to_string(c->search_sequences)));
    QCAL_ASSIGN_OR_RETURN(
        RecipeSection ft, top.ReadSection("block_ft", {"enabled", "epochs", "batch", "lr_weights",
                                                       "lr_steps", "val_sequences"}));
    BlockFtSpec& f = c->block_ft;
    QCAL_RETURN_IF_ERROR(ft.ReadBool("enabled", &f.enabled));
    QCAL_RETURN_IF_ERROR(ft.ReadInt("epochs", &f.epochs));
    QCAL_RETURN_IF_ERROR(ft.RequireRange("epochs", f.epochs >= 1 && f.epochs <= 1000, "1..1000",
                                         std::to_string(f.epochs)));
    QCAL_RETURN_IF_ERROR(ft.ReadInt("batch", &f.batch));
    QCAL_RETURN_IF_ERROR(
        ft.RequireRange("batch", f.batch >= 1, ">= 1", std::to_string(f.batch)));
    QCAL_RETURN_IF_ERROR(ft.ReadDouble("lr_weights", &f.lr_weights));
    QCAL_RETURN_IF_ERROR(ft.RequireRange("lr_weights", f.lr_weights >= 0 && f.lr_weights < 1,
                                         "in [0, 1)", FormatDouble(f.lr_weights)));
    QCAL_RETURN_IF_ERROR(ft.ReadDouble("lr_steps", &f.lr_steps));
    QCAL_RETURN_IF_ERROR(ft.RequireRange("lr_steps", f.lr_steps >= 0 && f.lr_steps < 1,
                                         "in [0, 1)", FormatDouble(f.lr_steps)));
    QCAL_RETURN_IF_ERROR(ft.ReadInt("val_sequences", &f.val_sequences));
    QCAL_RETURN_IF_ERROR(ft.RequireRange("val_sequences", f.val_sequences >= 0, ">= 0",
                                         std::to_string(f.val_sequences)));
    if (!f.enabled) {
      for (const char* key : {"epochs", "batch", "lr_weights", "lr_steps", "val_sequences"}) {
        if (ft.Has(key)) return ft.KeyError(key, "does not apply with 'enabled: false'");
      }
    }
    if (!c->quantizes_weights() && !c->quantizes_activations() && !c->quantizes_kv()) {
      return top.Error("recipe quantizes nothing: bits, activations.bits and kv_cache.bits are "
                       "all 16");
    }
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

MethodNeeds PrefixquantConfig::needs() const {
  MethodNeeds n;
  n.sequential = true;
  n.transforms_non_block = true;
  n.sequential_float = block_ft.enabled;
  if (prefix) n.global_phases = {kPrefixPhase};
  return n;
}

void PrefixquantConfig::AddToJson(nlohmann::json* j) const {
  (*j)["bits"] = bits;
  (*j)["incoherence"] = false;
  (*j)["activations"] = {{"bits", act_bits}};
  (*j)["kv_cache"] = {{"bits", kv_bits}};
  (*j)["rotation"] = RotationJson(rotation);
  nlohmann::json p = {{"enabled", prefix}};
  if (prefix) p["threshold"] = threshold;
  (*j)["prefix"] = p;
  (*j)["grid_search"] = grid_search;
  (*j)["search_sequences"] = search_sequences;
  nlohmann::json ft = {{"enabled", block_ft.enabled}};
  if (block_ft.enabled) {
    ft["epochs"] = block_ft.epochs;
    ft["batch"] = block_ft.batch;
    ft["lr_weights"] = block_ft.lr_weights;
    ft["lr_steps"] = block_ft.lr_steps;
    ft["val_sequences"] = block_ft.val_sequences;
  }
  (*j)["block_ft"] = ft;
}

void PrefixquantConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  ScalarGridSpec grid;  // per output channel, symmetric, no act-order
  grid.group_size = -1;
  grid.symmetric = true;
  grid.act_order = false;
  AddScalarFormat(grid, q);
}

const MethodSpec& Spec() {
  static const PrefixquantSpec spec;
  return spec;
}

}  // namespace qcal::methods::prefixquant
