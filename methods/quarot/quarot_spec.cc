#include "methods/quarot/quarot_spec.h"

#include "absl/strings/str_cat.h"

namespace qcal::methods::quarot {
namespace {

class QuarotSpec final : public MethodSpec {
 public:
  const char* name() const override { return "quarot"; }
  std::vector<std::string> keys() const override { return QuarotKeys(); }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe&) const override {
    auto c = std::make_shared<QuarotConfig>();
    QCAL_RETURN_IF_ERROR(ParseQuarotKeys(top, c.get()));
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

std::vector<std::string> QuarotKeys() {
  return {"weights", "bits", "incoherence", "damp", "refine_sweeps", "scalar", "rotation",
          "activations", "kv_cache"};
}

Status ParseQuarotKeys(const RecipeSection& top, QuarotConfig* c) {
  {
    QCAL_RETURN_IF_ERROR(top.ReadString("weights", &c->weights));
    if (c->weights != "rtn" && c->weights != "gptq" && c->weights != "none") {
      std::string message =
          absl::StrCat("must be rtn, gptq or none, got '", Printable(c->weights), "'");
      const std::string suggestion = ClosestWithin2(c->weights, {"rtn", "gptq", "none"});
      if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
      return top.KeyError("weights", message);
    }
    if (!c->quantizes_weights()) {
      if (top.Has("bits")) {
        return top.KeyError("bits", absl::StrCat("does not apply with 'weights: none' (line ",
                                                 top.Line("weights"),
                                                 "): the weights stay in float"));
      }
      c->bits = 16;
    } else {
      QCAL_RETURN_IF_ERROR(ReadScalarBits(top, c->method(), &c->bits));
    }
    QCAL_RETURN_IF_ERROR(RefuseIncoherence(top, c->method()));
    if (!c->gptq() && top.Has("damp")) {
      return top.KeyError("damp", absl::StrCat("does not apply with 'weights: ", c->weights,
                                               "', which uses no Hessian"));
    }
    QCAL_RETURN_IF_ERROR(ReadDamp(top, &c->damp));
    if (!c->gptq() && top.Has("refine_sweeps")) {
      return top.KeyError("refine_sweeps", absl::StrCat("does not apply with 'weights: ",
                                                        c->weights, "', which uses no Hessian"));
    }
    QCAL_RETURN_IF_ERROR(ReadRefineSweeps(top, &c->refine_sweeps));
    if (!c->quantizes_weights() && top.Has("scalar")) {
      return top.KeyError("scalar", "does not apply with 'weights: none' (float weights)");
    }
    QCAL_RETURN_IF_ERROR(ReadScalarGrid(
        top, c->gptq() ? "" : absl::StrCat("applies only to 'weights: gptq', not ", c->weights),
        &c->scalar));
    QCAL_RETURN_IF_ERROR(
        ReadRotationSections(top, &c->rotation, &c->activations, &c->kv_cache));
  }
  return Status();
}

MethodNeeds QuarotConfig::needs() const {
  MethodNeeds n;
  n.sequential = sequential();
  n.transforms_non_block = true;
  n.supports_moe = true;  // routers and experts rotated, experts rounded like dense MLPs
  return n;
}

void QuarotConfig::AddToJson(nlohmann::json* j) const {
  (*j)["weights"] = weights;
  (*j)["incoherence"] = false;
  if (quantizes_weights()) {
    (*j)["bits"] = bits;
    (*j)["scalar"] = ScalarGridJson(scalar);
  }
  if (gptq()) {
    (*j)["damp"] = damp;
    (*j)["refine_sweeps"] = refine_sweeps;
  }
  (*j)["rotation"] = RotationJson(rotation);
  (*j)["activations"] = ActivationsJson(activations);
  (*j)["kv_cache"] = KvCacheJson(kv_cache);
}

void QuarotConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  AddScalarFormat(scalar, q);
}

const MethodSpec& Spec() {
  static const QuarotSpec spec;
  return spec;
}

}  // namespace qcal::methods::quarot
