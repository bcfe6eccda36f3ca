// gptq: the standard GPTQ layout ("checkpoint_format": "gptq", a.k.a. v1) of docs/formats.md
// ("GPTQ export"): per linear qweight / qzeros / scales / g_idx packed from the stored grid
// (quant::PackGptq), quantization_config and quantize_config.json.
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "engine/model/tensor_io.h"
#include "export/format.h"

namespace qcal::exporter {
namespace {

class GptqFormat final : public Format {
 public:
  GptqFormat(const Source& source, TensorPlan* plan) : source_(source), plan_(plan) {}

  // The model's dtype: what engines run the unquantized tensors in.
  std::optional<DType> FloatDType() const override { return source_.model_dtype; }

  Status Check() override { return CheckServed(source_, "gptq", /*linear_inputs_allowed=*/false); }

  Status PlanLinear(const LinearRef& ref) override {
    if (FloatInPackedExport(source_.config, ref)) {
      plan_->AddDenseWeight(ref, source_.model_dtype);
      float_linears_ = true;
      return absl::OkStatus();
    }
    const std::string& prefix = ref.prefix;
    const int64_t layer = ref.layer;
    QCAL_ASSIGN_OR_RETURN(const GridShape g, ReadGridShape(source_, prefix));
    if (g.bits != 2 && g.bits != 3 && g.bits != 4 && g.bits != 8) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": ", prefix, " has ", g.bits,
          "-bit codes; the GPTQ format packs 2, 3, 4 or 8 bits"));
    }
    if ((g.in * g.bits) % 32 != 0 || (g.out * g.bits) % 32 != 0) {
      padded_.push_back(absl::StrCat(prefix, " (", g.out, " x ", g.in, ")"));
    }
    QCAL_RETURN_IF_ERROR(CheckExpressible(prefix, g));
    QCAL_RETURN_IF_ERROR(grid_.Add(source_, "gptq", prefix, g));

    // The packed tensors of this linear, made from its stored grid when the first is written and
    // freed after the last (g_idx).
    auto packed = std::make_shared<Packed>();
    auto pack = [packed, ref](const LoadedBlock& b) -> StatusOr<const quant::GptqTensors*> {
      if (packed->layer != ref.layer) {
        QCAL_ASSIGN_OR_RETURN(packed->tensors, quant::PackGptq(b.grid(ref), /*pad_words=*/true));
        packed->layer = ref.layer;
      }
      return &packed->tensors;
    };
    auto ints = [pack](std::vector<int32_t> quant::GptqTensors::*field) {
      return [pack, field](const LoadedBlock& b, const Sink& sink) -> Status {
        QCAL_ASSIGN_OR_RETURN(const quant::GptqTensors* t, pack(b));
        const std::vector<int32_t>& v = t->*field;
        return sink(v.data(), v.size() * sizeof(int32_t));
      };
    };
    const int64_t wrows = (g.in * g.bits + 31) / 32, zcols = (g.out * g.bits + 31) / 32;
    plan_->AddBlockTensor(prefix + ".qweight", DType::kI32, {wrows, g.out}, layer,
                          ints(&quant::GptqTensors::qweight));
    plan_->AddBlockTensor(prefix + ".qzeros", DType::kI32, {g.groups, zcols}, layer,
                          ints(&quant::GptqTensors::qzeros));
    plan_->AddBlockTensor(prefix + ".scales", DType::kF16, {g.groups, g.out}, layer,
                          [pack](const LoadedBlock& b, const Sink& sink) -> Status {
                            QCAL_ASSIGN_OR_RETURN(const quant::GptqTensors* t, pack(b));
                            return sink(t->scales.data(), t->scales.size() * sizeof(uint16_t));
                          });
    plan_->AddBlockTensor(prefix + ".g_idx", DType::kI32, {g.in}, layer,
                          [pack, packed, g, this](const LoadedBlock& b,
                                                  const Sink& sink) -> Status {
                            QCAL_ASSIGN_OR_RETURN(const quant::GptqTensors* t, pack(b));
                            // desc_act: any column whose group is not column / group_size.
                            for (int64_t j = 0; j < t->in_features; ++j) {
                              const int64_t plain = g.group_size == -1 ? 0 : j / g.group_size;
                              if (t->g_idx[j] != plain) desc_act_seen_ = true;
                            }
                            QCAL_RETURN_IF_ERROR(
                                sink(t->g_idx.data(), t->g_idx.size() * sizeof(int32_t)));
                            *packed = Packed();  // the linear's last tensor: free its packing
                            return absl::OkStatus();
                          });
    return absl::OkStatus();
  }

  void PlanDone() override {
    if (padded_.empty()) return;
    QCAL_LOG_WARN(
        "export: {} linears (first: {}) have in·bits or out·bits not a multiple of 32; their "
        "packed runs end in a zero-padded word (docs/formats.md), which loaders that assume "
        "whole words (transformers, vLLM) refuse. Every Llama shape packs whole words.",
        padded_.size(), padded_.front());
  }

  StatusOr<nlohmann::json> Finish(const std::string& dir, nlohmann::json* config) override {
    const GridShape& g = grid_.grid();
    nlohmann::json q = {{"quant_method", "gptq"},
                        {"bits", g.bits},
                        {"group_size", g.group_size},
                        {"desc_act", desc_act_seen_},
                        {"sym", g.symmetric},
                        {"static_groups", false},
                        {"true_sequential", true},
                        {"lm_head", false},
                        {"checkpoint_format", "gptq"}};
    if (float_linears_) {
      // Llama 4's q/k/v_proj, written in float (FloatInPackedExport): GPTQModel's "dynamic"
      // negative rule, which vLLM reads (re.match against the module's name, fused qkv_proj
      // included), keeps them unquantized.
      q["dynamic"] = {{R"(-:.*self_attn\.(q|k|v|qkv)_proj$)", nlohmann::json::object()}};
    }
    (*config)["quantization_config"] = q;
    // AutoGPTQ / GPTQModel read the same fields from quantize_config.json.
    QCAL_RETURN_IF_ERROR(WriteFileAtomic(dir + "/quantize_config.json", q.dump(2) + "\n"));
    return q;
  }

 private:
  struct Packed {
    int64_t layer = -1;
    quant::GptqTensors tensors;
  };

  // What the v1 format cannot hold exactly, from the stored scales and zero points (checked
  // before anything is written): scales that are not fp16 values, and an asymmetric zero point
  // of 0 (the format stores zero − 1, which wraps).
  Status CheckExpressible(const std::string& prefix, const GridShape& g) const {
    QCAL_ASSIGN_OR_RETURN(std::vector<float> scales, ReadGridScales(source_, prefix, g));
    for (size_t i = 0; i < scales.size(); ++i) {
      if (HalfToFloat(FloatToHalf(scales[i])) != scales[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            source_.dir, ": ", prefix, ": scale of output ", i / g.groups, " group ",
            i % g.groups, " (", scales[i], ") is not exact in fp16, the GPTQ format's scale "
            "type (the checkpoint was quantized with float32 scales: quantize it again with "
            "scalar.scale_dtype: f16, the rtn and gptq default)"));
      }
    }
    if (g.symmetric) return absl::OkStatus();
    QCAL_ASSIGN_OR_RETURN(std::vector<int64_t> zeros,
                          model::ReadInts(*source_.ckpt, prefix + ".zeros", {DType::kI32},
                                          {g.out, g.groups}));
    for (size_t i = 0; i < zeros.size(); ++i) {
      if (zeros[i] == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            source_.dir, ": ", prefix, ": output ", i / g.groups, " group ", i % g.groups,
            " has zero point 0, which the GPTQ v1 format cannot store (it stores zero − 1)"));
      }
    }
    return absl::OkStatus();
  }

  const Source& source_;
  TensorPlan* plan_;
  UniformGrid grid_;
  std::vector<std::string> padded_;  // linears whose packed runs end in a partial word
  bool desc_act_seen_ = false;
  bool float_linears_ = false;  // some linear written as a float weight
};

}  // namespace

std::unique_ptr<Format> MakeGptqFormat(const Source& source, TensorPlan* plan) {
  return std::make_unique<GptqFormat>(source, plan);
}

}  // namespace qcal::exporter
