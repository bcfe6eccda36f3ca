#include "methods/prefixquant/prefixquant_block.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "methods/prefixquant/block_ft.h"
#include "methods/prefixquant/static_quant.h"
#include "methods/rotated_block.h"
#include "engine/calib/hessian.h"
#include "engine/model/tensor_io.h"

namespace qcal::methods::prefixquant {
namespace {

using Clock = std::chrono::steady_clock;
using model::LinearKind;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string BlockPrefix(int64_t layer) { return absl::StrCat("model.layers.", layer, "."); }

int KindIndex(LinearKind k) { return static_cast<int>(calib::HessianKindOf(k)); }

// The reference's grids: weights, K and V c in {1.00, 0.95, ..., 0.55}; activations coarse.
std::vector<double> ShrinkGrid() {
  std::vector<double> g;
  for (int i = 0; i < 10; ++i) g.push_back(1.0 - 0.05 * i);
  return g;
}
std::vector<double> CoarseGrid() {
  std::vector<double> g;
  for (int i = 0; i < 8; ++i) g.push_back(0.25 + 0.1 * i);  // linspace(0.25, 0.95, 8)
  g.push_back(1.0);
  return g;
}

at::Tensor ChunkedForward(const model::DecoderBlock& block, const at::Tensor& x,
                          const model::Rope& rope, int64_t batch) {
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < x.size(0); s += batch) {
    outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
  }
  return at::cat(outs, 0);
}

double Mse(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).pow(2).mean().item<double>();
}

// The base hooks of a block: R3 and the prefix.
model::BlockHooks BaseHooks(const qsim::RotationPlan& plan,
                            std::shared_ptr<const model::PrefixKv> prefix,
                            const at::Tensor& r3) {
  model::BlockHooks hooks;
  if (plan.r3) hooks.qk_rotation = r3;
  hooks.prefix = std::move(prefix);
  return hooks;
}

// Attention probabilities [b, KV, rep, s, o + s] of queries q [b, H, s, d] (scaled) against the
// prefix keys and k [b, KV, s, d].
at::Tensor AttentionProbs(const at::Tensor& q, const at::Tensor& k, const model::PrefixKv* prefix) {
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), d = q.size(3);
  const int64_t kv = k.size(1), rep = heads / kv;
  const int64_t o = prefix ? prefix->length() : 0;
  at::Tensor keys = k;
  if (o > 0) keys = at::cat({prefix->k.unsqueeze(0).expand({b, kv, o, d}), k}, 2);
  at::Tensor scores = at::matmul(q.reshape({b, kv, rep * s, d}), keys.transpose(-2, -1))
                          .view({b, kv, rep, s, o + s});
  const at::Tensor mask = at::ones({s, o + s}, at::kBool).triu(o + 1);
  scores.masked_fill_(mask, -std::numeric_limits<float>::infinity());
  return at::softmax(scores, -1);
}

// Reads an F64 extra of `shape` into `out` (float32), or InvalidArgument.
StatusOr<at::Tensor> Extra(const model::BlockWeights& w, const char* key,
                           const std::vector<int64_t>& shape, int64_t layer) {
  auto it = w.extra.find(key);
  if (it == w.extra.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": the recipe needs '", key, "', which the block lacks"));
  }
  if (it->second.sizes().vec() != shape) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": '", key, "' is ",
                                                   model::ShapeStr(it->second.sizes().vec()),
                                                   ", expected ", model::ShapeStr(shape)));
  }
  return it->second.to(at::kFloat).contiguous();
}

// Positive finite steps, or InvalidArgument naming the extra.
Status CheckSteps(const at::Tensor& t, const char* key, int64_t layer) {
  const bool ok = at::isfinite(t).all().item<bool>() && (t > 0).all().item<bool>();
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": '", key, "' holds a step that is not positive and finite"));
  }
  return Status();
}

}  // namespace

StatusOr<std::shared_ptr<const model::PrefixKv>> PrefixFromExtras(const model::BlockWeights& w,
                                                                  const LlamaConfig& config,
                                                                  int64_t layer) {
  auto it = w.extra.find(kPrefixTokensKey);
  if (it == w.extra.end()) return std::shared_ptr<const model::PrefixKv>();
  const at::Tensor tokens = it->second.to(at::kDouble).contiguous();
  const int64_t o = tokens.numel();
  if (tokens.dim() != 1 || o < 1 || o > model::kMaxPrefixTokens) {
    return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": '", kPrefixTokensKey,
                                                   "' must hold 1..", model::kMaxPrefixTokens,
                                                   " token ids"));
  }
  auto p = std::make_shared<model::PrefixKv>();
  for (int64_t i = 0; i < o; ++i) {
    const double t = tokens[i].item<double>();
    if (t != std::floor(t) || t < 0 || t >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("block ", layer, ": '", kPrefixTokensKey,
                                                     "' holds ", t, ", not a token id"));
    }
    p->tokens.push_back(static_cast<int32_t>(t));
  }
  const std::vector<int64_t> shape = {config.num_key_value_heads, o, config.head_dim};
  QCAL_ASSIGN_OR_RETURN(p->k, Extra(w, kPrefixKKey, shape, layer));
  QCAL_ASSIGN_OR_RETURN(p->v, Extra(w, kPrefixVKey, shape, layer));
  return std::shared_ptr<const model::PrefixKv>(std::move(p));
}

void PrefixToExtras(const model::PrefixKv& prefix, model::BlockWeights* w) {
  std::vector<double> ids(prefix.tokens.begin(), prefix.tokens.end());
  w->extra[kPrefixTokensKey] =
      at::from_blob(ids.data(), {static_cast<int64_t>(ids.size())}, at::kDouble).clone();
  w->extra[kPrefixKKey] = prefix.k.to(at::kDouble).contiguous();
  w->extra[kPrefixVKey] = prefix.v.to(at::kDouble).contiguous();
}

Status InstallStaticInference(model::DecoderBlock& block, const LlamaConfig& config,
                              const PrefixquantConfig& q, const qsim::RotationPlan& plan,
                              int64_t layer) {
  model::BlockWeights& w = block.mutable_weights();
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const model::PrefixKv> prefix,
                        PrefixFromExtras(w, config, layer));
  if (q.prefix && !prefix) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, ": the recipe prefixes outlier tokens but the block has no prefix"));
  }
  if (!q.prefix && prefix) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": the block has a prefix the recipe does not make"));
  }
  at::Tensor r3;
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto t3, qsim::OnlineHadamard::Create(plan.head_dim));
    r3 = t3->transposed_matrix();
  }
  model::BlockHooks hooks = BaseHooks(plan, prefix, r3);
  if (q.quantizes_kv()) {
    const int64_t kv = config.num_key_value_heads;
    auto k = std::make_shared<Step>(), v = std::make_shared<Step>();
    QCAL_ASSIGN_OR_RETURN(k->value, Extra(w, kKStepsKey, {kv}, layer));
    QCAL_ASSIGN_OR_RETURN(v->value, Extra(w, kVStepsKey, {kv}, layer));
    QCAL_RETURN_IF_ERROR(CheckSteps(k->value, kKStepsKey, layer));
    QCAL_RETURN_IF_ERROR(CheckSteps(v->value, kVStepsKey, layer));
    hooks.kv_cache = std::make_shared<StaticKvHook>(k, v, q.kv_bits);
  }
  std::shared_ptr<Step> steps[4];
  for (auto& s : steps) s = std::make_shared<Step>();
  if (q.quantizes_activations()) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor t, Extra(w, kActStepsKey, {4}, layer));
    QCAL_RETURN_IF_ERROR(CheckSteps(t, kActStepsKey, layer));
    for (int i = 0; i < 4; ++i) steps[i]->value = t[i].clone();
  }
  std::shared_ptr<const qsim::OnlineHadamard> t4;
  if (plan.r4) {
    QCAL_ASSIGN_OR_RETURN(t4, qsim::R4Transform(plan));
  }
  block.set_hooks(std::move(hooks));
  for (LinearKind k : model::kAllLinears) {
    auto& slot = w.linears[static_cast<int>(k)];
    slot = std::make_unique<StaticActLinear>(Unwrap(std::move(slot)),
                                             k == LinearKind::kDown ? t4 : nullptr,
                                             steps[KindIndex(k)], q.act_bits);
  }
  return Status();
}

StatusOr<quant::BlockTaskResult> QuantizePrefixquantBlock(
    model::BlockWeights weights, const LlamaConfig& config, const model::Rope& rope,
    const PrefixquantConfig& q, const qsim::RotationPlan& plan,
    std::shared_ptr<const model::PrefixKv> prefix, int64_t layer, at::Tensor* x,
    at::Tensor* x_float, int64_t batch, bool propagate,
    const std::function<void(int64_t, int64_t, const std::string&)>& progress) {
  const auto t0 = Clock::now();
  const bool ft = q.block_ft.enabled;
  const int64_t total_steps = 3 + (ft ? 1 : 0) + (propagate ? 1 : 0);
  int64_t steps_done = 0;
  auto report = [&](const std::string& step) {
    if (progress) progress(++steps_done, total_steps, step);
  };
  if (ft && (x_float == nullptr || !x_float->defined() || x_float->sizes() != x->sizes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, ": block-wise fine-tuning needs the float model's inputs, as many as the "
        "calibration inputs"));
  }
  if (x == nullptr || !x->defined() || x->dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", layer, ": prefixquant needs the block's calibration inputs"));
  }
  if (q.prefix != (prefix != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", layer, q.prefix ? ": the recipe prefixes tokens but no prefix K/V was given"
                                  : ": a prefix was given to a recipe without one"));
  }
  if (weights.extra.count(kRotationsKey) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", layer, ": prefixquant needs the block rotated (RotateAndMarkBlock) first"));
  }
  at::NoGradGuard no_grad;
  try {
    if (prefix) PrefixToExtras(*prefix, &weights);
    const int64_t n = x->size(0);
    const int64_t ns = std::min<int64_t>(n, q.search_sequences);
    const at::Tensor xs = x->narrow(0, 0, ns);
    const int64_t kv = config.num_key_value_heads;
    at::Tensor r3;
    if (plan.r3) {
      QCAL_ASSIGN_OR_RETURN(auto t3, qsim::OnlineHadamard::Create(plan.head_dim));
      r3 = t3->transposed_matrix();
    }
    std::shared_ptr<const qsim::OnlineHadamard> t4;
    if (plan.r4) {
      QCAL_ASSIGN_OR_RETURN(t4, qsim::R4Transform(plan));
    }

    // ---- 1. Float statistics and the search targets.
    std::shared_ptr<Step> steps[4];
    for (auto& s : steps) s = std::make_shared<Step>();
    at::Tensor max_abs[4], gram[4];
    for (LinearKind k : model::kAllLinears) {
      auto& slot = weights.linears[static_cast<int>(k)];
      const int i = KindIndex(k);
      StaticActLinear::Observer observer;
      // One linear per input kind observes it (q/k/v and gate/up share their inputs).
      if (k == LinearKind::kQ || k == LinearKind::kO || k == LinearKind::kGate ||
          k == LinearKind::kDown) {
        observer = [&max_abs, &gram, i](const at::Tensor& h) {
          const at::Tensor flat = h.reshape({-1, h.size(-1)});
          const at::Tensor m = flat.abs().max();
          max_abs[i] = max_abs[i].defined() ? at::maximum(max_abs[i], m) : m;
          const at::Tensor d = flat.to(at::kDouble);
          if (!gram[i].defined()) gram[i] = at::zeros({d.size(1), d.size(1)}, at::kDouble);
          gram[i].addmm_(d.t(), d);
        };
      }
      slot = std::make_unique<StaticActLinear>(Unwrap(std::move(slot)),
                                               k == LinearKind::kDown ? t4 : nullptr, steps[i],
                                               q.act_bits, std::move(observer));
    }
    model::DecoderBlock block(config, std::move(weights));
    auto recorder = StaticKvHook::Recorder();
    {
      model::BlockHooks hooks = BaseHooks(plan, prefix, r3);
      hooks.kv_cache = recorder;
      block.set_hooks(std::move(hooks));
    }
    ChunkedForward(block, *x, rope, batch);
    block.set_hooks(BaseHooks(plan, prefix, r3));
    // Observers off from here on.
    for (LinearKind k : model::kAllLinears) {
      auto& slot = block.mutable_weights().linears[static_cast<int>(k)];
      slot = std::make_unique<StaticActLinear>(Unwrap(std::move(slot)),
                                               k == LinearKind::kDown ? t4 : nullptr,
                                               steps[KindIndex(k)], q.act_bits);
    }
    const at::Tensor y_ref = ChunkedForward(block, xs, rope, batch);
    // The float block on the float model's inputs: the fine-tuning targets, and the next block's
    // float inputs.
    at::Tensor y_float;
    if (x_float != nullptr && x_float->defined()) y_float = ChunkedForward(block, *x_float, rope, batch);
    at::Tensor float_w[7], weight_step[7];
    report("float statistics");

    // ---- 2. Weights, per output channel, by layer-output error.
    quant::BlockTaskResult result;
    result.layer = layer;
    for (LinearKind k : model::kAllLinears) {
      const auto t1 = Clock::now();
      auto* wrapper = dynamic_cast<StaticActLinear*>(&block.mutable_weights().linear(k));
      const at::Tensor w = wrapper->inner().DenseWeight().to(at::kFloat).contiguous();
      const at::Tensor& h = gram[KindIndex(k)];
      quant::LinearMetrics m;
      m.name = model::LinearName(k);
      const at::Tensor wd = w.to(at::kDouble);
      const double base = (wd.mm(h) * wd).sum().item<double>();
      if (!q.quantizes_weights()) {
        m.proxy_loss = 0;
        m.relative = 0;
        m.code_bits = m.stored_bits = 32;
      } else {
        const at::Tensor s0 = InitialStep(w.abs().amax(1), q.bits);  // [out]
        at::Tensor best_err, best_step;
        for (double c : ShrinkGrid()) {
          const at::Tensor s = s0 * c;
          const at::Tensor d = (FakeQuant(w, s.view({-1, 1}), q.bits) - w).to(at::kDouble);
          const at::Tensor err = (d.mm(h) * d).sum(1);
          if (!best_err.defined()) {
            best_err = err;
            best_step = s;
          } else {
            const at::Tensor better = err < best_err;
            best_err = at::where(better, err, best_err);
            best_step = at::where(better, s, best_step);
          }
        }
        float_w[static_cast<int>(k)] = w;
        weight_step[static_cast<int>(k)] = best_step;
        QCAL_ASSIGN_OR_RETURN(std::unique_ptr<quant::ScalarQuantLinear> rounded,
                              RoundWeights(w, best_step, q.bits));
        m.proxy_loss = best_err.sum().item<double>();
        m.relative = base > 0 ? m.proxy_loss / base : 0.0;
        m.code_bits = q.bits;
        m.stored_bits = q.bits + 32.0 / static_cast<double>(w.size(1));
        auto& slot = block.mutable_weights().linears[static_cast<int>(k)];
        slot = std::make_unique<StaticActLinear>(std::move(rounded),
                                                 k == LinearKind::kDown ? t4 : nullptr,
                                                 steps[KindIndex(k)], q.act_bits);
      }
      m.seconds = Seconds(t1);
      result.linears.push_back(m);
    }
    gram[0] = gram[1] = gram[2] = gram[3] = at::Tensor();
    report("weight steps and rounding");

    // ---- 3. Activation and KV steps.
    auto k_step = std::make_shared<Step>(), v_step = std::make_shared<Step>();
    at::Tensor k0, v0;
    if (q.quantizes_kv()) {
      k0 = InitialStep(recorder->max_k(), q.kv_bits);
      v0 = InitialStep(recorder->max_v(), q.kv_bits);
      model::BlockHooks hooks = BaseHooks(plan, prefix, r3);
      hooks.kv_cache = std::make_shared<StaticKvHook>(k_step, v_step, q.kv_bits);
      block.set_hooks(std::move(hooks));
    }
    at::Tensor a0[4];
    for (int i = 0; i < 4; ++i) {
      if (q.quantizes_activations()) a0[i] = InitialStep(max_abs[i], q.act_bits);
    }
    auto block_mse = [&]() { return Mse(ChunkedForward(block, xs, rope, batch), y_ref); };
    auto search_act = [&](int i) {
      if (!q.quantizes_activations()) return;
      if (!q.grid_search) {
        steps[i]->value = a0[i];
        return;
      }
      double best = std::numeric_limits<double>::infinity(), best_c = 1.0;
      auto try_c = [&](double c) {
        steps[i]->value = a0[i] * c;
        const double e = block_mse();
        if (e < best) {
          best = e;
          best_c = c;
        }
      };
      for (double c : CoarseGrid()) try_c(c);
      const double center = best_c;
      for (int j = 0; j < 10; ++j) try_c(center - 0.05 + 0.1 * j / 9.0);
      steps[i]->value = a0[i] * best_c;
    };
    auto search_kv = [&]() {
      if (!q.quantizes_kv()) return;
      if (!q.grid_search) {
        k_step->value = k0;
        v_step->value = v0;
        return;
      }
      const std::vector<double> grid = ShrinkGrid();
      at::Tensor k_err = at::zeros({static_cast<int64_t>(grid.size()), kv}, at::kDouble);
      at::Tensor v_err = at::zeros_like(k_err);
      const int64_t o = prefix ? prefix->length() : 0;
      for (int64_t s = 0; s < ns; s += batch) {
        auto [qq, kk, vv] = block.Projections(xs.narrow(0, s, std::min(batch, ns - s)), rope, o);
        const at::Tensor p_ref = AttentionProbs(qq, kk, prefix.get());
        for (size_t g = 0; g < grid.size(); ++g) {
          const at::Tensor kq = FakeQuant(kk, (k0 * grid[g]).view({1, -1, 1, 1}), q.kv_bits);
          const at::Tensor p = AttentionProbs(qq, kq, prefix.get());
          k_err[g] += (p - p_ref).to(at::kDouble).pow(2).sum({0, 2, 3, 4});
          const at::Tensor vq = FakeQuant(vv, (v0 * grid[g]).view({1, -1, 1, 1}), q.kv_bits);
          v_err[g] += (vq - vv).to(at::kDouble).pow(2).sum({0, 2, 3});
        }
      }
      const at::Tensor g_tensor = at::tensor(grid, at::kDouble);
      // argmin takes the first minimum: the largest c among ties.
      k_step->value = k0 * g_tensor.index_select(0, k_err.argmin(0)).to(at::kFloat);
      v_step->value = v0 * g_tensor.index_select(0, v_err.argmin(0)).to(at::kFloat);
    };
    search_act(0);  // qkv input
    search_kv();
    search_act(1);  // o input
    search_act(2);  // gate_up input
    search_act(3);  // down input (after R4)
    report("activation and KV steps");

    // ---- 4. Block-wise fine-tuning.
    if (ft) {
      std::vector<at::Tensor> train_w, train_s;
      for (LinearKind k : model::kAllLinears) {
        if (!q.quantizes_weights()) break;
        const int j = static_cast<int>(k);
        at::Tensor w = float_w[j].clone().requires_grad_(true);
        at::Tensor s = weight_step[j].clone().requires_grad_(true);
        train_w.push_back(w);
        train_s.push_back(s);
        auto& slot = block.mutable_weights().linears[j];
        slot = std::make_unique<StaticActLinear>(std::make_unique<FakeQuantLinear>(w, s, q.bits),
                                                 k == LinearKind::kDown ? t4 : nullptr,
                                                 steps[KindIndex(k)], q.act_bits);
      }
      std::vector<at::Tensor> act_and_kv;
      for (auto& st : steps) {
        if (st->value.defined()) {
          st->value = st->value.clone().requires_grad_(true);
          act_and_kv.push_back(st->value);
        }
      }
      for (auto* st : {k_step.get(), v_step.get()}) {
        if (st->value.defined()) {
          st->value = st->value.clone().requires_grad_(true);
          act_and_kv.push_back(st->value);
        }
      }
      std::vector<at::Tensor> all_steps = train_s;
      all_steps.insert(all_steps.end(), act_and_kv.begin(), act_and_kv.end());
      const int64_t val = std::min<int64_t>(q.block_ft.val_sequences, n - 1);
      const auto t_ft = Clock::now();
      QCAL_ASSIGN_OR_RETURN(
          BlockFtReport r,
          TrainBlock(block, rope, *x, y_float, n - val, train_w, all_steps, q.block_ft,
                     0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(layer),
                     [&all_steps]() {
                       for (at::Tensor& t : all_steps) t.clamp_min_(1e-8);
                     }));
      QCAL_LOG_INFO("prefixquant block {}: fine-tuned {} steps, train loss {:.4g} -> {:.4g}, "
                    "held-out MSE {:.4g} -> {:.4g}",
                    layer, r.steps, r.train_loss_first, r.train_loss_last, r.val_mse_before,
                    r.val_mse_after);
      result.mse_before_ft = r.val_mse_before;
      result.mse_after_ft = r.val_mse_after;
      result.finetune_seconds = Seconds(t_ft);
      // The trained weights rounded with their trained steps; every step fixed.
      for (LinearKind k : model::kAllLinears) {
        if (!q.quantizes_weights()) break;
        const int j = static_cast<int>(k);
        auto* wrapper = dynamic_cast<StaticActLinear*>(&block.mutable_weights().linear(k));
        const auto* fq = dynamic_cast<const FakeQuantLinear*>(&wrapper->inner());
        QCAL_ASSIGN_OR_RETURN(std::unique_ptr<quant::ScalarQuantLinear> rounded,
                              RoundWeights(fq->weight(), fq->step(), q.bits));
        block.mutable_weights().linears[j] = std::make_unique<StaticActLinear>(
            std::move(rounded), k == LinearKind::kDown ? t4 : nullptr, steps[KindIndex(k)],
            q.act_bits);
      }
      for (auto& st : steps) {
        if (st->value.defined()) st->value = st->value.detach().clone();
      }
      for (auto* st : {k_step.get(), v_step.get()}) {
        if (st->value.defined()) st->value = st->value.detach().clone();
      }
      report("block-wise fine-tuning");
    }
    const double mse = block_mse();

    // ---- Extras, and the next block's inputs.
    model::BlockWeights& w = block.mutable_weights();
    if (q.quantizes_activations()) {
      at::Tensor t = at::empty({4}, at::kDouble);
      for (int i = 0; i < 4; ++i) t[i] = steps[i]->value.to(at::kDouble);
      w.extra[kActStepsKey] = t;
    }
    if (q.quantizes_kv()) {
      w.extra[kKStepsKey] = k_step->value.to(at::kDouble).contiguous();
      w.extra[kVStepsKey] = v_step->value.to(at::kDouble).contiguous();
    }
    QCAL_LOG_INFO("prefixquant block {}: quantized block output MSE {:.4g} (relative {:.4g})",
                  layer, mse, mse / std::max(1e-30, y_ref.to(at::kDouble).pow(2).mean().item<double>()));
    if (propagate) {
      *x = ChunkedForward(block, *x, rope, batch);
      if (y_float.defined()) *x_float = std::move(y_float);
      report("propagation");
    }
    result.weights = std::move(block.mutable_weights());
    result.seconds = Seconds(t0);
    return result;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("prefixquant block ", layer, ": ", e.what()));
  }
}

StatusOr<at::Tensor> FloatBlockForward(model::BlockWeights prepared, const LlamaConfig& config,
                                       const model::Rope& rope, const qsim::RotationPlan& plan,
                                       std::shared_ptr<const model::PrefixKv> prefix,
                                       int64_t layer, const at::Tensor& x, int64_t batch) {
  model::DecoderBlock block(config, std::move(prepared));
  QCAL_RETURN_IF_ERROR(qsim::InstallOnlineRotations(block, plan));
  model::BlockHooks hooks = block.hooks();
  hooks.prefix = std::move(prefix);
  block.set_hooks(std::move(hooks));
  at::NoGradGuard no_grad;
  try {
    return ChunkedForward(block, x, rope, batch);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("float block ", layer, " forward: ", e.what()));
  }
}

Status AppendPrefixquantExtras(int64_t layer, const model::BlockWeights& weights,
                               SafetensorsWriter* writer) {
  const std::string p = BlockPrefix(layer);
  for (const auto& [key, tensor] : weights.extra) {
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(writer, p + key, tensor));
  }
  return Status();
}

Status LoadPrefixquantExtras(CheckpointReader& ckpt, const LlamaConfig& config, int64_t layer,
                             model::BlockWeights* w) {
  const std::string p = BlockPrefix(layer);
  const int64_t kv = config.num_key_value_heads;
  const std::pair<const char*, std::vector<int64_t>> fixed[] = {
      {kActStepsKey, {4}}, {kKStepsKey, {kv}}, {kVStepsKey, {kv}}, {kRotationsKey, {4}}};
  auto read = [&](const std::string& key, const std::vector<int64_t>* shape) -> Status {
    if (!ckpt.Has(p + key)) return Status();
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(p + key));
    const TensorInfo& info = *found.second;
    if (info.dtype != DType::kF64 || (shape != nullptr && info.shape != *shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          found.first->path(), ": tensor '", p, key, "' must be F64",
          shape ? absl::StrCat(" of shape ", model::ShapeStr(*shape)) : std::string()));
    }
    at::Tensor t = at::empty(info.shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), found.first->Data(info), t.numel() * sizeof(double));
    w->extra[key] = t;
    return Status();
  };
  for (const auto& [key, shape] : fixed) QCAL_RETURN_IF_ERROR(read(key, &shape));
  for (const char* key : {kPrefixTokensKey, kPrefixKKey, kPrefixVKey}) {
    QCAL_RETURN_IF_ERROR(read(key, nullptr));
  }
  const Status prefix = PrefixFromExtras(*w, config, layer).status();
  if (!prefix.ok()) return Annotate(prefix, ckpt.dir());
  return Status();
}

}  // namespace qcal::methods::prefixquant
