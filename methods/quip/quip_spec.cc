#include "methods/quip/quip_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/quant_specs.h"

namespace qcal::methods::quip {
namespace {

struct CodebookInfo {
  const char* name;
  int bits;
};
constexpr CodebookInfo kCodebooks[] = {
    {"e8p", 2},      {"rvq3_e8p_e8", 3}, {"rvq4_e8p_e8p", 4},
    {"halfint2", 2}, {"halfint3", 3},    {"halfint4", 4},
};

// Trellis codes (QTIP, kernels/trellis.h): the recipe names them, `bits` is k, `trellis_l` is L.
struct TrellisInfo {
  const char* name;
  int values_per_step;  // V
};
constexpr TrellisInfo kTrellisCodes[] = {{"qtip_1mad", 1}, {"qtip_3inst", 1}, {"qtip_hyb", 2}};

const char* DefaultCodebookForBits(int bits) {
  switch (bits) {
    case 2: return "e8p";
    case 3: return "rvq3_e8p_e8";
    case 4: return "rvq4_e8p_e8p";
    default: return nullptr;
  }
}

class QuipSpec final : public MethodSpec {
 public:
  const char* name() const override { return "quip"; }
  std::vector<std::string> keys() const override {
    return {"bits", "codebook", "trellis_l", "incoherence", "scale", "damp", "refine_sweeps"};
  }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe&) const override {
    auto c = std::make_shared<QuipConfig>();
    int64_t bits = 0;
    QCAL_RETURN_IF_ERROR(top.ReadInt("bits", &bits));
    const bool has_bits = top.Has("bits");
    if (has_bits && (bits < 2 || bits > 4)) {
      return top.KeyError("bits", absl::StrCat("must be 2, 3 or 4 for method quip, got ", bits));
    }
    const TrellisInfo* trellis = nullptr;
    if (top.Has("codebook")) {
      std::string codebook;
      QCAL_RETURN_IF_ERROR(top.ReadString("codebook", &codebook));
      const CodebookInfo* info = nullptr;
      std::vector<std::string> names;
      for (const CodebookInfo& cb : kCodebooks) {
        names.push_back(cb.name);
        if (codebook == cb.name) info = &cb;
      }
      for (const TrellisInfo& t : kTrellisCodes) {
        names.push_back(t.name);
        if (codebook == t.name) trellis = &t;
      }
      if (!info && !trellis) {
        std::string message = absl::StrCat("must be one of ", absl::StrJoin(names, ", "),
                                           ", got '", Printable(codebook), "'");
        const std::string suggestion = ClosestWithin2(codebook, names);
        if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
        return top.KeyError("codebook", message);
      }
      if (info) {
        if (has_bits && bits != info->bits) {
          return top.KeyError(
              "bits", absl::StrCat("is ", bits, " but codebook '", info->name, "' (line ",
                                   top.Line("codebook"), ") is a ", info->bits, "-bit codebook"));
        }
        c->codebook = info->name;
        c->bits = info->bits;
      } else {
        c->codebook = trellis->name;
        c->bits = has_bits ? static_cast<int>(bits) : 2;
      }
    } else {
      c->bits = has_bits ? static_cast<int>(bits) : 2;
      c->codebook = DefaultCodebookForBits(c->bits);
    }
    if (top.Has("trellis_l")) {
      if (!trellis) {
        return top.KeyError("trellis_l", absl::StrCat("applies only to the trellis codebooks "
                                                      "(qtip_1mad, qtip_3inst, qtip_hyb), not '",
                                                      c->codebook, "'"));
      }
      int64_t l = 0;
      QCAL_RETURN_IF_ERROR(top.ReadInt("trellis_l", &l));
      const int64_t min_l = static_cast<int64_t>(c->bits) * trellis->values_per_step + 2;
      if (l < min_l || l > 20) {
        return top.KeyError("trellis_l",
                            absl::StrCat("must be ", min_l, "..20 (state bits; more than k·V = ",
                                         c->bits * trellis->values_per_step, " + 1) for ",
                                         c->codebook, " at ", c->bits, " bits, got ", l));
      }
      c->trellis_l = static_cast<int>(l);
    }
    QCAL_RETURN_IF_ERROR(top.ReadBool("incoherence", &c->incoherence));
    QCAL_RETURN_IF_ERROR(top.ReadChoice("scale", {"row", "matrix", "auto"}, &c->scale_mode));
    QCAL_RETURN_IF_ERROR(ReadDamp(top, &c->damp));
    QCAL_RETURN_IF_ERROR(ReadRefineSweeps(top, &c->refine_sweeps));
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

MethodNeeds QuipConfig::needs() const {
  MethodNeeds n;
  n.float_hessians = true;
  n.supports_finetune = true;
  n.supports_moe = true;
  n.expert_parts = true;  // PerLinearQuantizer rounds each expert on its own
  return n;
}

bool QuipConfig::trellis() const { return codebook.rfind("qtip_", 0) == 0; }

std::string QuipConfig::kernel_codebook() const {
  if (!trellis()) return codebook;
  return absl::StrCat(codebook, "_l", trellis_l, "_k", bits);
}

void QuipConfig::AddToJson(nlohmann::json* j) const {
  (*j)["bits"] = bits;
  (*j)["codebook"] = codebook;
  if (trellis()) (*j)["trellis_l"] = trellis_l;  // absent for lattices: their JSON is unchanged
  (*j)["incoherence"] = incoherence;
  (*j)["scale"] = scale_mode;
  (*j)["damp"] = damp;
  (*j)["refine_sweeps"] = refine_sweeps;
}

void QuipConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  (*q)["format"] = "quip";
  (*q)["codebook"] = kernel_codebook();  // e.g. "e8p", "qtip_hyb_l16_k2" (kernels::MakeCodebook)
  (*q)["incoherence"] = incoherence;
  (*q)["scale"] = scale_mode;  // "row" | "matrix" | "auto" (each P.scale [out_pad] or [])
}

const MethodSpec& Spec() {
  static const QuipSpec spec;
  return spec;
}

}  // namespace qcal::methods::quip
