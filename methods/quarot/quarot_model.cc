#include "methods/quarot/quarot_model.h"

#include <cmath>
#include <chrono>
#include <optional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "engine/calib/calibration.h"
#include "engine/calib/hessian.h"
#include "engine/model/linear_slots.h"
#include "methods/rotated_block.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/bfp_kv.h"
#include "engine/qsim/ksort.h"
#include "engine/qsim/kv_quantizer.h"
#include "engine/quant/scalar_quantize.h"
#include "methods/per_linear.h"

namespace qcal::methods::quarot {
namespace {

using Clock = std::chrono::steady_clock;
using model::LinearKind;
using namespace qcal::qsim;  // NOLINT: the simulated-quantization pieces QuaRot is made of

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Strips every ActQuantLinear and BfpKeyProjection around a block linear, returning the
// innermost layer.
std::unique_ptr<model::Linear> Unwrap(std::unique_ptr<model::Linear> linear) {
  for (;;) {
    if (auto* a = dynamic_cast<ActQuantLinear*>(linear.get())) {
      linear = a->release_inner();
    } else if (auto* b = dynamic_cast<BfpKeyProjection*>(linear.get())) {
      linear = b->release_inner();
    } else {
      return linear;
    }
  }
}

// Reads a [rows, 2] F64 range table from the block's extras.
StatusOr<at::Tensor> RangeTable(const model::BlockWeights& w, const char* key, int64_t rows,
                                int64_t layer) {
  auto it = w.extra.find(key);
  if (it == w.extra.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, ": the recipe quantizes statically but the block has no calibrated '",
        key, "'"));
  }
  const at::Tensor& t = it->second;
  if (t.dim() != 2 || t.size(0) != rows || t.size(1) != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": '", key, "' must be [", rows, ", 2]"));
  }
  return t.to(at::kDouble).contiguous();
}

// R4's online transform on the input of a linear of role k (every down_proj of the block, a MoE
// block's experts' too, each of its own input size), or null.
StatusOr<std::shared_ptr<const OnlineHadamard>> DownProjRotation(const RotationPlan& plan,
                                                                 R4Transforms& t4, LinearKind k,
                                                                 int64_t in) {
  if (k != LinearKind::kDown || !plan.r4) return std::shared_ptr<const OnlineHadamard>();
  return t4.For(in);
}

// Installs the R3 hook and R4 wrapper only (float activations, float cache): the state in which
// blocks are calibrated and their outputs propagated.
Status InstallFloatOnline(model::DecoderBlock& block, const RotationPlan& plan,
                          std::shared_ptr<RangeObserver> observers[4],
                          std::shared_ptr<const KvQuantizer> kv) {
  model::BlockHooks hooks;
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto t3, OnlineHadamard::Create(plan.head_dim));
    hooks.qk_rotation = t3->transposed_matrix();
  }
  hooks.kv_cache = std::move(kv);
  block.set_hooks(std::move(hooks));
  QCAL_ASSIGN_OR_RETURN(R4Transforms t4, R4Transforms::Create(plan));
  Status status;
  model::ForEachLinearSlot(block.mutable_weights(), [&](LinearKind k, int64_t,
                                                        std::unique_ptr<model::Linear>& slot) {
    slot = Unwrap(std::move(slot));
    auto rotation = DownProjRotation(plan, t4, k, slot->in_features());
    if (!rotation.ok()) {
      status.Update(rotation.status());
      return;
    }
    // A MoE block's experts share the dense linears' observers: one static range per input
    // kind and block, as vLLM's fused-MoE kernels take one input scale for all experts.
    std::shared_ptr<RangeObserver> observer;
    if (observers != nullptr) observer = observers[static_cast<int>(calib::HessianKindOf(k))];
    if (*rotation || observer) {
      slot = std::make_unique<ActQuantLinear>(std::move(slot), *rotation, nullptr, observer);
    }
  });
  return status;
}

at::Tensor Forward(model::DecoderBlock& block, const at::Tensor& x, const model::Rope& rope,
                   int64_t batch) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < x.size(0); s += batch) {
    outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
  }
  return at::cat(outs, 0);
}

// QuaRot's rounding of a rotated block: a linear may be an ActQuantLinear carrying an online
// transform T (R4 on down_proj) around its dense weight. The dense weight is rounded per the
// recipe (rtn / gptq / none) with the Hessian of what it really multiplies, T·H·Tᵀ, and the
// result is wrapped again with the same transform.
StatusOr<quant::BlockTaskResult> RoundRotatedBlock(const QuarotConfig& q, int64_t layer,
                                                   const model::BlockWeights& rotated,
                                                   calib::BlockHessians* hessians,
                                                   kernels::GpuBackend* gpu) {
  const auto t0 = Clock::now();
  if (rotated.extra.count(kRotationsKey) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, ": method quarot needs the block rotated by RotateAndMarkBlock "
        "first (methods/quarot/quarot_model.h PrepareBlockWeights)"));
  }
  if (q.gptq() && hessians == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": quarot with gptq weights needs Hessians"));
  }
  quant::ScalarQuantizeOptions options;
  options.bits = q.bits;
  options.grid = q.scalar;
  options.gptq = q.gptq();
  options.damp = q.damp;
  options.refine_sweeps = q.refine_sweeps;
  options.pack_int4 = true;  // QuaRot checkpoints store <= 4-bit codes two per byte
  options.gpu = gpu;
  quant::BlockTaskResult result;
  result.layer = layer;
  result.weights.layer = rotated.layer;
  result.weights.input_norm = rotated.input_norm.clone();
  result.weights.post_norm = rotated.post_norm.clone();
  result.weights.rope_perm = rotated.rope_perm;
  result.weights.extra = rotated.extra;
  // One linear of role `kind` (expert >= 0: a routed expert's) with the Hessian h of its input.
  auto round = [&](const model::Linear& linear, LinearKind kind, int64_t expert,
                   at::Tensor h) -> StatusOr<std::unique_ptr<model::Linear>> {
    const auto* wrapped = dynamic_cast<const ActQuantLinear*>(&linear);
    std::shared_ptr<const OnlineHadamard> transform = wrapped ? wrapped->rotation() : nullptr;
    const at::Tensor weight = linear.stored().DenseWeight();
    std::unique_ptr<model::Linear> layer_out;
    quant::LinearMetrics metrics;
    if (!q.quantizes_weights()) {
      const auto t1 = Clock::now();
      layer_out = std::make_unique<model::DenseLinear>(weight.to(at::kFloat).contiguous().clone());
      metrics.name = quant::LinearProblemName(kind, expert);
      metrics.proxy_loss = metrics.relative = std::nan("");
      metrics.code_bits = metrics.stored_bits = 32;
      metrics.seconds = Seconds(t1);
    } else {
      if (h.defined() && transform) {
        QCAL_ASSIGN_OR_RETURN(h, RotateHessian(h, *transform));
      }
      QCAL_ASSIGN_OR_RETURN(quant::LinearProblem p,
                            quant::PrepareLinear(layer, kind, weight, h, "quarot", q.gptq(),
                                                 expert));
      QCAL_ASSIGN_OR_RETURN(
          quant::QuantizedLinear ql,
          quant::FinishLinear(p, quant::QuantizeScalarLinear(options, p.weight(), p.out, p.in,
                                                             p.hessian())));
      layer_out = std::move(ql.layer);
      metrics = ql.metrics;
    }
    if (transform) {
      layer_out = std::make_unique<ActQuantLinear>(std::move(layer_out), transform, nullptr);
    }
    result.linears.push_back(metrics);
    return layer_out;
  };
  calib::HessianMeans means(hessians);  // consumes the accumulators kind by kind
  for (LinearKind kind : model::kAllLinears) {
    if (!rotated.has(kind)) continue;  // a Mixtral MoE block's (absent) dense MLP
    at::Tensor h;
    if (hessians && q.quantizes_weights()) h = means.For(kind);
    QCAL_ASSIGN_OR_RETURN(result.weights.linears[static_cast<int>(kind)],
                          round(rotated.linear(kind), kind, -1, h));
  }
  if (rotated.moe != nullptr) {
    const model::MoeWeights& moe = *rotated.moe;
    result.weights.moe = std::make_unique<model::MoeWeights>();
    result.weights.moe->router = moe.router.clone();  // kept in float (rotated by R1)
    result.weights.moe->experts.resize(moe.experts.size());
    for (size_t e = 0; e < moe.experts.size(); ++e) {
      const int64_t expert = static_cast<int64_t>(e);
      for (calib::ExpertInput input : calib::kExpertInputs) {
        at::Tensor h;
        if (hessians && q.quantizes_weights()) {
          QCAL_ASSIGN_OR_RETURN(h, ExpertHessian(hessians, layer, expert, input));
        }
        const bool gate_up = input == calib::ExpertInput::kGateUp;
        for (model::ExpertLinear k : model::kExpertLinears) {
          if ((k != model::ExpertLinear::kDown) != gate_up) continue;
          QCAL_ASSIGN_OR_RETURN(
              result.weights.moe->experts[e].linears[static_cast<int>(k)],
              round(moe.experts[e].linear(k), model::ExpertLinearKind(k), expert, h));
        }
      }
    }
  }
  result.seconds = Seconds(t0);
  return result;
}

}  // namespace

StatusOr<const QuarotConfig*> QuarotSettings(const Recipe& recipe) {
  const auto* q = dynamic_cast<const QuarotConfig*>(recipe.config.get());
  if (q == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' has method ",
                                                   recipe.method, ", not quarot"));
  }
  return q;
}

Status PrepareBlockWeights(model::BlockWeights& weights, const LlamaConfig& config,
                           const Recipe& recipe, const RotationPlan& plan, int64_t layer) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  QCAL_RETURN_IF_ERROR(RotateAndMarkBlock(weights, config, plan, layer));
  if (q->kv_cache.k_sort) {
    QCAL_RETURN_IF_ERROR(KSortBlock(config, weights, KSortOptions{}).status());
  }
  return Status();
}

Status PrepareModel(model::LlamaModel& model, const Recipe& recipe, const RotationPlan& plan) {
  for (int64_t l = 0; l < model.num_blocks(); ++l) {
    model::DecoderBlock& block = model.mutable_block(l);
    const Status s = PrepareBlockWeights(block.mutable_weights(), model.config(), recipe, plan, l);
    if (!s.ok()) return Annotate(s, absl::StrCat("block ", l));
    QCAL_RETURN_IF_ERROR(InstallOnlineRotations(block, plan));
  }
  return RotateNonBlockWeights(model, plan);
}

StatusOr<KvStaticRanges> StaticKvRanges(const model::BlockWeights& weights, const QuarotConfig& q,
                                        int64_t layer) {
  if (!q.static_kv()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": the recipe's KV cache is not static"));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor t, RangeTable(weights, kKvRangesKey, 2, layer));
  KvStaticRanges ranges;
  for (int r = 0; r < 2; ++r) {
    ranges.lo[r] = t[r][0].item<double>();
    ranges.hi[r] = t[r][1].item<double>();
  }
  return ranges;
}

StatusOr<qsim::FixedQuantParams> StaticInputQuantParams(const model::BlockWeights& weights,
                                                        const QuarotConfig& q, int64_t layer,
                                                        model::LinearKind kind) {
  if (!q.static_activations()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": the recipe's activation quantizers are not static"));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor t, RangeTable(weights, kActRangesKey, 4, layer));
  const int i = static_cast<int>(calib::HessianKindOf(kind));
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const ActivationQuantizer> a,
                        ActivationQuantizer::CreateStatic(q.activations, t[i][0].item<double>(),
                                                          t[i][1].item<double>()));
  return a->static_params();
}

Status InstallQuantizedInference(model::DecoderBlock& block, const LlamaConfig& config,
                                 int64_t layer, const Recipe& recipe, const RotationPlan& plan) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  const model::BlockWeights& w = block.weights();
  model::BlockHooks hooks;
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto t3, OnlineHadamard::Create(plan.head_dim));
    hooks.qk_rotation = t3->transposed_matrix();
  }
  if (q->kv_cache.enabled()) {
    KvStaticRanges ranges;
    const KvStaticRanges* rp = nullptr;
    if (q->static_kv()) {
      QCAL_ASSIGN_OR_RETURN(ranges, StaticKvRanges(w, *q, layer));
      rp = &ranges;
    }
    QCAL_ASSIGN_OR_RETURN(hooks.kv_cache, MakeKvQuantizer(q->kv_cache, config, layer, rp));
  }
  std::shared_ptr<const ActivationQuantizer> act[4];
  if (q->activations.enabled()) {
    if (q->static_activations()) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor t, RangeTable(w, kActRangesKey, 4, layer));
      for (int i = 0; i < 4; ++i) {
        QCAL_ASSIGN_OR_RETURN(act[i], ActivationQuantizer::CreateStatic(
                                          q->activations, t[i][0].item<double>(),
                                          t[i][1].item<double>()));
      }
    } else {
      QCAL_ASSIGN_OR_RETURN(act[0], ActivationQuantizer::Create(q->activations));
      for (int i = 1; i < 4; ++i) act[i] = act[0];
    }
  }
  QCAL_ASSIGN_OR_RETURN(R4Transforms t4, R4Transforms::Create(plan));
  // A BFP cache of pre-RoPE keys (the K-sort paper's) quantizes k_proj's output.
  std::optional<kernels::BfpFormat> pre_rope_keys;
  if (q->kv_cache.enabled() && q->kv_cache.format == "bfp" &&
      q->kv_cache.key_point == "pre_rope") {
    QCAL_ASSIGN_OR_RETURN(pre_rope_keys, BfpKeyFormat(q->kv_cache, config, layer));
  }
  block.set_hooks(std::move(hooks));
  Status status;
  // Every linear, a MoE block's routed experts included: an expert's input is quantized as the
  // dense linear of its role (one quantizer, one static range per input kind and block).
  model::ForEachLinearSlot(block.mutable_weights(), [&](LinearKind k, int64_t expert,
                                                        std::unique_ptr<model::Linear>& slot) {
    slot = Unwrap(std::move(slot));
    if (k == LinearKind::kK && expert < 0 && pre_rope_keys) {
      slot = std::make_unique<BfpKeyProjection>(std::move(slot), config.head_dim, *pre_rope_keys);
    }
    auto rotation = DownProjRotation(plan, t4, k, slot->in_features());
    if (!rotation.ok()) {
      status.Update(rotation.status());
      return;
    }
    auto quantizer = act[static_cast<int>(calib::HessianKindOf(k))];
    if (*rotation || quantizer) {
      slot = std::make_unique<ActQuantLinear>(std::move(slot), *rotation, quantizer);
    }
  });
  return status;
}

StatusOr<quant::BlockTaskResult> QuantizeRotatedBlock(
    model::DecoderBlock& block, const model::Rope& rope, const Recipe& recipe,
    const RotationPlan& plan, int64_t layer, at::Tensor* x, int64_t batch, bool propagate,
    kernels::GpuBackend* gpu,
    const std::function<void(int64_t, int64_t, const std::string&)>& progress) {
  QCAL_ASSIGN_OR_RETURN(const QuarotConfig* q, QuarotSettings(recipe));
  const bool calibrate = q->sequential();
  const bool record = q->static_activations() || q->static_kv();
  const bool forward_after = calibrate && (propagate || record);
  const int64_t steps = (q->gptq() ? 1 : 0) + 1 + (forward_after ? 1 : 0);
  int64_t done = 0;
  auto report = [&](const std::string& step) {
    if (progress) progress(++done, steps, step);
  };
  if (calibrate && (x == nullptr || !x->defined())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, ": recipe '", recipe.name, "' needs the block's calibration inputs"));
  }
  calib::BlockHessians hessians;
  hessians.backend = gpu;
  hessians.forward_precision = calib::ForwardPrecision(recipe.calibration);
  if (q->gptq()) {
    // A MoE block's experts: route-all or the starved-expert rule (calibration.h), on the
    // block's own inputs.
    QCAL_ASSIGN_OR_RETURN(hessians.route_all,
                          calib::ExpertsOnEveryToken(block, *x, rope, batch, recipe.calibration,
                                                     layer));
    QCAL_RETURN_IF_ERROR(
        calib::ForwardCollectingHessians(block, *x, rope, batch, &hessians).status());
    report("Hessians of the rotated block");
  }
  QCAL_ASSIGN_OR_RETURN(quant::BlockTaskResult result,
                        RoundRotatedBlock(*q, layer, block.weights(),
                                          q->gptq() ? &hessians : nullptr, gpu));
  block.mutable_weights() = std::move(result.weights);
  report(q->gptq() ? "GPTQ rounding" : "rounding");
  // Propagate the calibration activations through the quantized block (recording static ranges
  // on the way), unless nothing needs them any more.
  if (forward_after) {
    std::shared_ptr<RangeObserver> observers[4];
    std::shared_ptr<RecordingKvQuantizer> kv_recorder;
    if (record) {
      for (auto& o : observers) o = std::make_shared<RangeObserver>();
      kv_recorder = std::make_shared<RecordingKvQuantizer>();
    }
    QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, record ? observers : nullptr, kv_recorder));
    try {
      at::Tensor y = Forward(block, *x, rope, batch);
      if (propagate) *x = std::move(y);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("block ", layer, " forward: ", e.what()));
    }
    if (record) {
      model::BlockWeights& w = block.mutable_weights();
      if (q->static_activations()) {
        at::Tensor t = at::empty({4, 2}, at::kDouble);
        for (int i = 0; i < 4; ++i) {
          t[i][0] = observers[i]->lo();
          t[i][1] = observers[i]->hi();
        }
        w.extra[kActRangesKey] = t;
      }
      if (q->static_kv()) {
        const KvStaticRanges r = kv_recorder->ranges();
        at::Tensor t = at::empty({2, 2}, at::kDouble);
        for (int i = 0; i < 2; ++i) {
          t[i][0] = r.lo[i];
          t[i][1] = r.hi[i];
        }
        w.extra[kKvRangesKey] = t;
      }
    }
    QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, nullptr, nullptr));
    report(record ? "propagation and static ranges" : "propagation");
  }
  return result;
}

StatusOr<at::Tensor> PropagateFinishedBlock(model::DecoderBlock& block, const model::Rope& rope,
                                            const RotationPlan& plan, int64_t layer,
                                            const at::Tensor& x, int64_t batch) {
  QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, nullptr, nullptr));
  try {
    return Forward(block, x, rope, batch);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block ", layer, " forward: ", e.what()));
  }
}

}  // namespace qcal::methods::quarot
