#include "methods/spinquant/spinquant_spec.h"

#include "absl/strings/str_cat.h"

namespace qcal::methods::spinquant {
namespace {

class SpinquantSpec final : public MethodSpec {
 public:
  const char* name() const override { return "spinquant"; }
  std::vector<std::string> keys() const override {
    std::vector<std::string> k = quarot::QuarotKeys();
    k.push_back("training");
    return k;
  }
  StatusOr<std::shared_ptr<const MethodConfig>> Parse(const RecipeSection& top,
                                                      const Recipe& recipe) const override {
    auto c = std::make_shared<SpinquantConfig>();
    QCAL_RETURN_IF_ERROR(quarot::ParseQuarotKeys(top, c.get()));
    if (!c->rotation.enabled || !c->rotation.r1 || !c->rotation.r2) {
      return top.KeyError("rotation", "spinquant trains R1 and R2: rotation.enabled, r1 and r2 "
                                      "must be true (use method quarot for fixed rotations)");
    }
    if (c->kv_cache.enabled() && c->kv_cache.format != "int") {
      return top.KeyError("kv_cache", absl::StrCat("spinquant trains its rotations against the "
                                                   "int KV cache; format '", c->kv_cache.format,
                                                   "' is not supported"));
    }
    RotationTrainingSpec& t = c->training;
    // SpinQuant trains with float weights when GPTQ follows; with nothing else quantized the
    // rotations could change nothing, so then (and for RTN) training sees the target bits.
    const bool acts_or_kv = c->activations.enabled() || c->kv_cache.enabled();
    t.weight_bits = !c->quantizes_weights() || (c->gptq() && acts_or_kv) ? 16 : c->bits;
    QCAL_ASSIGN_OR_RETURN(
        RecipeSection s,
        top.ReadSection("training", {"steps", "lr", "batch", "grad_clip", "weight_bits",
                                     "checkpoint_every", "init", "loss", "range_gradient",
                                     "validation", "smooth", "smooth_lr"}));
    QCAL_RETURN_IF_ERROR(s.ReadInt("steps", &t.steps));
    QCAL_RETURN_IF_ERROR(s.RequireRange("steps", t.steps >= 1 && t.steps <= 100000, "1..100000",
                                        std::to_string(t.steps)));
    QCAL_RETURN_IF_ERROR(s.ReadDouble("lr", &t.lr));
    QCAL_RETURN_IF_ERROR(
        s.RequireRange("lr", t.lr > 0 && t.lr <= 100, "in (0, 100]", FormatDouble(t.lr)));
    QCAL_RETURN_IF_ERROR(s.ReadInt("batch", &t.batch));
    QCAL_RETURN_IF_ERROR(
        s.RequireRange("batch", t.batch >= 1 && t.batch <= 65536, "1..65536",
                       std::to_string(t.batch)));
    QCAL_RETURN_IF_ERROR(s.ReadDouble("grad_clip", &t.grad_clip));
    QCAL_RETURN_IF_ERROR(s.RequireRange("grad_clip", t.grad_clip >= 0, ">= 0",
                                        FormatDouble(t.grad_clip)));
    int64_t wb = t.weight_bits;
    QCAL_RETURN_IF_ERROR(s.ReadInt("weight_bits", &wb));
    QCAL_RETURN_IF_ERROR(s.RequireRange("weight_bits", (wb >= 2 && wb <= 8) || wb == 16,
                                        "2..8 or 16", std::to_string(wb)));
    t.weight_bits = static_cast<int>(wb);
    if (t.weight_bits >= 16 && !acts_or_kv) {
      if (!c->quantizes_weights()) {
        return top.Error("recipe quantizes nothing: weights none, activations and KV cache float");
      }
      return s.KeyError("weight_bits",
                        "is 16 with float activations and KV cache: nothing is quantized in "
                        "training, so the loss does not depend on the rotations (train with the "
                        "weights' bits, e.g. weight_bits: 4)");
    }
    QCAL_RETURN_IF_ERROR(s.ReadInt("checkpoint_every", &t.checkpoint_every));
    QCAL_RETURN_IF_ERROR(s.RequireRange("checkpoint_every", t.checkpoint_every >= 1, ">= 1",
                                        std::to_string(t.checkpoint_every)));
    QCAL_RETURN_IF_ERROR(s.ReadChoice("init", {"hadamard", "identity", "best"}, &t.init));
    QCAL_RETURN_IF_ERROR(s.ReadChoice("loss", {"kl", "ce"}, &t.loss));
    QCAL_RETURN_IF_ERROR(s.ReadBool("range_gradient", &t.range_gradient));
    const int64_t n = recipe.calibration.num_sequences;
    QCAL_RETURN_IF_ERROR(s.ReadInt("validation", &t.validation));
    QCAL_RETURN_IF_ERROR(s.RequireRange(
        "validation", t.validation >= 0 && t.validation < n,
        absl::StrCat("0..", n - 1, " (held out of calibration.num_sequences = ", n, ")"),
        std::to_string(t.validation)));
    QCAL_RETURN_IF_ERROR(s.ReadBool("smooth", &t.smooth));
    QCAL_RETURN_IF_ERROR(s.ReadDouble("smooth_lr", &t.smooth_lr));
    QCAL_RETURN_IF_ERROR(s.RequireRange("smooth_lr", t.smooth_lr > 0 && t.smooth_lr <= 10,
                                        "in (0, 10]", FormatDouble(t.smooth_lr)));
    return std::shared_ptr<const MethodConfig>(std::move(c));
  }
};

}  // namespace

MethodNeeds SpinquantConfig::needs() const {
  MethodNeeds n = QuarotConfig::needs();
  n.global_phases = {kRotationsPhase};
  return n;
}

void SpinquantConfig::AddToJson(nlohmann::json* j) const {
  QuarotConfig::AddToJson(j);
  (*j)["training"] = {{"steps", training.steps},         {"lr", training.lr},
                      {"batch", training.batch},         {"grad_clip", training.grad_clip},
                      {"weight_bits", training.weight_bits},
                      {"checkpoint_every", training.checkpoint_every},
                      {"init", training.init},
                      {"loss", training.loss},
                      {"range_gradient", training.range_gradient},
                      {"validation", training.validation}};
  // Only when on: recipes without it keep their recorded config (and pinned hashes).
  if (training.smooth) {
    (*j)["training"]["smooth"] = true;
    (*j)["training"]["smooth_lr"] = training.smooth_lr;
  }
}

const MethodSpec& Spec() {
  static const SpinquantSpec spec;
  return spec;
}

}  // namespace qcal::methods::spinquant
