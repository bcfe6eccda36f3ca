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
    return {"bits", "codebook", "incoherence", "scale", "damp", "refine_sweeps"};
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
    if (top.Has("codebook")) {
      std::string codebook;
      QCAL_RETURN_IF_ERROR(top.ReadString("codebook", &codebook));
      const CodebookInfo* info = nullptr;
      std::vector<std::string> names;
      for (const CodebookInfo& cb : kCodebooks) {
        names.push_back(cb.name);
        if (codebook == cb.name) info = &cb;
      }
      if (!info) {
        std::string message = absl::StrCat("must be one of ", absl::StrJoin(names, ", "),
                                           ", got '", Printable(codebook), "'");
        const std::string suggestion = ClosestWithin2(codebook, names);
        if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
        return top.KeyError("codebook", message);
      }
      if (has_bits && bits != info->bits) {
        return top.KeyError(
            "bits", absl::StrCat("is ", bits, " but codebook '", info->name, "' (line ",
                                 top.Line("codebook"), ") is a ", info->bits, "-bit codebook"));
      }
      c->codebook = info->name;
      c->bits = info->bits;
    } else {
      c->bits = has_bits ? static_cast<int>(bits) : 2;
      c->codebook = DefaultCodebookForBits(c->bits);
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
  return n;
}

void QuipConfig::AddToJson(nlohmann::json* j) const {
  (*j)["bits"] = bits;
  (*j)["codebook"] = codebook;
  (*j)["incoherence"] = incoherence;
  (*j)["scale"] = scale_mode;
  (*j)["damp"] = damp;
  (*j)["refine_sweeps"] = refine_sweeps;
}

void QuipConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  (*q)["format"] = "quip";
  (*q)["codebook"] = codebook;
  (*q)["incoherence"] = incoherence;
  (*q)["scale"] = scale_mode;  // "row" | "matrix" | "auto" (each P.scale [out_pad] or [])
}

const MethodSpec& Spec() {
  static const QuipSpec spec;
  return spec;
}

}  // namespace qcal::methods::quip
