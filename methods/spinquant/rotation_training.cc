#include "methods/spinquant/rotation_training.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/qsim/act_quant.h"

namespace qcal::methods::spinquant {
namespace {

using model::LinearKind;

// The dynamic scale of each parameter set of xs [sets, n] under `grid` (differentiable in xs):
// clip · max|x| / qmax (symmetric) or clip · (max(x, 0) − min(x, 0)) / qmax, [sets, 1].
at::Tensor SetScale(const at::Tensor& xs, const FakeQuantGrid& grid) {
  if (grid.symmetric) {
    const double qmax = static_cast<double>((int64_t{1} << (grid.bits - 1)) - 1);
    return xs.abs().amax(1, true) * (grid.clip / qmax);
  }
  const double qmax = static_cast<double>((int64_t{1} << grid.bits) - 1);
  return (xs.amax(1, true).clamp_min(0) - xs.amin(1, true).clamp_max(0)) * (grid.clip / qmax);
}

// x + err, err = q − x the rounding error of the fake-quantized value q (computed from x's values,
// no graph), with a straight-through gradient: identity, and with `range` also the gradient
// through the sets' scales (LSQ: q = x + s·u, u = (q − x)/s held fixed), the sets being the last
// dim in pieces of set_size (> 0) or one per index of dim 0 (0; one for all of x when
// x.dim() < 3). The value is the same either way: the scale term is (s − s) · u = 0.
at::Tensor Ste(const at::Tensor& x, const at::Tensor& err, const FakeQuantGrid* range,
               int64_t set_size) {
  at::Tensor out = x + err;
  if (range == nullptr || !x.requires_grad()) return out;
  const at::Tensor xs = set_size > 0 ? x.reshape({-1, set_size})
                        : x.dim() >= 3 ? x.reshape({x.size(0), -1})
                                       : x.reshape({1, -1});
  const at::Tensor scale = SetScale(xs, *range);
  const at::Tensor sd = scale.detach();
  const at::Tensor u =
      at::where(sd > 0, err.reshape(xs.sizes()) / sd.clamp_min(1e-30), at::zeros_like(sd));
  return out + ((scale - sd) * u).reshape(x.sizes());
}

// Per-row (last dim) asymmetric fake quantization with an identity backward (SpinQuant's STE),
// or with the range gradient too.
at::Tensor SteAsym(const at::Tensor& x, int bits, bool range_gradient) {
  if (bits >= 16) return x;
  const at::Tensor d = x.detach();
  const double qmax = static_cast<double>((int64_t{1} << bits) - 1);
  const at::Tensor lo = std::get<0>(d.min(-1, true)).clamp_max(0);
  const at::Tensor hi = std::get<0>(d.max(-1, true)).clamp_min(0);
  const at::Tensor s = ((hi - lo) / qmax).clamp_min(1e-8);
  const at::Tensor z = at::round(-lo / s);
  const at::Tensor q = (at::clamp(at::round(d / s) + z, 0.0, qmax) - z) * s;
  const FakeQuantGrid grid{bits, false, 1.0};
  return Ste(x, q - d, range_gradient ? &grid : nullptr, x.size(-1));
}

// The rounding error q(w) − w of per-output-channel symmetric RTN at the channel's max (w [out,
// in] without a graph).
at::Tensor RtnWeightError(const at::Tensor& d, int bits) {
  const double qmax = static_cast<double>((int64_t{1} << (bits - 1)) - 1);
  const at::Tensor s = (d.abs().amax(1, true) / qmax).clamp_min(1e-8);
  return at::clamp(at::round(d / s), -qmax - 1, qmax) * s - d;
}

// x → (R4) → per-token fake quantization → x·Wᵀ.
class TrainLinear final : public model::Linear {
 public:
  TrainLinear(at::Tensor w, std::shared_ptr<const OnlineHadamard> r4, int act_bits,
              std::shared_ptr<const ActivationQuantizer> quantizer, bool range_gradient)
      : w_(std::move(w)), r4_(std::move(r4)), act_bits_(act_bits),
        quantizer_(std::move(quantizer)), range_gradient_(range_gradient) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    const at::Tensor h = r4_ ? r4_->ApplyDifferentiable(x) : x;
    at::Tensor q;
    if (act_bits_ >= 16) {
      q = h;
    } else if (quantizer_) {
      const at::Tensor d = h.detach();
      q = Ste(h, quantizer_->Apply(d) - d, range_gradient_ ? &quantizer_->grid() : nullptr,
              quantizer_->per_token() ? h.size(-1) : 0);
    } else {
      q = SteAsym(h, act_bits_, range_gradient_);
    }
    return at::matmul(q, w_.t());
  }
  int64_t in_features() const override { return w_.size(1); }
  int64_t out_features() const override { return w_.size(0); }
  at::Tensor DenseWeight() const override { return w_.detach(); }

 private:
  at::Tensor w_;
  std::shared_ptr<const OnlineHadamard> r4_;
  int act_bits_;
  std::shared_ptr<const ActivationQuantizer> quantizer_;
  bool range_gradient_;
};

// K and V per token and head, asymmetric, identity backward; queries pass.
class TrainKvHook final : public model::KvCacheHook {
 public:
  TrainKvHook(int bits, std::shared_ptr<const model::KvCacheHook> inner, bool range_gradient,
              const FakeQuantGrid& grid, int64_t group)
      : bits_(bits), inner_(std::move(inner)), range_gradient_(range_gradient), grid_(grid),
        group_(group) {}
  at::Tensor Apply(const at::Tensor& x, model::KvRole role) const override {
    if (role == model::KvRole::kQuery) return x;
    if (!inner_) return SteAsym(x, bits_, range_gradient_);
    const at::Tensor d = x.detach();
    return Ste(x, inner_->Apply(d, role) - d, range_gradient_ ? &grid_ : nullptr,
               group_ > 0 ? group_ : x.size(-1));
  }
  std::string Describe() const override {
    return inner_ ? absl::StrCat(inner_->Describe(), " (STE)")
                  : absl::StrCat("int", bits_, " asym per token/head (STE)");
  }

 private:
  int bits_;
  std::shared_ptr<const model::KvCacheHook> inner_;
  bool range_gradient_;
  FakeQuantGrid grid_;
  int64_t group_;
};

// One feed-forward MLP's float weights (a dense MLP, Llama 4's shared expert or a routed
// expert): gate and up with post_attention_layernorm fused, down with R4's inverse fused, and
// down before that fusion when smoothing scales sit before R4.
struct FusedMlp {
  at::Tensor gate, up, down, down_raw;
  int64_t bytes() const {
    int64_t b = 0;
    for (const at::Tensor* t : {&gate, &up, &down, &down_raw}) b += t->defined() ? t->numel() * 4 : 0;
    return b;
  }
};

// A block's float weights with its norms fused into q/k/v and the feed-forward's readers (a MoE
// block's router and experts included) and R4's inverse fused into every down_proj, float32.
struct FusedWeights {
  int64_t layer = 0;  // which block (its attention variant, whether it is MoE)
  at::Tensor q, k, v, o;
  std::optional<FusedMlp> mlp;   // the dense MLP or shared expert; none in a Mixtral MoE block
  at::Tensor router;             // a MoE block's [experts, hidden] (float, never quantized)
  std::vector<FusedMlp> experts;  // a MoE block's routed experts, in order
  int64_t bytes() const {
    int64_t b = 0;
    for (const at::Tensor* t : {&q, &k, &v, &o, &router}) b += t->defined() ? t->numel() * 4 : 0;
    if (mlp) b += mlp->bytes();
    for (const FusedMlp& e : experts) b += e.bytes();
    return b;
  }
};

StatusOr<FusedMlp> FuseMlp(const model::Linear& gate, const model::Linear& up,
                           const model::Linear& down, const at::Tensor& post_norm,
                           const OnlineHadamard* t4, bool keep_down) {
  FusedMlp m;
  const at::Tensor a = post_norm.to(at::kFloat);
  m.gate = (gate.DenseWeight().to(at::kFloat) * a).contiguous();
  m.up = (up.DenseWeight().to(at::kFloat) * a).contiguous();
  m.down = down.DenseWeight().to(at::kFloat).contiguous();
  if (t4 != nullptr) {
    if (keep_down) m.down_raw = m.down;
    QCAL_ASSIGN_OR_RETURN(m.down, FuseInputHadamard(m.down, *t4));
    m.down = m.down.contiguous();
  }
  return m;
}

StatusOr<FusedWeights> FuseBlock(const model::BlockWeights& src, const OnlineHadamard* t4,
                                 bool keep_down) {
  FusedWeights f;
  f.layer = src.layer;
  const at::Tensor a_in = src.input_norm.to(at::kFloat);
  f.q = (src.linear(LinearKind::kQ).DenseWeight().to(at::kFloat) * a_in).contiguous();
  f.k = (src.linear(LinearKind::kK).DenseWeight().to(at::kFloat) * a_in).contiguous();
  f.v = (src.linear(LinearKind::kV).DenseWeight().to(at::kFloat) * a_in).contiguous();
  f.o = src.linear(LinearKind::kO).DenseWeight().to(at::kFloat).contiguous();
  if (src.has(LinearKind::kGate)) {
    QCAL_ASSIGN_OR_RETURN(f.mlp, FuseMlp(src.linear(LinearKind::kGate), src.linear(LinearKind::kUp),
                                         src.linear(LinearKind::kDown), src.post_norm, t4,
                                         keep_down));
  }
  if (src.moe != nullptr) {
    f.router = (src.moe->router.to(at::kFloat) * src.post_norm.to(at::kFloat)).contiguous();
    for (const model::ExpertWeights& e : src.moe->experts) {
      QCAL_ASSIGN_OR_RETURN(FusedMlp m, FuseMlp(e.linear(model::ExpertLinear::kGate),
                                                e.linear(model::ExpertLinear::kUp),
                                                e.linear(model::ExpertLinear::kDown),
                                                src.post_norm, t4, keep_down));
      f.experts.push_back(std::move(m));
    }
  }
  return f;
}

// The rotated, fake-quantized block (t1 = T1 [hidden, hidden], t2 = this block's T2, float32,
// differentiable) applied to h [b, s, hidden]. A MoE block's router is rotated (R1) and stays
// float; each routed expert is rotated and fake-quantized like the dense MLP, behind the same
// smoothing scales (they preserve each expert's function alone). `offsets` index the linears
// as kAllLinears (the absent ones unused), then 3 per routed expert (gate, up, down).
at::Tensor RotatedBlockForward(const FusedWeights& f, const LlamaConfig& c,
                               const model::Rope& rope, const at::Tensor& t1,
                               const at::Tensor& t2, const std::shared_ptr<const OnlineHadamard>& t4,
                               const at::Tensor& r3, const RotationTrainingOptions& o,
                               const at::Tensor& h, std::vector<at::Tensor>* offsets = nullptr,
                               const at::Tensor& smooth = at::Tensor()) {
  const int64_t hid = c.hidden_size, d = c.head_dim, kv = c.num_key_value_heads;
  const int64_t heads = c.num_attention_heads;
  at::Tensor fq = f.q, fk = f.k;
  std::vector<at::Tensor> s;
  if (smooth.defined()) {  // the smoothing scales before R3 (Q, K) and R4 (up, down)
    s = SmoothingFactors(c, smooth);
    if (SmoothsAttention(c, f.layer)) {
      fq = fq * s[0].unsqueeze(1);
      fk = fk * s[1].unsqueeze(1);
    }
  }
  // One MLP's up and down behind the smoothing scales (before R4).
  auto smoothed = [&](const FusedMlp& m) -> std::pair<at::Tensor, at::Tensor> {
    if (!smooth.defined()) return {m.up, m.down};
    if (!t4) return {m.up * s[2].unsqueeze(1), m.down * s[3]};
    if (!m.down_raw.defined()) {
      throw std::runtime_error("smoothing before R4 needs the unfused down_proj");
    }
    return {m.up * s[2].unsqueeze(1), t4->ApplyDifferentiable(m.down_raw * s[3])};
  };
  // The products are made in a fixed order (the dense block's: q, k, v, gate, up, o, down, then
  // each routed expert's gate, up, down): the order autograd accumulates T1's gradient in, so
  // training's bits do not change with how the code is arranged.
  const int64_t experts = static_cast<int64_t>(f.experts.size());
  std::vector<at::Tensor> w(7 + 3 * experts);
  const int Q = 0, K = 1, V = 2, O = 3, G = 4, U = 5, D = 6;
  at::Tensor fu, fd;
  if (f.mlp) std::tie(fu, fd) = smoothed(*f.mlp);
  w[Q] = at::matmul(fq, t1.t());
  w[K] = at::matmul(fk, t1.t());
  w[V] = at::matmul(t2, at::matmul(f.v, t1.t()).view({kv, d, hid})).reshape({kv * d, hid});
  if (f.mlp) {
    w[G] = at::matmul(f.mlp->gate, t1.t());
    w[U] = at::matmul(fu, t1.t());
  }
  w[O] = at::matmul(at::matmul(t1, f.o).view({hid, heads, d}), t2.t()).reshape({hid, heads * d});
  if (f.mlp) w[D] = at::matmul(t1, fd);
  for (int64_t e = 0; e < experts; ++e) {
    const auto [eu, ed] = smoothed(f.experts[e]);
    w[7 + 3 * e] = at::matmul(f.experts[e].gate, t1.t());
    w[8 + 3 * e] = at::matmul(eu, t1.t());
    w[9 + 3 * e] = at::matmul(t1, ed);
  }
  // Fake quantization of weight j (straight-through), then its training linear.
  auto make_linear = [&](size_t j, bool down) -> std::unique_ptr<model::Linear> {
    at::Tensor wq;
    if (o.weight_bits < 16 && o.weight_quantizer) {
      // q(w) − w is constant for given rotations: computed once per step and block when the
      // caller keeps `offsets` (the clip search is the step's most expensive part otherwise).
      at::Tensor off = offsets != nullptr && j < offsets->size() ? (*offsets)[j] : at::Tensor();
      if (!off.defined()) {
        const at::Tensor dw = w[j].detach();
        StatusOr<at::Tensor> q = o.weight_quantizer(dw);
        if (!q.ok()) throw std::runtime_error(std::string(q.status().message()));
        off = q->to(at::kFloat) - dw;
        if (offsets != nullptr) {
          if (offsets->size() < w.size()) offsets->resize(w.size());
          (*offsets)[j] = off;
        }
      }
      const FakeQuantGrid grid{o.weight_bits, o.weight_symmetric, 1.0};
      const int64_t in = w[j].size(1);
      const int64_t set = o.weight_group > 0 && o.weight_group < in ? o.weight_group : in;
      wq = Ste(w[j], off, o.range_gradient ? &grid : nullptr, set);
    } else {
      const FakeQuantGrid grid{o.weight_bits, true, 1.0};
      wq = o.weight_bits >= 16
               ? w[j]
               : Ste(w[j], RtnWeightError(w[j].detach(), o.weight_bits),
                     o.range_gradient ? &grid : nullptr, w[j].size(1));
    }
    return std::make_unique<TrainLinear>(wq, down ? t4 : nullptr, o.act_bits, o.act_quantizer,
                                         o.range_gradient);
  };
  model::BlockWeights bw;
  bw.layer = f.layer;
  bw.input_norm = at::ones({hid}, at::kFloat);
  bw.post_norm = at::ones({hid}, at::kFloat);
  for (LinearKind k : model::kAllLinears) {
    const size_t j = static_cast<size_t>(k);
    if (!w[j].defined()) continue;  // a Mixtral MoE block's dense MLP
    bw.linears[j] = make_linear(j, k == LinearKind::kDown);
  }
  if (f.router.defined()) {
    bw.moe = std::make_unique<model::MoeWeights>();
    bw.moe->router = at::matmul(f.router, t1.t());
    bw.moe->experts.resize(experts);
    for (int64_t e = 0; e < experts; ++e) {
      for (model::ExpertLinear k : model::kExpertLinears) {
        const int i = static_cast<int>(k);
        bw.moe->experts[e].linears[i] =
            make_linear(7 + 3 * e + i, k == model::ExpertLinear::kDown);
      }
    }
  }
  model::DecoderBlock block(c, std::move(bw));
  model::BlockHooks hooks;
  if (r3.defined()) hooks.qk_rotation = r3;
  if (o.kv_bits < 16) {
    const bool range = o.range_gradient && (!o.kv_quantizer || o.kv_range_gradient);
    hooks.kv_cache =
        std::make_shared<TrainKvHook>(o.kv_bits, o.kv_quantizer, range, o.kv_grid, o.kv_group);
  }
  block.set_hooks(std::move(hooks));
  return block.Forward(h, rope);
}

}  // namespace

bool SmoothsAttention(const LlamaConfig& c, int64_t layer) {
  return !(c.use_qk_norm && c.UsesRope(layer));
}

Status CheckTrainableModel(const LlamaConfig& c) {
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.MlpSize(l) != c.intermediate_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotation training: layer ", l, "'s MLP is ", c.MlpSize(l), " wide, its experts ",
          c.intermediate_size, ": R4 and the smoothing scales are trained for one intermediate "
          "size (Llama 4 with dense layers of intermediate_size_mlp is not supported yet; "
          "method quarot rotates it)"));
    }
  }
  return Status();
}

namespace {

// The fixed online rotations of the plan: R4 (down_proj input) and R3's Tᵀ (q and k).
Status OnlineParts(const RotationPlan& plan, std::shared_ptr<const OnlineHadamard>* t4,
                   at::Tensor* r3) {
  if (!plan.r1 || !plan.r2) {
    return absl::InvalidArgumentError("rotation training needs a plan with R1 and R2");
  }
  if (plan.r4) {
    QCAL_ASSIGN_OR_RETURN(*t4, R4Transform(plan));
  }
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto h3, OnlineHadamard::Create(plan.head_dim));
    *r3 = h3->transposed_matrix();
  }
  return Status();
}

// The float model's options: nothing quantized (its logits do not depend on the rotations).
RotationTrainingOptions FloatOptions(const RotationTrainingOptions& o) {
  RotationTrainingOptions f;
  f.weight_bits = f.act_bits = f.kv_bits = 16;
  return f;
}

}  // namespace

int64_t SmoothingSize(const LlamaConfig& c) {
  return c.num_key_value_heads * (c.head_dim / 2) + c.intermediate_size;
}

std::vector<at::Tensor> SmoothingFactors(const LlamaConfig& c, const at::Tensor& a) {
  const int64_t kv = c.num_key_value_heads, half = c.head_dim / 2;
  const at::Tensor ak = a.narrow(0, 0, kv * half).view({kv, half});
  const at::Tensor pairs = at::cat({ak, ak}, 1);  // [kv, head_dim]: pair (i, i + d/2)
  const at::Tensor ad = a.narrow(0, kv * half, c.intermediate_size);
  const at::Tensor q = pairs.unsqueeze(1).expand({kv, c.gqa_groups(), c.head_dim});
  return {at::exp(q.reshape({c.q_dim()})), at::exp(-pairs.reshape({c.kv_dim()})), at::exp(-ad),
          at::exp(ad)};
}

Status SmoothBlockWeights(const LlamaConfig& c, const at::Tensor& a, model::BlockWeights* w) {
  if (a.dim() != 1 || a.size(0) != SmoothingSize(c) || c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smoothing scales: ", a.dim() == 1 ? a.size(0) : -1, " values, the block needs ",
        SmoothingSize(c)));
  }
  const at::Tensor ad = a.to(at::kDouble);
  if (!at::isfinite(ad).all().item<bool>() || ad.abs().max().item<double>() > 80) {
    return absl::InvalidArgumentError("smoothing scales: a log-scale is non-finite or beyond ±80");
  }
  const std::vector<at::Tensor> s = SmoothingFactors(c, ad);
  auto scale = [&](std::unique_ptr<model::Linear>& slot, const at::Tensor& factor, bool rows) {
    const at::Tensor dense = slot->DenseWeight().to(at::kDouble);
    const at::Tensor scaled = rows ? dense * factor.unsqueeze(1) : dense * factor;
    slot = std::make_unique<model::DenseLinear>(scaled.to(at::kFloat).contiguous());
  };
  try {
    if (SmoothsAttention(c, w->layer)) {
      scale(w->linears[static_cast<int>(LinearKind::kQ)], s[0], true);
      scale(w->linears[static_cast<int>(LinearKind::kK)], s[1], true);
    }
    // Every MLP of the block (the dense one or shared expert, each routed expert) behind the
    // same scales: each keeps its function alone.
    if (w->has(LinearKind::kUp)) {
      scale(w->linears[static_cast<int>(LinearKind::kUp)], s[2], true);
      scale(w->linears[static_cast<int>(LinearKind::kDown)], s[3], false);
    }
    if (w->moe != nullptr) {
      for (model::ExpertWeights& e : w->moe->experts) {
        scale(e.linears[static_cast<int>(model::ExpertLinear::kUp)], s[2], true);
        scale(e.linears[static_cast<int>(model::ExpertLinear::kDown)], s[3], false);
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("smoothing scales: ", e.what()));
  }
  return Status();
}

double RotationLr(const RotationTrainingOptions& o, int64_t t) {
  return o.lr * 0.5 * (1 + std::cos(M_PI * static_cast<double>(t) / static_cast<double>(o.steps)));
}

StatusOr<at::Tensor> RotatedQuantizedLoss(const model::LlamaModel& m, const RotationPlan& plan,
                                          const at::Tensor& t1d, const at::Tensor& t2d,
                                          const at::Tensor& tokens,
                                          const RotationTrainingOptions& o,
                                          const at::Tensor& smooth) {
  const LlamaConfig& c = m.config();
  if (tokens.dim() != 2 || tokens.size(1) < 2) {
    return absl::InvalidArgumentError("rotation training: tokens must be [b, s >= 2]");
  }
  QCAL_RETURN_IF_ERROR(CheckTrainableModel(c));
  std::shared_ptr<const OnlineHadamard> t4;
  at::Tensor r3;
  QCAL_RETURN_IF_ERROR(OnlineParts(plan, &t4, &r3));
  const at::Tensor t1 = t1d.to(at::kFloat);
  const at::Tensor t2 = t2d.to(at::kFloat);
  const bool kl = o.loss == RotationTrainingOptions::Loss::kKlToFloat;
  const RotationTrainingOptions fo = FloatOptions(o);
  const at::Tensor e = m.Embed(tokens).to(at::kFloat);
  at::Tensor h = at::matmul(e, t1.t());
  at::Tensor hf = e;  // the float model without rotations (KL)
  const at::Tensor eye1 = at::eye(c.hidden_size, at::kFloat);
  const at::Tensor eye2 = at::eye(c.head_dim, at::kFloat);
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    QCAL_ASSIGN_OR_RETURN(FusedWeights f,
                          FuseBlock(m.block(l).weights(), t4.get(), smooth.defined()));
    try {
      h = RotatedBlockForward(f, c, m.rope(), t1, t2[l], t4, r3, o, h, nullptr,
                              smooth.defined() ? smooth[l].to(at::kFloat) : at::Tensor());
      if (kl) {
        at::NoGradGuard no_grad;
        hf = RotatedBlockForward(f, c, m.rope(), eye1, eye2, t4, r3, fo, hf);
      }
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("rotation training, block ", l, ": ", e.what()));
    }
  }
  const at::Tensor head = m.head().DenseWeight().to(at::kFloat) * m.final_norm().to(at::kFloat);
  const at::Tensor ones = at::ones({c.hidden_size}, at::kFloat);
  const at::Tensor normed = model::RmsNorm(h, ones, c.rms_norm_eps);
  const int64_t s = tokens.size(1);
  const at::Tensor logits =
      at::matmul(normed.narrow(1, 0, s - 1), at::matmul(head, t1.t()).t());  // [b, s-1, V]
  const at::Tensor lq = at::log_softmax(logits.reshape({-1, logits.size(-1)}), -1);
  if (kl) {
    at::Tensor lf;
    {
      at::NoGradGuard no_grad;
      const at::Tensor nf = model::RmsNorm(hf, ones, c.rms_norm_eps).narrow(1, 0, s - 1);
      lf = at::log_softmax(at::matmul(nf, head.t()).reshape({-1, logits.size(-1)}), -1);
    }
    return (lf.exp() * (lf - lq)).sum(-1).mean();
  }
  const at::Tensor targets = tokens.narrow(1, 1, s - 1).reshape({-1});
  return at::nll_loss(lq, targets);
}

struct RotationGradients::Fused : FusedWeights {};

RotationGradients::~RotationGradients() = default;

StatusOr<std::unique_ptr<RotationGradients>> RotationGradients::Create(
    model::ModelSource* source, const RotationPlan& plan, const RotationTrainingOptions& options,
    int64_t cache_bytes) {
  QCAL_RETURN_IF_ERROR(CheckTrainableModel(source->config()));
  std::unique_ptr<RotationGradients> g(new RotationGradients());
  g->source_ = source;
  g->plan_ = plan;
  g->options_ = options;
  g->cache_bytes_ = std::max<int64_t>(0, cache_bytes);
  g->keep_down_ = options.smooth;
  if (options.smooth && source->config().head_dim % 2 != 0) {
    return absl::InvalidArgumentError("smoothing scales need an even head_dim (RoPE pairs)");
  }
  QCAL_RETURN_IF_ERROR(OnlineParts(plan, &g->t4_, &g->r3_));
  QCAL_ASSIGN_OR_RETURN(g->final_norm_, source->FinalNorm());
  g->final_norm_ = g->final_norm_.to(at::kFloat);
  g->cached_.resize(source->config().num_hidden_layers);
  return g;
}

StatusOr<std::shared_ptr<const RotationGradients::Fused>> RotationGradients::Block(int64_t layer) {
  if (cached_[layer]) return cached_[layer];
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, source_->LoadBlockWeights(layer));
  auto fused = std::make_shared<Fused>();
  {
    at::NoGradGuard no_grad;
    QCAL_ASSIGN_OR_RETURN(static_cast<FusedWeights&>(*fused), FuseBlock(w, t4_.get(), keep_down_));
  }
  if (fused->bytes() <= cache_bytes_) {
    cache_bytes_ -= fused->bytes();
    cached_[layer] = fused;
  }
  return std::shared_ptr<const Fused>(std::move(fused));
}

StatusOr<at::Tensor> RotationGradients::HeadChunk(int64_t begin, int64_t n) {
  const LlamaConfig& c = source_->config();
  if (head_.defined()) return head_.narrow(0, begin, n);
  at::NoGradGuard no_grad;
  const int64_t whole = c.vocab_size * c.hidden_size * 4;
  if (begin == 0 && n == c.vocab_size && whole <= cache_bytes_) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor rows, source_->HeadRows(0, c.vocab_size));
    head_ = rows.to(at::kFloat) * final_norm_;
    cache_bytes_ -= whole;
    return head_;
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor rows, source_->HeadRows(begin, n));
  return rows.to(at::kFloat) * final_norm_;
}

std::vector<at::Tensor>* RotationGradients::StepOffsets(const at::Tensor& r1, const at::Tensor& r2,
                                                        const at::Tensor& smooth, int64_t layer) {
  // Keyed by the rotation tensors themselves (identity and version, O(1) where comparing values
  // would read hidden² doubles per block and sequence): new rotations, or these changed in place,
  // start afresh.
  if (!offsets_r1_.defined() || !offsets_r1_.is_same(r1) || !offsets_r2_.is_same(r2) ||
      offsets_v1_ != r1._version() || offsets_v2_ != r2._version() ||
      offsets_s_.defined() != smooth.defined() ||
      (smooth.defined() && (!offsets_s_.is_same(smooth) || offsets_vs_ != smooth._version()))) {
    offsets_r1_ = r1;
    offsets_r2_ = r2;
    offsets_s_ = smooth;
    offsets_v1_ = r1._version();
    offsets_v2_ = r2._version();
    offsets_vs_ = smooth.defined() ? smooth._version() : 0;
    offsets_.assign(source_->config().num_hidden_layers, {});
  }
  return &offsets_[layer];
}

StatusOr<double> RotationGradients::HeadLoss(const at::Tensor& ud, const at::Tensor& uf,
                                             const at::Tensor& targets, bool kl,
                                             at::Tensor* grad_u) {
  const LlamaConfig& c = source_->config();
  const int64_t hid = c.hidden_size, vocab = c.vocab_size, n = ud.size(0);
  const int64_t step =
      head_.defined() || vocab * hid * 4 <= cache_bytes_ ? vocab : model::TableChunkRows(hid);
  at::Tensor lse, lse_f, target_logit = at::zeros({n}, at::kFloat);
  auto merge = [](at::Tensor* acc, const at::Tensor& chunk) {
    *acc = acc->defined() ? at::logaddexp(*acc, chunk) : chunk;
  };
  for (int64_t b = 0; b < vocab; b += step) {
    const int64_t m = std::min(step, vocab - b);
    QCAL_ASSIGN_OR_RETURN(at::Tensor w, HeadChunk(b, m));
    const at::Tensor logits = at::matmul(ud, w.t());  // [n, m]
    merge(&lse, at::logsumexp(logits, 1));
    if (kl) {
      merge(&lse_f, at::logsumexp(at::matmul(uf, w.t()), 1));
      continue;
    }
    const at::Tensor in = (targets >= b).logical_and(targets < b + m);
    const at::Tensor rows = at::nonzero(in).view({-1});
    if (rows.numel() > 0) {
      target_logit.index_put_({rows}, logits.index({rows, targets.index({rows}) - b}));
    }
  }
  if (!kl && grad_u == nullptr) return (lse - target_logit).mean().item<double>();
  // Second pass: the KL's sum, and softmax(logits) − onehot (cross-entropy) or
  // softmax(logits) − softmax(float logits) (KL) into d loss / d u.
  at::Tensor kl_sum = at::zeros({n}, at::kDouble);
  for (int64_t b = 0; b < vocab; b += step) {
    const int64_t m = std::min(step, vocab - b);
    QCAL_ASSIGN_OR_RETURN(at::Tensor w, HeadChunk(b, m));
    const at::Tensor lq = at::matmul(ud, w.t()) - lse.unsqueeze(1);
    at::Tensor p = at::exp(lq);
    if (kl) {
      const at::Tensor lf = at::matmul(uf, w.t()) - lse_f.unsqueeze(1);
      const at::Tensor pf = at::exp(lf);
      kl_sum.add_((pf * (lf - lq)).sum(1).to(at::kDouble));
      if (grad_u == nullptr) continue;
      p.sub_(pf);
    } else {
      const at::Tensor in = (targets >= b).logical_and(targets < b + m);
      const at::Tensor rows = at::nonzero(in).view({-1});
      if (rows.numel() > 0) {
        const at::Tensor cols = targets.index({rows}) - b;
        p.index_put_({rows, cols}, p.index({rows, cols}) - 1.0);
      }
    }
    grad_u->add_(at::matmul(p, w));
  }
  if (grad_u != nullptr) grad_u->div_(static_cast<double>(n));
  return kl ? kl_sum.mean().item<double>() : (lse - target_logit).mean().item<double>();
}

StatusOr<std::vector<double>> RotationGradients::Losses(const at::Tensor& r1,
                                                        const at::Tensor& r2,
                                                        const at::Tensor& tokens,
                                                        const RotationTrainingOptions& options,
                                                        const at::Tensor& smooth) {
  const LlamaConfig& c = source_->config();
  const int64_t layers = c.num_hidden_layers, hid = c.hidden_size;
  if (tokens.dim() != 2 || tokens.size(1) < 2) {
    return absl::InvalidArgumentError("rotation training: tokens must be [m, s >= 2]");
  }
  const int64_t m = tokens.size(0), s = tokens.size(1), n = s - 1;
  const bool kl = options.loss == RotationTrainingOptions::Loss::kKlToFloat;
  const model::Rope& rope = source_->rope();
  std::vector<double> losses(m);
  try {
    at::NoGradGuard no_grad;
    const at::Tensor t1 = r1.t().to(at::kFloat);
    const RotationTrainingOptions fo = FloatOptions(options);
    const at::Tensor eye1 = at::eye(hid, at::kFloat), eye2 = at::eye(c.head_dim, at::kFloat);
    std::vector<at::Tensor> h(m), hf(m);
    for (int64_t i = 0; i < m; ++i) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor e, source_->Embed(tokens[i].view({1, s})));
      e = e.to(at::kFloat);
      h[i] = at::matmul(e, t1.t());
      if (kl) hf[i] = e;
    }
    for (int64_t l = 0; l < layers; ++l) {
      QCAL_ASSIGN_OR_RETURN(auto f, Block(l));
      const at::Tensor t2 = r2[l].t().to(at::kFloat);
      const at::Tensor sl = smooth.defined() ? smooth[l].to(at::kFloat) : at::Tensor();
      std::vector<at::Tensor> offsets;  // these options' weight offsets, once for the block
      for (int64_t i = 0; i < m; ++i) {
        h[i] = RotatedBlockForward(*f, c, rope, t1, t2, t4_, r3_, options, h[i], &offsets, sl);
        if (kl) hf[i] = RotatedBlockForward(*f, c, rope, eye1, eye2, t4_, r3_, fo, hf[i]);
      }
    }
    const at::Tensor ones = at::ones({hid}, at::kFloat);
    for (int64_t i = 0; i < m; ++i) {
      const at::Tensor u = at::matmul(model::RmsNorm(h[i], ones, c.rms_norm_eps), t1)
                               .narrow(1, 0, n)
                               .reshape({n, hid});
      at::Tensor uf;
      if (kl) uf = model::RmsNorm(hf[i], ones, c.rms_norm_eps).narrow(1, 0, n).reshape({n, hid});
      QCAL_ASSIGN_OR_RETURN(losses[i],
                            HeadLoss(u, uf, tokens[i].narrow(0, 1, n).to(at::kLong), kl, nullptr));
    }
  } catch (const std::exception& ex) {
    return absl::InternalError(absl::StrCat("rotation training (held-out loss): ", ex.what()));
  }
  return losses;
}

StatusOr<RotationGradients::Result> RotationGradients::Sequence(const at::Tensor& r1,
                                                                const at::Tensor& r2,
                                                                const at::Tensor& tokens,
                                                                const at::Tensor& smooth) {
  const LlamaConfig& c = source_->config();
  const int64_t layers = c.num_hidden_layers, hid = c.hidden_size;
  if (tokens.dim() != 1 || tokens.size(0) < 2) {
    return absl::InvalidArgumentError("rotation training: a sequence must be [s >= 2] tokens");
  }
  const int64_t s = tokens.size(0), n = s - 1;
  const model::Rope& rope = source_->rope();
  Result result;
  try {
    QCAL_ASSIGN_OR_RETURN(at::Tensor e, source_->Embed(tokens.view({1, s})));
    e = e.to(at::kFloat);
    // Forward, keeping each block's input.
    // With the KL loss, the float model's final states too (no rotations, nothing quantized).
    const bool kl = options_.loss == RotationTrainingOptions::Loss::kKlToFloat;
    std::vector<at::Tensor> hs(layers + 1);
    at::Tensor hf;
    {
      at::NoGradGuard no_grad;
      const at::Tensor t1 = r1.t().to(at::kFloat);
      const RotationTrainingOptions fo = FloatOptions(options_);
      const at::Tensor eye1 = at::eye(hid, at::kFloat), eye2 = at::eye(c.head_dim, at::kFloat);
      hs[0] = at::matmul(e, t1.t());
      if (kl) hf = e;
      for (int64_t l = 0; l < layers; ++l) {
        QCAL_ASSIGN_OR_RETURN(auto f, Block(l));
        hs[l + 1] = RotatedBlockForward(
            *f, c, rope, t1, r2[l].t().to(at::kFloat), t4_, r3_, options_, hs[l],
            StepOffsets(r1, r2, smooth, l),
            smooth.defined() ? smooth[l].to(at::kFloat) : at::Tensor());
        if (kl) hf = RotatedBlockForward(*f, c, rope, eye1, eye2, t4_, r3_, fo, hf);
      }
    }
    at::AutoGradMode grad_mode(true);
    const at::Tensor p1 = r1.detach().clone().requires_grad_(true);
    // The head: u = RMSNorm(h)·T1, logits = u·(H·diag(norm))ᵀ, the loss and d loss / d u in
    // vocabulary chunks (one when the head is cached): cross-entropy, softmax(logits) − onehot;
    // KL(float ‖ quantized), softmax(logits) − softmax(float logits).
    const at::Tensor hl = hs[layers].detach().requires_grad_(true);
    const at::Tensor u = at::matmul(
        model::RmsNorm(hl, at::ones({hid}, at::kFloat), c.rms_norm_eps), p1.t().to(at::kFloat));
    const at::Tensor un = u.narrow(1, 0, n).reshape({n, hid});
    const at::Tensor targets = tokens.narrow(0, 1, n).to(at::kLong);
    at::Tensor grad_u = at::zeros({n, hid}, at::kFloat);
    {
      at::NoGradGuard no_grad;
      at::Tensor uf;
      if (kl) {
        uf = model::RmsNorm(hf, at::ones({hid}, at::kFloat), c.rms_norm_eps)
                 .narrow(1, 0, n)
                 .reshape({n, hid});
      }
      QCAL_ASSIGN_OR_RETURN(result.loss, HeadLoss(un.detach(), uf, targets, kl, &grad_u));
    }
    un.backward(grad_u);
    at::Tensor g = hl.grad();
    hs[layers] = at::Tensor();
    result.g2 = at::zeros({layers, c.head_dim, c.head_dim}, at::kDouble);
    if (smooth.defined()) result.gs = at::zeros({layers, SmoothingSize(c)}, at::kDouble);
    for (int64_t l = layers - 1; l >= 0; --l) {
      QCAL_ASSIGN_OR_RETURN(auto f, Block(l));
      const at::Tensor x = hs[l].detach().requires_grad_(true);
      const at::Tensor p2 = r2[l].detach().clone().requires_grad_(true);
      at::Tensor ps;
      if (smooth.defined()) ps = smooth[l].detach().clone().requires_grad_(true);
      const at::Tensor out = RotatedBlockForward(
          *f, c, rope, p1.t().to(at::kFloat), p2.t().to(at::kFloat), t4_, r3_, options_, x,
          StepOffsets(r1, r2, smooth, l), ps.defined() ? ps.to(at::kFloat) : at::Tensor());
      out.backward(g);
      g = x.grad();
      result.g2[l].copy_(p2.grad());
      if (ps.defined()) result.gs[l].copy_(ps.grad());
      hs[l] = at::Tensor();
    }
    at::matmul(e, p1.to(at::kFloat)).backward(g);  // h0 = E·T1ᵀ = E·R1
    result.g1 = p1.grad().detach().clone();
  } catch (const std::exception& ex) {
    return absl::InternalError(absl::StrCat("rotation training: ", ex.what()));
  }
  return result;
}

}  // namespace qcal::methods::spinquant
