#include "methods/rtn/rtn_spec.h"

namespace qcal::methods::rtn {
namespace {

class RtnSpec final : public MethodSpec {
 public:
  const char* name() const override { return "rtn"; }
  std::vector<std::string> keys() const override {
    return {"bits", "incoherence", "damp", "scalar"};
  }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe&) const override {
    auto c = std::make_shared<RtnConfig>();
    QCAL_RETURN_IF_ERROR(ReadScalarBits(top, "rtn", &c->bits));
    QCAL_RETURN_IF_ERROR(RefuseIncoherence(top, "rtn"));
    if (top.Has("damp")) {
      return top.KeyError("damp", "does not apply to method rtn, which uses no Hessian");
    }
    c->scalar.scale_dtype = "f16";  // exact in the GPTQ format engines load
    QCAL_RETURN_IF_ERROR(
        ReadScalarGrid(top, "applies only to method gptq, not rtn", &c->scalar));
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

MethodNeeds RtnConfig::needs() const {
  MethodNeeds n;
  n.supports_finetune = true;
  n.supports_moe = true;
  n.expert_parts = true;  // PerLinearQuantizer rounds each expert on its own
  return n;
}

void RtnConfig::AddToJson(nlohmann::json* j) const {
  (*j)["bits"] = bits;
  (*j)["incoherence"] = false;
  (*j)["scalar"] = ScalarGridJson(scalar);
}

void RtnConfig::AddToQuantizationConfig(nlohmann::json* q) const {
  AddScalarFormat(scalar, q);
}

const MethodSpec& Spec() {
  static const RtnSpec spec;
  return spec;
}

}  // namespace qcal::methods::rtn
