#include "worker/quarot/quarot_model.h"

#include <chrono>
#include <optional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/calib/hessian.h"
#include "worker/quarot/act_quant.h"
#include "worker/quarot/bfp_kv.h"
#include "worker/quarot/ksort.h"
#include "worker/quarot/kv_quantizer.h"

namespace qcal::quarot {
namespace {

using Clock = std::chrono::steady_clock;
using model::LinearKind;

bool StaticActivations(const Recipe& r) {
  return r.activations.enabled() && r.activations.is_static;
}
bool StaticKv(const Recipe& r) { return r.kv_cache.enabled() && r.kv_cache.is_static; }

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
  hooks.kv_quantizer = std::move(kv);
  block.set_hooks(std::move(hooks));
  std::shared_ptr<const OnlineHadamard> t4;
  if (plan.r4) {
    QCAL_ASSIGN_OR_RETURN(t4, OnlineHadamard::Create(plan.intermediate));
  }
  for (LinearKind k : model::kAllLinears) {
    auto& slot = block.mutable_weights().linears[static_cast<int>(k)];
    slot = Unwrap(std::move(slot));
    auto rotation = k == LinearKind::kDown ? t4 : nullptr;
    std::shared_ptr<RangeObserver> observer;
    if (observers != nullptr) observer = observers[static_cast<int>(calib::HessianKindOf(k))];
    if (rotation || observer) {
      slot = std::make_unique<ActQuantLinear>(std::move(slot), rotation, nullptr, observer);
    }
  }
  return Status();
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

}  // namespace

Status PrepareModel(model::LlamaModel& model, const Recipe& recipe, const RotationPlan& plan) {
  QCAL_RETURN_IF_ERROR(RotateModel(model, plan));
  if (recipe.kv_cache.k_sort) {
    QCAL_RETURN_IF_ERROR(ApplyKSort(model, KSortOptions{}).status());
  }
  return Status();
}

bool NeedsCalibration(const Recipe& recipe) {
  return recipe.sequential_calibration();
}

Status InstallQuantizedInference(model::DecoderBlock& block, const LlamaConfig& config,
                                 int64_t layer, const Recipe& recipe, const RotationPlan& plan) {
  const model::BlockWeights& w = block.weights();
  model::BlockHooks hooks;
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto t3, OnlineHadamard::Create(plan.head_dim));
    hooks.qk_rotation = t3->transposed_matrix();
  }
  if (recipe.kv_cache.enabled()) {
    KvStaticRanges ranges;
    const KvStaticRanges* rp = nullptr;
    if (StaticKv(recipe)) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor t, RangeTable(w, kKvRangesKey, 2, layer));
      for (int r = 0; r < 2; ++r) {
        ranges.lo[r] = t[r][0].item<double>();
        ranges.hi[r] = t[r][1].item<double>();
      }
      rp = &ranges;
    }
    QCAL_ASSIGN_OR_RETURN(hooks.kv_quantizer, MakeKvQuantizer(recipe.kv_cache, config, layer, rp));
  }
  std::shared_ptr<const ActivationQuantizer> act[4];
  if (recipe.activations.enabled()) {
    if (StaticActivations(recipe)) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor t, RangeTable(w, kActRangesKey, 4, layer));
      for (int i = 0; i < 4; ++i) {
        QCAL_ASSIGN_OR_RETURN(act[i], ActivationQuantizer::CreateStatic(
                                          recipe.activations, t[i][0].item<double>(),
                                          t[i][1].item<double>()));
      }
    } else {
      QCAL_ASSIGN_OR_RETURN(act[0], ActivationQuantizer::Create(recipe.activations));
      for (int i = 1; i < 4; ++i) act[i] = act[0];
    }
  }
  std::shared_ptr<const OnlineHadamard> t4;
  if (plan.r4) {
    QCAL_ASSIGN_OR_RETURN(t4, OnlineHadamard::Create(plan.intermediate));
  }
  // A BFP cache of pre-RoPE keys (the K-sort paper's) quantizes k_proj's output.
  std::optional<kernels::BfpFormat> pre_rope_keys;
  if (recipe.kv_cache.enabled() && recipe.kv_cache.format == "bfp" &&
      recipe.kv_cache.key_point == "pre_rope") {
    QCAL_ASSIGN_OR_RETURN(pre_rope_keys, BfpKeyFormat(recipe.kv_cache, config, layer));
  }
  block.set_hooks(std::move(hooks));
  for (LinearKind k : model::kAllLinears) {
    auto& slot = block.mutable_weights().linears[static_cast<int>(k)];
    slot = Unwrap(std::move(slot));
    if (k == LinearKind::kK && pre_rope_keys) {
      slot = std::make_unique<BfpKeyProjection>(std::move(slot), config.head_dim, *pre_rope_keys);
    }
    auto rotation = k == LinearKind::kDown ? t4 : nullptr;
    auto quantizer = act[static_cast<int>(calib::HessianKindOf(k))];
    if (rotation || quantizer) {
      slot = std::make_unique<ActQuantLinear>(std::move(slot), rotation, quantizer);
    }
  }
  return Status();
}

StatusOr<quant::BlockTaskResult> QuantizeRotatedBlock(model::LlamaModel& model,
                                                      const Recipe& recipe,
                                                      const RotationPlan& plan, int64_t layer,
                                                      at::Tensor* x, int64_t batch,
                                                      bool propagate) {
  const LlamaConfig& config = model.config();
  if (layer < 0 || layer >= model.num_blocks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, " does not exist (the model has ", model.num_blocks(), ")"));
  }
  const bool calibrate = NeedsCalibration(recipe);
  if (calibrate && (x == nullptr || !x->defined())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, ": recipe '", recipe.name, "' needs the block's calibration inputs"));
  }
  model::DecoderBlock& block = model.mutable_block(layer);
  calib::BlockHessians hessians;
  if (recipe.needs_hessians()) {
    QCAL_RETURN_IF_ERROR(
        calib::ForwardCollectingHessians(block, *x, model.rope(), batch, &hessians).status());
  }
  QCAL_ASSIGN_OR_RETURN(quant::BlockTaskResult result,
                        quant::QuantizeBlock(recipe, config, layer, block.weights(),
                                             recipe.needs_hessians() ? &hessians : nullptr));
  block.mutable_weights() = std::move(result.weights);
  // Propagate the calibration activations through the quantized block (recording static ranges
  // on the way), unless nothing needs them any more.
  const bool record = StaticActivations(recipe) || StaticKv(recipe);
  if (calibrate && (propagate || record)) {
    std::shared_ptr<RangeObserver> observers[4];
    std::shared_ptr<RecordingKvQuantizer> kv_recorder;
    if (record) {
      for (auto& o : observers) o = std::make_shared<RangeObserver>();
      kv_recorder = std::make_shared<RecordingKvQuantizer>();
    }
    QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, record ? observers : nullptr, kv_recorder));
    try {
      at::Tensor y = Forward(block, *x, model.rope(), batch);
      if (propagate) *x = std::move(y);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("block ", layer, " forward: ", e.what()));
    }
    if (record) {
      model::BlockWeights& w = block.mutable_weights();
      if (StaticActivations(recipe)) {
        at::Tensor t = at::empty({4, 2}, at::kDouble);
        for (int i = 0; i < 4; ++i) {
          t[i][0] = observers[i]->lo();
          t[i][1] = observers[i]->hi();
        }
        w.extra[kActRangesKey] = t;
      }
      if (StaticKv(recipe)) {
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
  }
  return result;
}

StatusOr<QuarotReport> QuantizeModel(model::LlamaModel& model, const Recipe& recipe,
                                     const at::Tensor& calib_tokens, int64_t batch,
                                     const SequentialCallbacks& callbacks) {
  const auto t0 = Clock::now();
  if (recipe.method != QuantMethod::kQuarot) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe.name, "' has method ",
                                                   QuantMethodName(recipe.method),
                                                   ", not quarot"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  const LlamaConfig& config = model.config();
  QuarotReport report;
  QCAL_ASSIGN_OR_RETURN(report.plan, PlanRotations(recipe.rotation, config));
  const RotationPlan& plan = report.plan;
  QCAL_LOG_INFO("QuaRot '{}': rotations {}{}", recipe.name, plan.Describe(),
                recipe.kv_cache.k_sort ? ", K-sort" : "");
  QCAL_RETURN_IF_ERROR(PrepareModel(model, recipe, plan));

  const bool calibrate = NeedsCalibration(recipe);
  at::Tensor x;
  if (calibrate) {
    QCAL_ASSIGN_OR_RETURN(x, EmbedCalibrationTokens(model, recipe, calib_tokens));
    report.calib_tokens = calib_tokens.numel();
  }
  const int64_t n = model.num_blocks();
  for (int64_t l = 0; l < n; ++l) {
    model::DecoderBlock& block = model.mutable_block(l);
    std::optional<model::BlockWeights> finished;
    if (callbacks.load_finished) {
      QCAL_ASSIGN_OR_RETURN(finished, callbacks.load_finished(l));
    }
    quant::BlockTaskResult result;
    result.layer = l;
    const bool resumed = finished.has_value();
    if (resumed) {
      block.mutable_weights() = std::move(*finished);
      if (calibrate && l + 1 < n) {
        QCAL_ASSIGN_OR_RETURN(x, PropagateFinishedBlock(model, plan, l, x, batch));
      } else {
        QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, nullptr, nullptr));
      }
    } else {
      QCAL_ASSIGN_OR_RETURN(result, QuantizeRotatedBlock(model, recipe, plan, l,
                                                         calibrate ? &x : nullptr, batch,
                                                         l + 1 < n));
    }
    if (!resumed && callbacks.on_block_done) {
      result.weights = std::move(block.mutable_weights());
      const Status s = callbacks.on_block_done(result);
      block.mutable_weights() = std::move(result.weights);
      QCAL_RETURN_IF_ERROR(s);
    }
    report.blocks.push_back(std::move(result));
    report.resumed.push_back(resumed);
    if (callbacks.progress) callbacks.progress(l + 1, n);
  }
  for (int64_t l = 0; l < n; ++l) {
    QCAL_RETURN_IF_ERROR(
        InstallQuantizedInference(model.mutable_block(l), config, l, recipe, plan));
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

StatusOr<at::Tensor> PropagateFinishedBlock(model::LlamaModel& model, const RotationPlan& plan,
                                            int64_t layer, const at::Tensor& x, int64_t batch) {
  model::DecoderBlock& block = model.mutable_block(layer);
  QCAL_RETURN_IF_ERROR(InstallFloatOnline(block, plan, nullptr, nullptr));
  try {
    return Forward(block, x, model.rope(), batch);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block ", layer, " forward: ", e.what()));
  }
}

StatusOr<at::Tensor> EmbedCalibrationTokens(const model::LlamaModel& model, const Recipe& recipe,
                                            const at::Tensor& calib_tokens) {
  if (!calib_tokens.defined() || calib_tokens.dim() != 2 || calib_tokens.size(0) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe '", recipe.name, "' needs calibration tokens [N, S]"));
  }
  at::NoGradGuard no_grad;
  return model.Embed(calib_tokens);
}

}  // namespace qcal::quarot
