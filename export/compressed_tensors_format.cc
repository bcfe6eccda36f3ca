// compressed-tensors: the format llm-compressor writes and vLLM and transformers load
// (docs/formats.md "compressed-tensors export"): pack-quantized weights (or int-quantized for
// W8A8) from the stored grids, input_activations from the served forward's linear input
// quantizer (static ranges per linear as input_scale / input_zero_point), and block Hadamards
// on linear inputs as transform_config.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/model/tensor_io.h"
#include "export/format.h"

namespace qcal::exporter {
namespace {

class CompressedTensorsFormat final : public Format {
 public:
  CompressedTensorsFormat(const Source& source, TensorPlan* plan)
      : source_(source), plan_(plan), act_(source.served.linear_inputs) {}

  std::optional<DType> FloatDType() const override { return source_.model_dtype; }

  Status Check() override {
    QCAL_RETURN_IF_ERROR(
        CheckServed(source_, "compressed-tensors", /*linear_inputs_allowed=*/true,
                    /*kv_cache_allowed=*/true));
    if (act_) QCAL_RETURN_IF_ERROR(CheckInputActivations(*act_));
    if (act_ && source_.config.is_moe()) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": cannot export to compressed-tensors: the recipe quantizes linear "
          "inputs, and the export writes input activations for dense linears only, not for a "
          "mixture-of-experts model's routed experts"));
    }
    if (!source_.served.input_hadamards.empty() && source_.config.is_moe()) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": cannot export to compressed-tensors: the model's down_proj inputs "
          "take an online Hadamard (R4), and the export writes the transform for dense linears "
          "only, not for a mixture-of-experts model's routed experts"));
    }
    // One config group describes every linear: activation order anywhere puts g_idx on all.
    for (int64_t l = 0; l < source_.config.num_hidden_layers && !actorder_; ++l) {
      for (const LinearRef& ref : BlockLinears(source_.config, l)) {
        if (FloatInPackedExport(source_.config, ref)) continue;
        QCAL_ASSIGN_OR_RETURN(const GridShape g, Grid(ref));
        QCAL_ASSIGN_OR_RETURN(const bool ordered, HasActOrder(ref.prefix, g));
        if (ordered) {
          if (g.group_size == -1) continue;  // one group per row: any order is the same
          actorder_ = true;
          break;
        }
      }
    }
    if (act_ && act_->rule == "humming" && actorder_) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": cannot export to compressed-tensors with ", act_->bits,
          "-bit inputs: the weights' groups follow activation order (g_idx), which vLLM's "
          "Humming kernels, the ones that serve quantized inputs with pack-quantized weights, "
          "do not load; quantize with scalar.act_order: false or per-channel groups"));
    }
    return absl::OkStatus();
  }

  Status PlanLinear(const LinearRef& ref) override {
    if (source_.served.kv_cache && ref.expert < 0 && ref.kind == model::LinearKind::kK) {
      PlanKvScales(ref);
    }
    if (FloatInPackedExport(source_.config, ref)) {
      plan_->AddDenseWeight(ref, source_.model_dtype);
      float_attention_ = true;
      return absl::OkStatus();
    }
    QCAL_ASSIGN_OR_RETURN(const GridShape g, Grid(ref));
    if (IntFormat(g)) {
      PlanIntLinear(ref, g);
    } else {
      PlanPackedLinear(ref, g);
    }
    if (act_ && act_->is_static) PlanStaticInput(ref.prefix, ref.layer, ref.kind);
    return absl::OkStatus();
  }

  StatusOr<nlohmann::json> Finish(const std::string&, nlohmann::json* config) override {
    const GridShape& g = grid_.grid();
    nlohmann::json weights = {
        {"num_bits", g.bits},
        {"type", "int"},
        {"symmetric", g.symmetric},
        {"strategy", g.group_size == -1 ? "channel" : "group"},
        {"group_size", g.group_size == -1 ? nlohmann::json() : nlohmann::json(g.group_size)},
        {"actorder", actorder_ ? nlohmann::json("group") : nlohmann::json()},
        {"block_structure", nullptr},
        {"dynamic", false},
        {"observer", "minmax"},
        {"observer_kwargs", nlohmann::json::object()}};
    const std::string format = IntFormat(g) ? "int-quantized" : "pack-quantized";
    nlohmann::json inputs;  // null: float inputs
    if (act_) {
      inputs = {{"num_bits", act_->bits},
                {"type", "int"},
                {"symmetric", act_->symmetric},
                {"strategy", act_->is_static ? "tensor" : "token"},
                {"group_size", nullptr},
                {"block_structure", nullptr},
                {"dynamic", !act_->is_static},
                {"actorder", nullptr},
                {"observer", act_->is_static ? nlohmann::json("minmax") : nlohmann::json()},
                {"observer_kwargs", nlohmann::json::object()}};
    }
    // Block Hadamards on linear inputs: compressed-tensors' "hadamard" transform with head_dim =
    // the block, online on the input and (inverse) already fused into the weight, as its
    // TransformArgs say.
    nlohmann::json transforms = nlohmann::json::object();
    for (const methods::ServedForward::InputHadamard& h : source_.served.input_hadamards) {
      const std::string target = absl::StrCat(
          "re:.*", absl::StrReplaceAll(model::LinearName(h.linear), {{".", "\\."}}), "$");
      transforms[absl::StrCat("hadamard_", model::LinearName(h.linear))] = {
          {"type", "hadamard"},
          {"apply",
           {{{"targets", {target}}, {"location", "input"}, {"inverse", false},
             {"ignore", nlohmann::json::array()}},
            {{"targets", {target}}, {"location", "weight_input"}, {"inverse", true},
             {"ignore", nlohmann::json::array()}}}},
          {"randomize", false},
          {"requires_grad", false},
          {"head_dim", h.block},
          {"precision", "torch.float32"}};
    }
    nlohmann::json q = {{"quant_method", "compressed-tensors"},
                        {"format", format},
                        {"quantization_status", "compressed"},
                        {"global_compression_ratio", nullptr},
                        {"kv_cache_scheme", nullptr},
                        {"ignore", Ignored()},
                        {"config_groups",
                         {{"group_0",
                           {{"targets", {"Linear"}},
                            {"weights", weights},
                            {"input_activations", inputs},
                            {"output_activations", nullptr},
                            {"format", format}}}}}};
    if (!transforms.empty()) q["transform_config"] = {{"config_groups", transforms}};
    // An FP8 cache: E4M3, one static scale per layer for keys and one for values (the
    // self_attn.k_scale / v_scale tensors).
    if (source_.served.kv_cache) {
      q["kv_cache_scheme"] = {{"num_bits", 8},
                              {"type", "float"},
                              {"symmetric", true},
                              {"strategy", "tensor"},
                              {"group_size", nullptr},
                              {"block_structure", nullptr},
                              {"dynamic", false},
                              {"actorder", nullptr},
                              {"observer", "minmax"},
                              {"observer_kwargs", nlohmann::json::object()}};
    }
    (*config)["quantization_config"] = q;
    return q;
  }

 private:
  // What vLLM and transformers must leave unquantized: the head; a mixture of experts' routers
  // (kept in float by qcal); Llama 4's q/k/v_proj (FloatInPackedExport), and a multimodal
  // checkpoint's vision tower and projector (copied as stored). The patterns llm-compressor
  // writes for the same modules.
  nlohmann::json Ignored() const {
    nlohmann::json ignore = {source_.config.tensor_prefix + "lm_head"};
    if (source_.config.family == ModelFamily::kMixtral) {
      ignore.push_back(R"(re:.*block_sparse_moe\.gate$)");
    } else if (source_.config.family == ModelFamily::kLlama4) {
      if (source_.config.is_moe()) ignore.push_back(R"(re:.*feed_forward\.router$)");
      if (float_attention_) ignore.push_back(R"(re:.*self_attn\.(q|k|v)_proj$)");
      if (!source_.config.tensor_prefix.empty()) {
        ignore.push_back("re:vision_model.*");
        ignore.push_back("re:multi_modal_projector.*");
      }
    }
    return ignore;
  }

  // The grid of linear `ref`, checked: 2 to 8 bits, scales exact in the model's dtype, the same
  // grid as every other linear.
  StatusOr<GridShape> Grid(const LinearRef& ref) {
    const std::string& prefix = ref.prefix;
    QCAL_ASSIGN_OR_RETURN(const GridShape g, ReadGridShape(source_, prefix));
    if (g.bits < 2 || g.bits > 8) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": ", prefix, " has ", g.bits,
          "-bit codes; compressed-tensors' pack-quantized format packs 2 to 8 bits"));
    }
    QCAL_RETURN_IF_ERROR(CheckScalesExact(prefix, g));
    if (act_ && !IntFormat(g)) QCAL_RETURN_IF_ERROR(CheckHummingWeights(prefix, g));
    QCAL_RETURN_IF_ERROR(grid_.Add(source_, "compressed-tensors", prefix, g));
    return g;
  }

  // compressed-tensors stores the scales in the model's dtype (vLLM and transformers load them
  // into parameters of that dtype): each must be exact there.
  Status CheckScalesExact(const std::string& prefix, const GridShape& g) const {
    const DType dtype = source_.model_dtype;
    if (dtype == DType::kF32) return absl::OkStatus();
    QCAL_ASSIGN_OR_RETURN(std::vector<float> scales, ReadGridScales(source_, prefix, g));
    std::vector<uint8_t> narrow(scales.size() * DTypeSize(dtype));
    std::vector<float> back(scales.size());
    ConvertFromF32(dtype, scales.data(), scales.size(), narrow.data());
    ConvertToF32(dtype, narrow.data(), scales.size(), back.data());
    for (size_t i = 0; i < scales.size(); ++i) {
      if (back[i] != scales[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            source_.dir, ": ", prefix, ": scale of output ", i / g.groups, " group ",
            i % g.groups, " (", scales[i], ") is not exact in ", std::string(DTypeName(dtype)),
            ", the model's dtype, which compressed-tensors stores scales in"));
      }
    }
    return absl::OkStatus();
  }

  // Whether `prefix`'s stored g_idx assigns any column to a group other than column / group
  // size (activation order): "actorder": "group" then carries it.
  StatusOr<bool> HasActOrder(const std::string& prefix, const GridShape& g) const {
    if (!source_.ckpt->Has(prefix + ".g_idx")) return false;
    QCAL_ASSIGN_OR_RETURN(std::vector<int64_t> g_idx,
                          model::ReadInts(*source_.ckpt, prefix + ".g_idx", {DType::kI32}, {g.in}));
    for (int64_t j = 0; j < g.in; ++j) {
      if (g_idx[j] != (g.group_size == -1 ? 0 : j / g.group_size)) return true;
    }
    return false;
  }

  // What input_activations (and the engines that load them) compute must be what qcal's
  // activation quantizer computes (engine/qsim/act_quant.h):
  //  * rule humming (dynamic per token, symmetric, unclipped int4 or int8): pack-quantized
  //    weights, which vLLM serves with its Humming kernels (CompressedTensorsWNA4Int / WNA8Int),
  //    whose input quantization the rule is (docs/formats.md, "4-bit activations");
  //  * rule qcal, dynamic per token, symmetric, clip 1, 8-bit weights: scale = max|x| / 127 per
  //    token, codes clamped to [-128, 127] (int-quantized: vLLM's int8 W8A8 kernels; strategy
  //    "token");
  //  * static per tensor: the calibrated scale (clip folded in) and, asymmetric, zero point,
  //    stored per linear as input_scale / input_zero_point (strategy "tensor").
  Status CheckInputActivations(const ActivationQuantSpec& a) const {
    auto refuse = [&](const std::string& why) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir,
          ": cannot export to compressed-tensors: the recipe's activation quantizer (", a.bits,
          "-bit, ", a.granularity, a.is_static ? ", static" : ", dynamic",
          a.symmetric ? ", symmetric" : ", asymmetric", ", clip ", a.clip, ", rule ", a.rule,
          ") ", why));
    };
    if (a.rule == "humming") return absl::OkStatus();  // the recipe checked the rest
    if (a.bits != 8) {
      return refuse("is not 8-bit, and vLLM serves inputs below 8 bits only with its Humming "
                    "kernels, whose scale and rounding differ from qcal's rule: quantize with "
                    "activations {bits: 4, clip: 1.0, granularity: per_token, rule: humming} "
                    "(docs/formats.md, \"4-bit activations\")");
    }
    if (a.is_static) {
      if (a.granularity != "per_tensor") return refuse("is static but not per tensor");
      return absl::OkStatus();
    }
    if (a.granularity != "per_token") {
      return refuse("takes one scale per sequence, which the format's dynamic per-tensor "
                    "strategy (one scale per forward call's tensor) computes only at batch 1");
    }
    if (!a.symmetric) {
      return refuse("is asymmetric and dynamic: the format's dynamic asymmetric range is the "
                    "token's [min, max], qcal's includes 0");
    }
    if (a.clip != 1.0) {
      return refuse("clips the dynamic range: the format's dynamic scale is max|x| / 127, with "
                    "no clipping ratio");
    }
    return absl::OkStatus();
  }

  // Dynamic inputs beside pack-quantized weights are served by vLLM's Humming kernels: the
  // recipe's input rule must then be Humming's (rule humming), and the weights symmetric (the
  // kernels load no weight zero points).
  Status CheckHummingWeights(const std::string& prefix, const GridShape& g) const {
    if (act_->rule != "humming" && !act_->is_static) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": cannot export to compressed-tensors: ", prefix, " has ", g.bits,
          "-bit weights, so the export is pack-quantized, and vLLM serves pack-quantized "
          "weights with dynamic int", act_->bits, " inputs through its Humming kernels, whose "
          "scale rule is not the recipe's: quantize with activations.rule: humming "
          "(docs/formats.md, \"4-bit activations\")"));
    }
    if (act_->rule == "humming" && !g.symmetric) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_.dir, ": cannot export to compressed-tensors with ", act_->bits, "-bit inputs: ",
          prefix, " has asymmetric weights (zero points), which vLLM's Humming kernels, the "
          "ones that serve quantized inputs with pack-quantized weights, do not load"));
    }
    return absl::OkStatus();
  }

  // W8A8 (8-bit weights, quantized inputs with qcal's rule): int-quantized, the layout vLLM's
  // int8 W8A8 kernels load; everything else (W4A4 and W4A8 with rule humming): pack-quantized.
  bool IntFormat(const GridShape& g) const {
    return act_.has_value() && act_->rule != "humming" && g.bits == 8;
  }

  // An FP8 KV cache's k_scale and v_scale (float32 [1], the dtype vLLM loads them in) of the
  // attention whose k_proj is `ref`: "<layer>.self_attn.k_scale", as llm-compressor names them.
  void PlanKvScales(const LinearRef& ref) {
    const std::string suffix = ".k_proj";
    const std::string attn = ref.prefix.substr(0, ref.prefix.size() - suffix.size());
    const methods::Inference* inference = &source_.method->inference();
    const int64_t layer = ref.layer;
    for (const bool key : {true, false}) {
      plan_->AddBlockTensor(attn + (key ? ".k_scale" : ".v_scale"), DType::kF32, {1}, layer,
                            [inference, layer, key](const LoadedBlock& b,
                                                    const Sink& sink) -> Status {
                              QCAL_ASSIGN_OR_RETURN(const methods::StaticKvScales s,
                                                    inference->KvCacheScales(b.weights, layer));
                              const float v = key ? s.k_scale : s.v_scale;
                              return sink(&v, sizeof(float));
                            });
    }
  }

  // A static recipe's input_scale (float32, the dtype vLLM loads it in: a calibrated scale is
  // not exact in 16 bits) and, asymmetric, input_zero_point (int8: zero - 128) of one linear.
  void PlanStaticInput(const std::string& prefix, int64_t layer, model::LinearKind k) {
    const methods::Inference* inference = &source_.method->inference();
    auto params = [inference, layer, k](const LoadedBlock& b) {
      return inference->StaticLinearInputParams(b.weights, layer, k);
    };
    plan_->AddBlockTensor(prefix + ".input_scale", DType::kF32, {1}, layer,
                          [params](const LoadedBlock& b, const Sink& sink) -> Status {
                            QCAL_ASSIGN_OR_RETURN(const methods::StaticInputParams p, params(b));
                            return sink(&p.scale, sizeof(float));
                          });
    if (!act_->symmetric) {
      plan_->AddBlockTensor(prefix + ".input_zero_point", DType::kI8, {1}, layer,
                            [params](const LoadedBlock& b, const Sink& sink) -> Status {
                              QCAL_ASSIGN_OR_RETURN(const methods::StaticInputParams p,
                                                    params(b));
                              const int8_t zp = static_cast<int8_t>(p.zero - 128);
                              return sink(&zp, 1);
                            });
    }
  }

  // The int-quantized layout (compressed-tensors' IntQuantizationCompressor), the weights of
  // W8A8: weight [out, in] int8 holds the signed codes q (asymmetric: q = c - 2^(b-1), zero
  // point zp = z - 2^(b-1) in weight_zero_point [out, groups] int8), weight_scale and
  // weight_g_idx as for pack-quantized.
  void PlanIntLinear(const LinearRef& ref, const GridShape& g) {
    const std::string& prefix = ref.prefix;
    const int64_t layer = ref.layer;
    const int32_t shift = g.symmetric ? 0 : -(1 << (g.bits - 1));
    plan_->AddBlockTensor(prefix + ".weight", DType::kI8, {g.out, g.in}, layer,
                          [=](const LoadedBlock& b, const Sink& sink) -> Status {
                            const quant::ScalarLinearData& d = b.grid(ref);
                            std::vector<int8_t> row(g.in);
                            for (int64_t r = 0; r < g.out; ++r) {
                              const int32_t* c = d.codes.data() + r * g.in;
                              for (int64_t j = 0; j < g.in; ++j) {
                                row[j] = static_cast<int8_t>(c[j] + shift);
                              }
                              QCAL_RETURN_IF_ERROR(sink(row.data(), row.size()));
                            }
                            return absl::OkStatus();
                          });
    if (!g.symmetric) {
      plan_->AddBlockTensor(prefix + ".weight_zero_point", DType::kI8, {g.out, g.groups}, layer,
                            [=](const LoadedBlock& b, const Sink& sink) -> Status {
                              const quant::ScalarLinearData& d = b.grid(ref);
                              std::vector<int8_t> zp(d.zeros.size());
                              for (size_t i = 0; i < zp.size(); ++i) {
                                zp[i] = static_cast<int8_t>(d.zeros[i] + shift);
                              }
                              return sink(zp.data(), zp.size());
                            });
    }
    PlanScaleAndGroups(ref, g);
  }

  // The pack-quantized layout (compressed-tensors' PackedQuantizationCompressor): signed codes q
  // in [-2^(b-1), 2^(b-1)) (qcal's asymmetric code c and zero z become q = c - 2^(b-1) and
  // zp = z - 2^(b-1), so q - zp = c - z), shifted to unsigned and packed 32/b to an int32 from
  // the low bits, along the input dimension (weight_packed) or, for zero points, the output one.
  void PlanPackedLinear(const LinearRef& ref, const GridShape& g) {
    const std::string& prefix = ref.prefix;
    const int64_t layer = ref.layer;
    const int bits = g.bits, per_word = 32 / bits;
    const int64_t words = (g.in + per_word - 1) / per_word;
    plan_->AddBlockTensor(prefix + ".weight_packed", DType::kI32, {g.out, words}, layer,
                          [=](const LoadedBlock& b, const Sink& sink) -> Status {
                            const quant::ScalarLinearData& d = b.grid(ref);
                            const int32_t shift = g.symmetric ? 1 << (bits - 1) : 0;
                            std::vector<uint32_t> row(words);
                            for (int64_t r = 0; r < g.out; ++r) {
                              std::fill(row.begin(), row.end(), 0u);
                              const int32_t* c = d.codes.data() + r * g.in;
                              for (int64_t j = 0; j < g.in; ++j) {
                                const uint32_t u = static_cast<uint32_t>(c[j] + shift);
                                row[j / per_word] |= u << ((j % per_word) * bits);
                              }
                              QCAL_RETURN_IF_ERROR(
                                  sink(row.data(), row.size() * sizeof(uint32_t)));
                            }
                            return absl::OkStatus();
                          });
    if (!g.symmetric) {
      const int64_t zrows = (g.out + per_word - 1) / per_word;
      plan_->AddBlockTensor(
          prefix + ".weight_zero_point", DType::kI32, {zrows, g.groups}, layer,
          [=](const LoadedBlock& b, const Sink& sink) -> Status {
            const quant::ScalarLinearData& d = b.grid(ref);
            std::vector<uint32_t> packed(zrows * g.groups, 0u);
            for (int64_t r = 0; r < g.out; ++r) {
              for (int64_t c = 0; c < g.groups; ++c) {
                const uint32_t u = static_cast<uint32_t>(d.zeros[r * g.groups + c]);
                packed[(r / per_word) * g.groups + c] |= u << ((r % per_word) * bits);
              }
            }
            return sink(packed.data(), packed.size() * sizeof(uint32_t));
          });
    }
    PlanScaleAndGroups(ref, g);
    plan_->AddBlockTensor(prefix + ".weight_shape", DType::kI64, {2}, layer,
                          [=](const LoadedBlock&, const Sink& sink) -> Status {
                            const int64_t shape[2] = {g.out, g.in};
                            return sink(shape, sizeof(shape));
                          });
  }

  // weight_scale [out, groups] in the model's dtype and weight_g_idx [in] int32 (actorder
  // "group"): the same in both layouts.
  void PlanScaleAndGroups(const LinearRef& ref, const GridShape& g) {
    const std::string& prefix = ref.prefix;
    const int64_t layer = ref.layer;
    const DType scale_dtype = source_.model_dtype;
    plan_->AddBlockTensor(prefix + ".weight_scale", scale_dtype, {g.out, g.groups}, layer,
                          [=](const LoadedBlock& b, const Sink& sink) -> Status {
                            const quant::ScalarLinearData& d = b.grid(ref);
                            return SinkAs(scale_dtype, d.scales.data(), d.scales.size(), sink);
                          });
    if (!actorder_) return;
    plan_->AddBlockTensor(prefix + ".weight_g_idx", DType::kI32, {g.in}, layer,
                          [=](const LoadedBlock& b, const Sink& sink) -> Status {
                            const quant::ScalarLinearData& d = b.grid(ref);
                            std::vector<int32_t> g_idx(g.in);
                            for (int64_t j = 0; j < g.in; ++j) {
                              g_idx[j] = d.g_idx.empty()
                                             ? static_cast<int32_t>(j / g.group_size)
                                             : d.g_idx[j];
                            }
                            return sink(g_idx.data(), g_idx.size() * sizeof(int32_t));
                          });
  }

  const Source& source_;
  TensorPlan* plan_;
  const std::optional<ActivationQuantSpec> act_;  // the linears' input quantizer
  UniformGrid grid_;
  bool actorder_ = false;  // weights carry weight_g_idx ("actorder": "group")
  bool float_attention_ = false;  // Llama 4's q/k/v_proj written as float weights
};

}  // namespace

std::unique_ptr<Format> MakeCompressedTensorsFormat(const Source& source, TensorPlan* plan) {
  return std::make_unique<CompressedTensorsFormat>(source, plan);
}

}  // namespace qcal::exporter
