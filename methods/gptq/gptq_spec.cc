#include "methods/gptq/gptq_spec.h"

namespace qcal::methods::gptq {
namespace {

class GptqSpec final : public MethodSpec {
 public:
  const char* name() const override { return "gptq"; }
  std::vector<std::string> keys() const override {
    return {"bits", "incoherence", "damp", "scalar", "refine_sweeps"};
  }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe&) const override {
    auto c = std::make_shared<GptqConfig>();
    QCAL_RETURN_IF_ERROR(ReadScalarBits(top, "gptq", &c->bits));
    QCAL_RETURN_IF_ERROR(RefuseIncoherence(top, "gptq"));
    QCAL_RETURN_IF_ERROR(ReadDamp(top, &c->damp));
    QCAL_RETURN_IF_ERROR(ReadRefineSweeps(top, &c->refine_sweeps));
    c->scalar.scale_dtype = "f16";  // exact in the GPTQ format engines load
    QCAL_RETURN_IF_ERROR(ReadScalarGrid(top, "", &c->scalar));
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

MethodNeeds GptqConfig::needs() const {
  MethodNeeds n;
  n.float_hessians = true;
  n.supports_finetune = true;
  n.supports_moe = true;
  n.expert_parts = true;  // PerLinearQuantizer rounds each expert on its own
  return n;
}

void GptqConfig::AddToJson(nlohmann::json* j) const {
  (*j)["bits"] = bits;
  (*j)["incoherence"] = false;
  (*j)["damp"] = damp;
  (*j)["refine_sweeps"] = refine_sweeps;
  (*j)["scalar"] = ScalarGridJson(scalar);
}

void GptqConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  AddScalarFormat(scalar, q);
}

const MethodSpec& Spec() {
  static const GptqSpec spec;
  return spec;
}

}  // namespace qcal::methods::gptq
