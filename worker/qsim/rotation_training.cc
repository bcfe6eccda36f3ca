#include "worker/qsim/rotation_training.h"

#include <ATen/ATen.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/qsim/act_quant.h"

namespace qcal::qsim {
namespace {

using model::LinearKind;

// Per-row (last dim) asymmetric fake quantization with an identity backward (SpinQuant's STE).
at::Tensor SteAsym(const at::Tensor& x, int bits) {
  if (bits >= 16) return x;
  const at::Tensor d = x.detach();
  const double qmax = static_cast<double>((int64_t{1} << bits) - 1);
  const at::Tensor lo = std::get<0>(d.min(-1, true)).clamp_max(0);
  const at::Tensor hi = std::get<0>(d.max(-1, true)).clamp_min(0);
  const at::Tensor s = ((hi - lo) / qmax).clamp_min(1e-8);
  const at::Tensor z = at::round(-lo / s);
  const at::Tensor q = (at::clamp(at::round(d / s) + z, 0.0, qmax) - z) * s;
  return x + (q - d);  // q's value, x's gradient (q - d carries none)
}

// Per-output-channel symmetric RTN with an identity backward.
at::Tensor SteWeight(const at::Tensor& w, int bits) {
  if (bits >= 16) return w;
  const at::Tensor d = w.detach();
  const double qmax = static_cast<double>((int64_t{1} << (bits - 1)) - 1);
  const at::Tensor s = (d.abs().amax(1, true) / qmax).clamp_min(1e-8);
  const at::Tensor q = at::clamp(at::round(d / s), -qmax - 1, qmax) * s;
  return w + (q - d);
}

// x → (R4) → per-token fake quantization → x·Wᵀ.
class TrainLinear final : public model::Linear {
 public:
  TrainLinear(at::Tensor w, std::shared_ptr<const OnlineHadamard> r4, int act_bits)
      : w_(std::move(w)), r4_(std::move(r4)), act_bits_(act_bits) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    const at::Tensor h = r4_ ? r4_->ApplyDifferentiable(x) : x;
    return at::matmul(SteAsym(h, act_bits_), w_.t());
  }
  int64_t in_features() const override { return w_.size(1); }
  int64_t out_features() const override { return w_.size(0); }
  at::Tensor DenseWeight() const override { return w_.detach(); }

 private:
  at::Tensor w_;
  std::shared_ptr<const OnlineHadamard> r4_;
  int act_bits_;
};

// K and V per token and head, asymmetric, identity backward; queries pass.
class TrainKvHook final : public model::KvCacheHook {
 public:
  explicit TrainKvHook(int bits) : bits_(bits) {}
  at::Tensor Apply(const at::Tensor& x, model::KvRole role) const override {
    return role == model::KvRole::kQuery ? x : SteAsym(x, bits_);
  }
  std::string Describe() const override { return absl::StrCat("int", bits_, " asym per token/head (STE)"); }

 private:
  int bits_;
};

}  // namespace

StatusOr<at::Tensor> RotatedQuantizedLoss(const model::LlamaModel& m, const RotationPlan& plan,
                                          const at::Tensor& t1d, const at::Tensor& t2d,
                                          const at::Tensor& tokens,
                                          const RotationTrainingOptions& o) {
  const LlamaConfig& c = m.config();
  const int64_t hid = c.hidden_size, d = c.head_dim, kv = c.num_key_value_heads;
  const int64_t heads = c.num_attention_heads;
  if (!plan.r1 || !plan.r2) {
    return absl::InvalidArgumentError("rotation training needs a plan with R1 and R2");
  }
  if (tokens.dim() != 2 || tokens.size(1) < 2) {
    return absl::InvalidArgumentError("rotation training: tokens must be [b, s >= 2]");
  }
  std::shared_ptr<const OnlineHadamard> t4;
  at::Tensor r3;
  if (plan.r4) {
    QCAL_ASSIGN_OR_RETURN(t4, OnlineHadamard::Create(plan.intermediate));
  }
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto h3, OnlineHadamard::Create(plan.head_dim));
    r3 = h3->transposed_matrix();
  }
  const at::Tensor t1 = t1d.to(at::kFloat);
  const at::Tensor t2 = t2d.to(at::kFloat);
  at::Tensor h = at::matmul(m.Embed(tokens), t1.t());
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    const model::BlockWeights& src = m.block(l).weights();
    auto fused = [&](LinearKind k, const at::Tensor& norm) {
      return src.linear(k).DenseWeight().to(at::kFloat) * norm.to(at::kFloat);
    };
    at::Tensor w[7];
    const int Q = 0, K = 1, V = 2, O = 3, G = 4, U = 5, D = 6;
    w[Q] = at::matmul(fused(LinearKind::kQ, src.input_norm), t1.t());
    w[K] = at::matmul(fused(LinearKind::kK, src.input_norm), t1.t());
    w[V] = at::matmul(t2[l], at::matmul(fused(LinearKind::kV, src.input_norm), t1.t())
                                 .view({kv, d, hid}))
               .reshape({kv * d, hid});
    w[G] = at::matmul(fused(LinearKind::kGate, src.post_norm), t1.t());
    w[U] = at::matmul(fused(LinearKind::kUp, src.post_norm), t1.t());
    const at::Tensor wo = at::matmul(t1, src.linear(LinearKind::kO).DenseWeight().to(at::kFloat));
    w[O] = at::matmul(wo.view({hid, heads, d}), t2[l].t()).reshape({hid, heads * d});
    at::Tensor wd = src.linear(LinearKind::kDown).DenseWeight().to(at::kFloat);
    if (t4) {
      QCAL_ASSIGN_OR_RETURN(wd, FuseInputHadamard(wd, *t4));
    }
    w[D] = at::matmul(t1, wd);
    model::BlockWeights bw;
    bw.input_norm = at::ones({hid}, at::kFloat);
    bw.post_norm = at::ones({hid}, at::kFloat);
    for (LinearKind k : model::kAllLinears) {
      const int j = static_cast<int>(k);
      bw.linears[j] = std::make_unique<TrainLinear>(SteWeight(w[j], o.weight_bits),
                                                    k == LinearKind::kDown ? t4 : nullptr,
                                                    o.act_bits);
    }
    model::DecoderBlock block(c, std::move(bw));
    model::BlockHooks hooks;
    if (plan.r3) hooks.qk_rotation = r3;
    if (o.kv_bits < 16) hooks.kv_cache = std::make_shared<TrainKvHook>(o.kv_bits);
    block.set_hooks(std::move(hooks));
    h = block.Forward(h, m.rope());
  }
  const at::Tensor head = m.head().DenseWeight().to(at::kFloat) * m.final_norm().to(at::kFloat);
  const at::Tensor normed = model::RmsNorm(h, at::ones({hid}, at::kFloat), c.rms_norm_eps);
  const int64_t s = tokens.size(1);
  const at::Tensor logits =
      at::matmul(normed.narrow(1, 0, s - 1), at::matmul(head, t1.t()).t());  // [b, s-1, V]
  const at::Tensor targets = tokens.narrow(1, 1, s - 1).reshape({-1});
  return at::nll_loss(at::log_softmax(logits.reshape({-1, logits.size(-1)}), -1), targets);
}

StatusOr<RotationTrainingResult> TrainRotations(const model::LlamaModel& m,
                                                const RotationPlan& plan, const at::Tensor& tokens,
                                                const RotationTrainingOptions& o) {
  if (tokens.dim() != 2 || tokens.size(0) < 1) {
    return absl::InvalidArgumentError("rotation training: no calibration tokens");
  }
  if (o.steps < 1 || o.batch < 1 || !(o.lr > 0)) {
    return absl::InvalidArgumentError("rotation training: steps, batch and lr must be positive");
  }
  const int64_t layers = m.num_blocks();
  QCAL_ASSIGN_OR_RETURN(auto init, DenseRotations(plan, layers));
  // Cayley SGD runs on R = Tᵀ, the matrix the weights' input sides multiply by (W·R), as the
  // reference trains it.
  at::Tensor r1 = init.first.t().contiguous();
  at::Tensor r2 = init.second.transpose(1, 2).contiguous();
  RotationTrainingResult result;
  const int64_t n = tokens.size(0);
  try {
    for (int64_t t = 0; t < o.steps; ++t) {
      std::vector<int64_t> idx;
      for (int64_t i = 0; i < o.batch; ++i) idx.push_back((t * o.batch + i) % n);
      const at::Tensor batch =
          tokens.index_select(0, at::tensor(idx, at::kLong));
      const at::Tensor p1 = r1.clone().requires_grad_(true);
      const at::Tensor p2 = r2.clone().requires_grad_(true);
      at::Tensor loss;
      {
        at::AutoGradMode grad(true);
        QCAL_ASSIGN_OR_RETURN(loss, RotatedQuantizedLoss(m, plan, p1.t(), p2.transpose(1, 2),
                                                         batch, o));
        loss.backward();
      }
      result.losses.push_back(loss.item<double>());
      at::Tensor g1 = p1.grad(), g2 = p2.grad();
      if (o.grad_clip > 0) {
        const double norm = std::sqrt(g1.pow(2).sum().item<double>() + g2.pow(2).sum().item<double>());
        if (norm > o.grad_clip) {
          g1 = g1 * (o.grad_clip / norm);
          g2 = g2 * (o.grad_clip / norm);
        }
      }
      const double lr = o.lr * 0.5 * (1 + std::cos(M_PI * static_cast<double>(t) / o.steps));
      r1 = CayleyStep(r1, g1, lr, QrRetractionStep(o.seed, t, 0, o.cayley.qr_period), o.cayley);
      std::vector<at::Tensor> next;
      for (int64_t l = 0; l < layers; ++l) {
        next.push_back(CayleyStep(r2[l], g2[l], lr,
                                  QrRetractionStep(o.seed, t, 1 + l, o.cayley.qr_period),
                                  o.cayley));
      }
      r2 = at::stack(next, 0);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rotation training: ", e.what()));
  }
  result.t1 = r1.t().contiguous();
  result.t2 = r2.transpose(1, 2).contiguous();
  return result;
}

}  // namespace qcal::qsim
