#include "engine/model/llama.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu.h"
#include "common/dtype.h"
#include "engine/model/block_select.h"
#include "engine/model/tensor_io.h"
#include "kernels/blas_threads.h"

namespace qcal::model {

DenseLinear::DenseLinear(at::Tensor weight) : weight_(weight.contiguous()) {}

at::Tensor DenseLinear::Forward(const at::Tensor& x) const { return LinearRows(x, weight_); }

at::Tensor LinearRows(const at::Tensor& x, const at::Tensor& weight) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    return at::matmul(x, weight.t());  // autograd's own GEMMs, each on one BLAS thread
  }
  const int64_t in = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, in}).contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = weight.size(0);
  // (A shape mismatch is reported by at::mm on the calling thread.)
  // One GEMM on a device (its library splits the work), or for a small input.
  if (rows <= kLinearChunkRows || weight.dim() != 2 || weight.size(1) != in ||
      !x2.device().is_cpu()) {
    return at::mm(x2, weight.t()).view(out_sizes);
  }
  at::Tensor out = at::empty({rows, weight.size(0)}, x2.options());
  const at::Tensor wt = weight.t();
  const int64_t chunks = (rows + kLinearChunkRows - 1) / kLinearChunkRows;
  // Chunks on qcal's threads, one single-threaded BLAS GEMM each. (qcal's TUs are not compiled
  // with OpenMP, so an at::parallel_for here ran every chunk on the calling thread.)
  qcal::ParallelTasks(chunks, at::get_num_threads(), [&](int64_t c) {
    // Grad mode is thread-local: a caller without autograd (a NoGradGuard while a weight requires
    // grad, as fine-tuning's held-out passes are) must not meet mm_out's autograd check here.
    at::NoGradGuard no_grad;
    const int64_t r0 = c * kLinearChunkRows;
    const int64_t n = std::min(kLinearChunkRows, rows - r0);
    at::Tensor dst = out.narrow(0, r0, n);
    at::mm_out(dst, x2.narrow(0, r0, n), wt);
  });
  return out.view(out_sizes);
}

StatusOr<at::Device> ResolveTorchDevice(const std::string& requested) {
  const bool cuda = at::hasCUDA();
  if (requested == "cpu" || (requested == "auto" && !cuda)) return at::Device(at::kCPU);
  if (requested == "auto") return at::Device(at::kCUDA, 0);
  int index = 0;
  if (requested != "cuda" &&
      !(requested.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(requested.substr(5), &index) &&
        index >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device: '", requested, "' is not one of auto, cpu, cuda, cuda:N"));
  }
  if (!cuda) {
    return absl::UnavailableError(absl::StrCat(
        "--device ", requested, ": this build's LibTorch has no CUDA (Debian's LibTorch 1.13 is "
        "CPU-only; build against a CUDA LibTorch: docs/getting-started.md)"));
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

double SumToDouble(const at::Tensor& t) {
  // On a device the chunk sums run there and only they come to the host (one copy per call).
  const bool host = t.device().is_cpu();
  const at::Tensor flat = t.reshape({-1}).to(at::kDouble).contiguous();
  const int64_t n = flat.numel();
  constexpr int64_t kChunk = 4096;
  const int64_t full = n / kChunk;
  double sum = 0;
  if (full > 0) {
    // One partial sum per fixed 4096-element chunk: LibTorch reduces each row with the same
    // arithmetic whichever thread takes it, where a whole-tensor sum() splits the elements by
    // the thread count.
    const at::Tensor partial = flat.narrow(0, 0, full * kChunk).view({full, kChunk}).sum(1)
                                   .to(at::kCPU).contiguous();
    const double* p = partial.data_ptr<double>();
    for (int64_t i = 0; i < full; ++i) sum += p[i];
  }
  const at::Tensor tail =
      host ? flat : flat.narrow(0, full * kChunk, n - full * kChunk).to(at::kCPU).contiguous();
  const double* rest = tail.data_ptr<double>() + (host ? full * kChunk : 0);
  for (int64_t i = 0; i < n - full * kChunk; ++i) sum += rest[i];
  return sum;
}
Status Linear::AppendTensors(const std::string& prefix, SafetensorsWriter*) const {
  return absl::UnimplementedError(
      absl::StrCat(prefix, ": this layer has no stored format (", layer_format() ? layer_format() : "none",
                   ")"));
}

Status Linear::MoveTo(const at::Device& device) {
  return absl::UnimplementedError(absl::StrCat("this layer (format ",
                                               layer_format() ? layer_format() : "none",
                                               ") cannot move to ", device.str()));
}

Status DenseLinear::MoveTo(const at::Device& device) {
  if (weight_.device() != device) weight_ = weight_.to(device);
  return Status();
}

Status DenseLinear::AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const {
  return AddF32Tensor(writer, prefix + ".weight", weight_);
}

WidenedLinear::WidenedLinear(at::Tensor weight) : weight_(weight.contiguous()) {
  TORCH_CHECK(weight_.scalar_type() == at::kBFloat16 || weight_.scalar_type() == at::kHalf,
              "WidenedLinear holds a BF16 or F16 weight");
}
at::Tensor WidenedLinear::Forward(const at::Tensor& x) const {
  return LinearRows(x, DenseWeight());
}
at::Tensor WidenedLinear::DenseWeight() const { return weight_.to(at::kFloat).contiguous(); }

int64_t DenseLinear::in_features() const { return weight_.size(1); }
int64_t DenseLinear::out_features() const { return weight_.size(0); }

const char* KvRoleName(KvRole role) {
  switch (role) {
    case KvRole::kKey: return "key";
    case KvRole::kValue: return "value";
    case KvRole::kQuery: return "query";
  }
  return "?";
}

const char* LinearName(LinearKind kind) {
  switch (kind) {
    case LinearKind::kQ: return "self_attn.q_proj";
    case LinearKind::kK: return "self_attn.k_proj";
    case LinearKind::kV: return "self_attn.v_proj";
    case LinearKind::kO: return "self_attn.o_proj";
    case LinearKind::kGate: return "mlp.gate_proj";
    case LinearKind::kUp: return "mlp.up_proj";
    case LinearKind::kDown: return "mlp.down_proj";
  }
  return "?";
}

// [s, o + s] bool: true where query i (at position o + i, behind o prefix entries) may not read
// key j, i.e. j > o + i (future positions). Cached per length, prefix length and device.
at::Tensor CausalMask(int64_t s, int64_t o, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, std::string>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& mask = cache[{s, o, device.str()}];
  if (!mask.defined()) {
    mask = at::ones({s, o + s}, at::TensorOptions().dtype(at::kBool).device(device)).triu(o + 1);
  }
  return mask;
}

// CausalMask, and true too where key j and query i are in different chunks of `chunk` positions
// (Llama 4's chunked attention).
at::Tensor ChunkedMask(int64_t s, int64_t o, int64_t chunk, const at::Device& device) {
  const at::Tensor qpos = at::arange(o, o + s, at::kLong).div(chunk, "floor").unsqueeze(1);
  const at::Tensor kpos = at::arange(0, o + s, at::kLong).div(chunk, "floor").unsqueeze(0);
  return (CausalMask(s, o, at::Device(at::kCPU)) | qpos.ne(kpos)).to(device);
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor var = x.pow(2).mean(-1, /*keepdim=*/true);
  return x * at::rsqrt(var + eps) * weight;
}

Rope::Rope(int64_t head_dim, double theta, int64_t max_positions, const RopeScaling& scaling,
           bool interleaved)
    : max_positions_(std::min(max_positions, kMaxRopePositions + kMaxPrefixTokens)),
      interleaved_(interleaved) {
  // Computed in double, stored in float: matches references that build the tables in float64.
  const int64_t half = head_dim / 2;
  at::Tensor inv_freq = at::empty({half}, at::kDouble);
  auto inv = inv_freq.accessor<double, 1>();
  for (int64_t i = 0; i < half; ++i) inv[i] = std::pow(theta, -2.0 * i / head_dim);
  if (scaling.type == RopeScaling::Type::kLinear) {
    for (int64_t i = 0; i < half; ++i) inv[i] /= scaling.factor;
  } else if (scaling.type == RopeScaling::Type::kLlama3) {
    // Hugging Face's _compute_llama3_parameters.
    const double original = static_cast<double>(scaling.original_max_position_embeddings);
    const double low_freq_wavelen = original / scaling.low_freq_factor;
    const double high_freq_wavelen = original / scaling.high_freq_factor;
    for (int64_t i = 0; i < half; ++i) {
      const double wavelen = 2.0 * M_PI / inv[i];
      if (wavelen > low_freq_wavelen) {
        inv[i] /= scaling.factor;
      } else if (wavelen >= high_freq_wavelen && scaling.high_freq_factor > scaling.low_freq_factor) {
        const double smooth = (original / wavelen - scaling.low_freq_factor) /
                              (scaling.high_freq_factor - scaling.low_freq_factor);
        inv[i] = (1.0 - smooth) * inv[i] / scaling.factor + smooth * inv[i];
      }
    }
  }
  at::Tensor pos = at::arange(max_positions_, at::kDouble);
  at::Tensor freqs = at::outer(pos, inv_freq);     // [P, half]
  // [P, head_dim]: frequency i at channels i and i + half, or (interleaved) at 2i and 2i + 1.
  at::Tensor emb = interleaved ? freqs.repeat_interleave(2, -1) : at::cat({freqs, freqs}, -1);
  cos_ = emb.cos().to(at::kFloat);
  sin_ = emb.sin().to(at::kFloat);
}

at::Tensor Rope::Apply(const at::Tensor& x, int64_t offset) const {
  const int64_t seq = x.size(2);
  const int64_t half = x.size(3) / 2;
  at::Tensor cos = cos_.narrow(0, offset, seq).to(x.device());
  at::Tensor sin = sin_.narrow(0, offset, seq).to(x.device());
  if (interleaved_) {  // rotated[2i] = -x[2i+1], rotated[2i+1] = x[2i]
    const at::Tensor pairs = x.reshape({-1, 2});
    const at::Tensor rotated =
        at::stack({-pairs.select(1, 1), pairs.select(1, 0)}, 1).view(x.sizes());
    return x * cos + rotated * sin;
  }
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

at::Tensor Rope::Apply(const at::Tensor& x, const at::Tensor& perm, int64_t offset) const {
  if (!perm.defined()) return Apply(x, offset);
  TORCH_CHECK(!interleaved_, "K-sorted channels assume half-split RoPE pairs");
  const int64_t heads = x.size(1), seq = x.size(2), d = x.size(3), half = d / 2;
  const at::Tensor p = perm.to(x.device(), at::kLong);
  // cos/sin [heads, seq, d]: the column of channel j is that of its half-split channel p[h][j].
  at::Tensor cos = cos_.narrow(0, offset, seq).to(x.device()).index_select(1, p.reshape(-1))
                       .view({seq, heads, d}).transpose(0, 1);
  at::Tensor sin = sin_.narrow(0, offset, seq).to(x.device()).index_select(1, p.reshape(-1))
                       .view({seq, heads, d}).transpose(0, 1);
  // rotate_half in the half-split layout: rot[c] = -x[c + half] (c < half), x[c - half] (c >=
  // half); here read through the permutation.
  at::Tensor inv = at::empty_like(p).scatter_(1, p, at::arange(d, p.options()).expand({heads, d}));
  at::Tensor partner = inv.gather(1, (p + half).remainder(d));  // new index of the partner
  at::Tensor sign = (p < half).to(x.scalar_type()) * -2 + 1;     // -1 for c < half, else +1
  at::Tensor rotated = x.gather(3, partner.view({1, heads, 1, d}).expand_as(x).contiguous()) *
                       sign.view({1, heads, 1, d});
  return x * cos + rotated * sin;
}

DecoderBlock::DecoderBlock(const LlamaConfig& config, BlockWeights weights)
    : heads_(config.num_attention_heads),
      kv_heads_(config.num_key_value_heads),
      head_dim_(config.head_dim),
      eps_(config.rms_norm_eps),
      weights_(std::move(weights)) {
  const int64_t layer = weights_.layer;
  rope_ = config.UsesRope(layer);
  qk_norm_ = rope_ && config.use_qk_norm;
  temperature_ = !rope_ && config.attn_temperature_tuning;
  floor_scale_ = config.floor_scale;
  attn_scale_ = config.attn_scale;
  chunk_ = rope_ ? config.attention_chunk_size : 0;
  router_ = config.router;
  top_k_ = config.experts_per_token;
}

namespace {
// Llama 4's L2 norm of each head (no weight).
at::Tensor HeadNorm(const at::Tensor& x, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
}
}  // namespace

void DecoderBlock::Project(const at::Tensor& h, const Rope& rope, int64_t offset, at::Tensor* q_out,
                           at::Tensor* k_out, at::Tensor* v_out) const {
  const int64_t b = h.size(0), s = h.size(1);
  const int64_t rep = heads_ / kv_heads_;
  // The 1/sqrt(d) scale is folded into q (a [b, s, H·d] tensor) rather than applied to the
  // [b, H, s, s] scores: attention on CPU is bound by passes over the score tensor. With
  // qk-norm it follows the norm.
  const double scale = 1.0 / std::sqrt(double(head_dim_));
  at::Tensor q = weights_.linear(LinearKind::kQ).Forward(h);
  if (!qk_norm_) q = q * scale;
  at::Tensor k = weights_.linear(LinearKind::kK).Forward(h);
  at::Tensor v = weights_.linear(LinearKind::kV).Forward(h);
  if (!rope_) {  // a NoPE layer (Llama 4)
    q = q.view({b, s, heads_, head_dim_}).transpose(1, 2);
    k = k.view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
    if (temperature_) {  // log1p(⌊(pos + 1) / floor_scale⌋) · attn_scale + 1 per position
      at::Tensor t = at::arange(offset + 1, offset + s + 1, at::kDouble);
      t = (at::log1p(at::floor(t / floor_scale_)) * attn_scale_ + 1.0).to(at::kFloat);
      q = q * t.to(q.device()).view({1, 1, s, 1});
    }
  } else if (!weights_.rope_perm.defined()) {
    q = rope.Apply(q.view({b, s, heads_, head_dim_}).transpose(1, 2), offset);     // [b, H, s, d]
    k = rope.Apply(k.view({b, s, kv_heads_, head_dim_}).transpose(1, 2), offset);  // [b, KV, s, d]
  } else {  // K-sorted channels (engine/qsim/ksort.h)
    const at::Tensor& kp = weights_.rope_perm;
    q = rope.Apply(q.view({b, s, heads_, head_dim_}).transpose(1, 2), kp.repeat_interleave(rep, 0),
                   offset);
    k = rope.Apply(k.view({b, s, kv_heads_, head_dim_}).transpose(1, 2), kp, offset);
  }
  if (qk_norm_) {
    q = HeadNorm(q, eps_) * scale;
    k = HeadNorm(k, eps_);
  }
  v = v.view({b, s, kv_heads_, head_dim_}).transpose(1, 2);              // [b, KV, s, d]
  if (hooks_.qk_rotation.defined()) {  // QuaRot R3, after RoPE; cancels in q·kᵀ
    const at::Tensor m = hooks_.qk_rotation.to(q.device());
    q = at::matmul(q, m);
    k = at::matmul(k, m);
  }
  *q_out = std::move(q);
  *k_out = std::move(k);
  *v_out = std::move(v);
}

std::pair<at::Tensor, at::Tensor> DecoderBlock::KeysValues(const at::Tensor& x, const Rope& rope,
                                                           int64_t offset) const {
  at::Tensor q, k, v;
  Project(RmsNorm(x, weights_.input_norm, eps_), rope, offset, &q, &k, &v);
  return {k, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecoderBlock::Projections(const at::Tensor& x,
                                                                         const Rope& rope,
                                                                         int64_t offset) const {
  at::Tensor q, k, v;
  Project(RmsNorm(x, weights_.input_norm, eps_), rope, offset, &q, &k, &v);
  return {q, k, v};
}

at::Tensor DecoderBlock::Attention(const at::Tensor& h, const Rope& rope) const {
  const int64_t b = h.size(0), s = h.size(1);
  const int64_t rep = heads_ / kv_heads_;
  const PrefixKv* prefix = hooks_.prefix.get();
  const int64_t o = prefix != nullptr ? prefix->length() : 0;
  at::Tensor q, k, v;
  Project(h, rope, o, &q, &k, &v);
  if (hooks_.kv_cache) {  // what attention reads back from a quantized cache
    q = hooks_.kv_cache->Apply(q, KvRole::kQuery);
    k = hooks_.kv_cache->Apply(k, KvRole::kKey);
    v = hooks_.kv_cache->Apply(v, KvRole::kValue);
  }
  if (o > 0) {  // the prefix's full-precision entries in front of the sequence's own
    k = at::cat({prefix->k.to(k.device()).unsqueeze(0).expand({b, kv_heads_, o, head_dim_}), k}, 2);
    v = at::cat({prefix->v.to(v.device()).unsqueeze(0).expand({b, kv_heads_, o, head_dim_}), v}, 2);
  }
  // Grouped-query attention without copying K/V: query heads h = g·rep + r share KV head g, so
  // view q as [b, KV, rep·s, d] and attend each group against its one K/V.
  q = q.reshape({b, kv_heads_, rep * s, head_dim_});
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).view({b, kv_heads_, rep, s, o + s});
  scores.masked_fill_(chunk_ > 0 && o + s > chunk_ ? ChunkedMask(s, o, chunk_, h.device())
                                                   : CausalMask(s, o, h.device()),
                      -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores.view({b, kv_heads_, rep * s, o + s}), -1);
  at::Tensor out = at::matmul(probs, v)                         // [b, KV, rep·s, d]
                       .view({b, heads_, s, head_dim_})
                       .transpose(1, 2)
                       .reshape({b, s, heads_ * head_dim_});
  return weights_.linear(LinearKind::kO).Forward(out);
}

at::Tensor DecoderBlock::Mlp(const at::Tensor& h) const {
  at::Tensor gate = weights_.linear(LinearKind::kGate).Forward(h);
  at::Tensor up = weights_.linear(LinearKind::kUp).Forward(h);
  return weights_.linear(LinearKind::kDown).Forward(at::silu(gate) * up);
}

Routing DecoderBlock::Route(const at::Tensor& h) const {
  const at::Tensor x = h.reshape({-1, h.size(-1)});
  const at::Tensor logits = LinearRows(x, weights_.moe->router.to(x.device()));  // [n, E]
  Routing r;
  if (router_ == RouterKind::kSoftmaxTopK) {  // Mixtral: softmax, top k, renormalized
    auto [p, e] = at::softmax(logits, -1).topk(top_k_, -1, /*largest=*/true, /*sorted=*/true);
    r.weights = p / p.sum(-1, /*keepdim=*/true);
    r.experts = e;
  } else {  // Llama 4: the top k logits through a sigmoid
    auto [l, e] = logits.topk(top_k_, -1, /*largest=*/true, /*sorted=*/true);
    r.weights = at::sigmoid(l);
    r.experts = e;
  }
  return r;
}

at::Tensor ExpertForward(const ExpertWeights& ex, const at::Tensor& x) {
  return ex.linear(ExpertLinear::kDown)
      .Forward(at::silu(ex.linear(ExpertLinear::kGate).Forward(x)) *
               ex.linear(ExpertLinear::kUp).Forward(x));
}

at::Tensor DecoderBlock::RoutedExperts(const at::Tensor& h, const Routing& routing,
                                       const ExpertInputFn& expert_inputs) const {
  const at::Tensor x = h.reshape({-1, h.size(-1)});
  at::Tensor out = at::zeros_like(x);
  const int64_t experts = static_cast<int64_t>(weights_.moe->experts.size());
  // Tokens per expert from one host copy of the routing (no per-expert device sync).
  const at::Tensor chosen = routing.experts.to(at::kCPU).contiguous();
  const int64_t n = chosen.size(0), k = chosen.size(1);
  const int64_t* c = chosen.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(experts), slots(experts);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = c[t * k + j];
      TORCH_CHECK(e >= 0 && e < experts, "block ", weights_.layer, ": the router chose expert ", e,
                  ", outside the block's ", experts, " experts");
      rows[e].push_back(t);
      slots[e].push_back(t * k + j);
    }
  }
  const at::Tensor flat_weights = routing.weights.reshape({-1});
  // Expert e's token rows (a copy of the index list: the callback may keep it), its routing
  // weights [m, 1] and the input its gate/up read (Llama 4's scaled by the weights).
  auto input_of = [&](int64_t e, at::Tensor* idx, at::Tensor* w) {
    *idx = at::tensor(rows[e], at::kLong).to(x.device());
    const at::Tensor slot = at::tensor(slots[e], at::kLong).to(x.device());
    *w = flat_weights.index_select(0, slot).unsqueeze(1);
    at::Tensor in = x.index_select(0, *idx);
    if (router_ == RouterKind::kSigmoidTopKInput) in = in * *w;
    if (expert_inputs) expert_inputs(e, *idx, in);
    return in;
  };
  // Expert e's output y on its rows, added in expert order.
  auto combine = [&](const at::Tensor& idx, const at::Tensor& w, at::Tensor y) {
    if (router_ == RouterKind::kSoftmaxTopK) y = y * w;
    out.index_add_(0, idx, y);  // each row once per expert: the sum runs in expert order
  };
  if (!hooks_.run_experts) {
    // One expert at a time: only its input and output are held.
    for (int64_t e = 0; e < experts; ++e) {
      if (rows[e].empty()) continue;
      at::Tensor idx, w;
      const at::Tensor in = input_of(e, &idx, &w);
      combine(idx, w, ExpertForward(weights_.moe->experts[e], in));
    }
    return out.view(h.sizes());
  }
  // The experts run elsewhere (BlockHooks::run_experts): every input first, then the outputs
  // combined in the same order.
  ExpertCall call;
  call.h = h;
  call.rows.resize(experts);
  call.inputs.resize(experts);
  std::vector<at::Tensor> weights(experts);
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[e].empty()) continue;
    call.inputs[e] = input_of(e, &call.rows[e], &weights[e]);
  }
  const std::vector<at::Tensor> outputs = hooks_.run_experts(call);
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == experts, "block ", weights_.layer,
              ": the expert runner returned ", outputs.size(), " outputs for ", experts,
              " experts");
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[e].empty()) continue;
    TORCH_CHECK(outputs[e].defined() && outputs[e].sizes() == call.inputs[e].sizes(), "block ",
                weights_.layer, ": the expert runner's output for expert ", e,
                " does not match its input's shape");
    combine(call.rows[e], weights[e], outputs[e].to(x.device()));
  }
  return out.view(h.sizes());
}

at::Tensor DecoderBlock::FeedForward(const at::Tensor& h) const {
  if (!is_moe()) return Mlp(h);
  const Routing routing = Route(h);
  if (hooks_.on_routing) hooks_.on_routing(routing);
  at::Tensor routed = RoutedExperts(h, routing);
  // Llama 4 adds the routed sum to the shared expert's output.
  return weights_.has(LinearKind::kGate) ? Mlp(h) + routed : routed;
}

at::Tensor DecoderBlock::Forward(const at::Tensor& x, const Rope& rope) const {
  at::Tensor h = x + Attention(RmsNorm(x, weights_.input_norm, eps_), rope);
  return h + FeedForward(RmsNorm(h, weights_.post_norm, eps_));
}

StatusOr<at::Tensor> LoadTensorF32(CheckpointReader& ckpt, const std::string& name,
                                   const std::vector<int64_t>& expected_shape) {
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
  const TensorInfo& info = *found.second;
  if (info.shape != expected_shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(found.first->path(), ": tensor '", name, "' has shape [",
                     absl::StrJoin(info.shape, ", "), "], expected [",
                     absl::StrJoin(expected_shape, ", "), "] from config.json"));
  }
  // Converted straight into the tensor: one float32 copy, not two.
  at::Tensor t = at::empty(expected_shape, at::kFloat);
  QCAL_RETURN_IF_ERROR(found.first->ReadF32Into(name, t.data_ptr<float>(),
                                                static_cast<size_t>(t.numel())));
  QCAL_RETURN_IF_ERROR(CheckFinite(t, found.first->path(), name));
  return t;
}

// A NaN or infinite weight poisons every Hessian and output downstream, where the message could
// no longer say where it came from: name the file and the tensor here.
Status CheckFinite(const at::Tensor& t, const std::string& path, const std::string& name) {
  const float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(p[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  if (bad > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", name, "' has ", bad, " non-finite value(s) of ", n,
        " (the first, element ", first, ", is ", std::isnan(p[first]) ? "NaN" : "infinite",
        "): the checkpoint is damaged or was saved from a diverged model"));
  }
  return Status();
}

StatusOr<at::Tensor> LoadSlabF32(CheckpointReader& ckpt, const std::string& name,
                                 const std::vector<int64_t>& expected_shape, int64_t index) {
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
  const TensorInfo& info = *found.second;
  if (info.shape != expected_shape || !IsFloatingDType(info.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        found.first->path(), ": tensor '", name, "' is ", std::string(DTypeName(info.dtype)),
        " [", absl::StrJoin(info.shape, ", "), "], expected a floating [",
        absl::StrJoin(expected_shape, ", "), "] from config.json"));
  }
  const std::vector<int64_t> slab(expected_shape.begin() + 1, expected_shape.end());
  at::Tensor t = at::empty(slab, at::kFloat);
  const uint64_t bytes = static_cast<uint64_t>(t.numel()) * DTypeSize(info.dtype);
  ConvertToF32(info.dtype, found.first->Data(info) + index * bytes,
               static_cast<size_t>(t.numel()), t.data_ptr<float>());
  found.first->ReleasePages(info, index * bytes, (index + 1) * bytes);
  QCAL_RETURN_IF_ERROR(CheckFinite(t, found.first->path(), absl::StrCat(name, "[", index, "]")));
  return t;
}

std::vector<int64_t> LinearShape(const LlamaConfig& c, LinearKind kind) {
  return LinearShape(c, kind, -1);
}

std::vector<int64_t> LinearShape(const LlamaConfig& c, LinearKind kind, int64_t layer) {
  const int64_t hid = c.hidden_size;
  const int64_t inter = layer < 0 ? c.intermediate_size : c.MlpSize(layer);
  switch (kind) {
    case LinearKind::kQ: return {c.q_dim(), hid};
    case LinearKind::kK:
    case LinearKind::kV: return {c.kv_dim(), hid};
    case LinearKind::kO: return {hid, c.q_dim()};
    case LinearKind::kGate:
    case LinearKind::kUp: return {inter, hid};
    case LinearKind::kDown: return {hid, inter};
  }
  return {};
}

StatusOr<BlockWeights> LoadBlockWeights(CheckpointReader& ckpt, const LlamaConfig& c,
                                        int64_t layer) {
  return LoadBlockWeightsPart(ckpt, c, layer, BlockSelection());
}

StatusOr<BlockWeights> LoadBlockWeightsPart(CheckpointReader& ckpt, const LlamaConfig& c,
                                            int64_t layer, const BlockSelection& select) {
  if (layer < 0 || layer >= c.num_hidden_layers) {
    return absl::OutOfRangeError(absl::StrCat("block ", layer, " out of range [0, ",
                                              c.num_hidden_layers, ")"));
  }
  const std::string p = c.TensorName(absl::StrCat("model.layers.", layer, "."));
  const int64_t hid = c.hidden_size;
  const bool moe = c.IsMoeLayer(layer);
  const int64_t experts = moe ? c.num_experts : 0;
  const int64_t begin = select.expert_begin;
  const int64_t end = select.expert_end < 0 ? experts : select.expert_end;
  if (moe && (begin < 0 || begin > end || end > experts)) {
    return absl::OutOfRangeError(absl::StrCat("block ", layer, ": experts [", begin, ", ", end,
                                              ") out of range [0, ", experts, ")"));
  }
  BlockWeights w;
  w.layer = layer;
  if (select.dense) {
    QCAL_ASSIGN_OR_RETURN(w.input_norm, LoadTensorF32(ckpt, p + "input_layernorm.weight", {hid}));
    QCAL_ASSIGN_OR_RETURN(w.post_norm,
                          LoadTensorF32(ckpt, p + "post_attention_layernorm.weight", {hid}));
    for (LinearKind k : kAllLinears) {
      const int i = static_cast<int>(k);
      if (!BlockHasLinear(c, layer, k)) continue;  // Mixtral: no dense MLP beside the experts
      QCAL_ASSIGN_OR_RETURN(at::Tensor t,
                            LoadTensorF32(ckpt, LinearTensorName(c, layer, k) + ".weight",
                                          LinearShape(c, k, layer)));
      w.linears[i] = std::make_unique<DenseLinear>(std::move(t));
    }
  }
  if (!moe) return w;
  const int64_t inter = c.intermediate_size;
  w.moe = std::make_unique<MoeWeights>();
  w.moe->experts.resize(experts);
  // An expert linear from its float32 values, held as stored (`dtype`) when asked and 16-bit
  // (exact: the values are the stored ones).
  auto set = [&](int64_t e, ExpertLinear k, at::Tensor t, DType dtype) {
    std::unique_ptr<Linear>& slot = w.moe->experts[e].linears[static_cast<int>(k)];
    if (select.experts_as_stored && (dtype == DType::kBF16 || dtype == DType::kF16)) {
      slot = std::make_unique<WidenedLinear>(t.to(dtype == DType::kBF16 ? at::kBFloat16
                                                                         : at::kHalf));
    } else {
      slot = std::make_unique<DenseLinear>(std::move(t));
    }
  };
  auto stored_dtype = [&](const std::string& name) -> StatusOr<DType> {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
    return found.second->dtype;
  };
  if (select.dense) {
    QCAL_ASSIGN_OR_RETURN(w.moe->router, LoadTensorF32(ckpt, c.RouterModule(layer) + ".weight",
                                                       {experts, hid}));
  }
  if (c.family == ModelFamily::kMixtral) {
    for (int64_t e = begin; e < end; ++e) {
      for (ExpertLinear k : kExpertLinears) {
        const std::string name = ExpertTensorName(c, layer, e, k) + ".weight";
        QCAL_ASSIGN_OR_RETURN(at::Tensor t,
                              LoadTensorF32(ckpt, name, LinearShape(c, ExpertLinearKind(k))));
        QCAL_ASSIGN_OR_RETURN(const DType dtype, stored_dtype(name));
        set(e, k, std::move(t), dtype);
      }
    }
    return w;
  }
  // Llama 4: fused experts, gate_up_proj [E, hidden, 2·inter] (gate columns first) and
  // down_proj [E, inter, hidden] (x · W, not x · Wᵀ), split per expert as they are read.
  const std::string f = p + "feed_forward.";
  for (int64_t e = begin; e < end; ++e) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor gate_up, LoadSlabF32(ckpt, f + "experts.gate_up_proj",
                                                          {experts, hid, 2 * inter}, e));
    QCAL_ASSIGN_OR_RETURN(at::Tensor down, LoadSlabF32(ckpt, f + "experts.down_proj",
                                                       {experts, inter, hid}, e));
    QCAL_ASSIGN_OR_RETURN(const DType gate_up_dtype, stored_dtype(f + "experts.gate_up_proj"));
    QCAL_ASSIGN_OR_RETURN(const DType down_dtype, stored_dtype(f + "experts.down_proj"));
    set(e, ExpertLinear::kGate, gate_up.narrow(1, 0, inter).t().contiguous(), gate_up_dtype);
    set(e, ExpertLinear::kUp, gate_up.narrow(1, inter, inter).t().contiguous(), gate_up_dtype);
    set(e, ExpertLinear::kDown, down.t().contiguous(), down_dtype);
  }
  return w;
}

bool BlockHasLinear(const LlamaConfig& c, int64_t layer, LinearKind kind) {
  const bool mlp =
      kind == LinearKind::kGate || kind == LinearKind::kUp || kind == LinearKind::kDown;
  return !mlp || !c.IsMoeLayer(layer) || c.shared_expert;
}

LinearKind ExpertLinearKind(ExpertLinear k) {
  switch (k) {
    case ExpertLinear::kGate: return LinearKind::kGate;
    case ExpertLinear::kUp: return LinearKind::kUp;
    case ExpertLinear::kDown: return LinearKind::kDown;
  }
  return LinearKind::kGate;
}

std::string ExpertLinearName(int64_t expert, ExpertLinear k) {
  // "mlp.gate_proj" -> "gate_proj"
  return absl::StrCat("experts.", expert, ".",
                      std::string(LinearName(ExpertLinearKind(k))).substr(4));
}

std::string ExpertTensorName(const LlamaConfig& c, int64_t layer, int64_t expert,
                             ExpertLinear k) {
  const std::string p = c.TensorName(absl::StrCat("model.layers.", layer, "."));
  if (c.family == ModelFamily::kMixtral) {
    const char* w = k == ExpertLinear::kGate ? "w1" : k == ExpertLinear::kUp ? "w3" : "w2";
    return absl::StrCat(p, "block_sparse_moe.experts.", expert, ".", w);
  }
  return p + "feed_forward." + ExpertLinearName(expert, k);
}

std::string LinearTensorName(const LlamaConfig& c, int64_t layer, LinearKind kind) {
  const std::string p = c.TensorName(absl::StrCat("model.layers.", layer, "."));
  const bool mlp = kind == LinearKind::kGate || kind == LinearKind::kUp || kind == LinearKind::kDown;
  if (!mlp || c.family != ModelFamily::kLlama4) return p + LinearName(kind);
  // Llama 4: "feed_forward.<gate_proj|up_proj|down_proj>", the shared expert's in a MoE layer.
  const std::string name = std::string(LinearName(kind)).substr(4);  // without "mlp."
  return absl::StrCat(p, "feed_forward.", c.IsMoeLayer(layer) ? "shared_expert." : "", name);
}

LlamaModel::LlamaModel(LlamaConfig config, at::Tensor embed, std::vector<DecoderBlock> blocks,
                       at::Tensor final_norm, std::unique_ptr<Linear> head)
    : config_(std::move(config)),
      embed_(std::move(embed)),
      blocks_(std::move(blocks)),
      final_norm_(std::move(final_norm)),
      head_(std::move(head)),
      rope_(config_) {}

StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(dir));
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(dir));
  QCAL_ASSIGN_OR_RETURN(at::Tensor embed,
                        LoadTensorF32(*ckpt, config.TensorName("model.embed_tokens.weight"),
                                      {config.vocab_size, config.hidden_size}));
  std::vector<DecoderBlock> blocks;
  blocks.reserve(config.num_hidden_layers);
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    QCAL_ASSIGN_OR_RETURN(BlockWeights w, LoadBlockWeights(*ckpt, config, l));
    blocks.emplace_back(config, std::move(w));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor norm, LoadTensorF32(*ckpt, config.TensorName("model.norm.weight"),
                                                       {config.hidden_size}));
  at::Tensor head = embed;
  const std::string head_name = config.TensorName("lm_head.weight");
  if (!config.tie_word_embeddings || ckpt->Has(head_name)) {
    QCAL_ASSIGN_OR_RETURN(head, LoadTensorF32(*ckpt, head_name,
                                              {config.vocab_size, config.hidden_size}));
  }
  return std::make_unique<LlamaModel>(std::move(config), std::move(embed), std::move(blocks),
                                      std::move(norm), std::make_unique<DenseLinear>(head));
}

at::Tensor LlamaModel::Embed(const at::Tensor& ids) const {
  return at::embedding(embed_, ids.device() == embed_.device() ? ids : ids.to(embed_.device()));
}

Status DecoderBlock::MoveTo(const at::Device& device) {
  if (hooks_.kv_cache) {
    return absl::UnimplementedError(absl::StrCat(
        "a block with a quantized KV cache cannot move to ", device.str(),
        " (the cache's simulation runs on the host)"));
  }
  for (LinearKind k : kAllLinears) {
    if (!weights_.has(k)) continue;
    QCAL_RETURN_IF_ERROR(Annotate(weights_.linears[static_cast<int>(k)]->MoveTo(device),
                                  LinearName(k)));
  }
  if (weights_.moe) {
    for (size_t e = 0; e < weights_.moe->experts.size(); ++e) {
      for (auto& l : weights_.moe->experts[e].linears) {
        QCAL_RETURN_IF_ERROR(Annotate(l->MoveTo(device), absl::StrCat("expert ", e)));
      }
    }
    weights_.moe->router = weights_.moe->router.to(device);
  }
  weights_.input_norm = weights_.input_norm.to(device);
  weights_.post_norm = weights_.post_norm.to(device);
  if (weights_.rope_perm.defined()) weights_.rope_perm = weights_.rope_perm.to(device);
  return Status();
}

Status LlamaModel::MoveTo(const at::Device& device) {
  const at::Device from = embed_.device();
  if (from == device) return Status();
  // Blocks first: a layer that cannot move is usually met before anything big moved.
  auto move = [&](const at::Device& to) -> Status {
    for (size_t l = 0; l < blocks_.size(); ++l) {
      QCAL_RETURN_IF_ERROR(Annotate(blocks_[l].MoveTo(to), absl::StrCat("block ", l)));
    }
    QCAL_RETURN_IF_ERROR(Annotate(head_->MoveTo(to), "lm_head"));
    embed_ = embed_.to(to);
    final_norm_ = final_norm_.to(to);
    return Status();
  };
  const Status moved = move(device);
  if (!moved.ok()) move(from).IgnoreError();
  return moved;
}

at::Tensor LlamaModel::Head(const at::Tensor& hidden) const {
  return head_->Forward(RmsNorm(hidden, final_norm_, config_.rms_norm_eps));
}

at::Tensor LlamaModel::Forward(const at::Tensor& ids) const {
  at::NoGradGuard no_grad;
  at::Tensor h = Embed(ids);
  for (const DecoderBlock& block : blocks_) h = block.Forward(h, rope_);
  return Head(h);
}

StatusOr<std::vector<std::shared_ptr<const PrefixKv>>> ComputePrefixKv(
    const LlamaModel& model, const std::vector<int32_t>& tokens) {
  const int64_t o = static_cast<int64_t>(tokens.size());
  if (o == 0) return absl::InvalidArgumentError("prefix: no tokens");
  if (o > kMaxPrefixTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix: ", o, " tokens; at most ", kMaxPrefixTokens, " are supported"));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= model.config().vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prefix: token id ", t,
                                                     " outside the vocabulary of ",
                                                     model.config().vocab_size));
    }
  }
  if (PrefixLength(model) > 0) {
    return absl::FailedPreconditionError("prefix: the model already has a prefix installed");
  }
  at::NoGradGuard no_grad;
  std::vector<int64_t> ids(tokens.begin(), tokens.end());
  at::Tensor h = model.Embed(at::from_blob(ids.data(), {1, o}, at::kLong).clone());
  std::vector<std::shared_ptr<const PrefixKv>> out;
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    auto [k, v] = model.block(i).KeysValues(h, model.rope(), 0);
    auto p = std::make_shared<PrefixKv>();
    p->tokens = tokens;
    p->k = k[0].contiguous();
    p->v = v[0].contiguous();
    out.push_back(std::move(p));
    h = model.block(i).Forward(h, model.rope());
  }
  return out;
}

Status InstallPrefixKv(LlamaModel& model,
                       const std::vector<std::shared_ptr<const PrefixKv>>& prefix) {
  const LlamaConfig& c = model.config();
  if (static_cast<int64_t>(prefix.size()) != model.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat("prefix: ", prefix.size(), " blocks' K/V for a model of ",
                                                   model.num_blocks(), " blocks"));
  }
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    const PrefixKv* p = prefix[i].get();
    const int64_t o = p != nullptr ? p->length() : 0;
    const std::vector<int64_t> want = {c.num_key_value_heads, o, c.head_dim};
    if (p == nullptr || o == 0 || p->k.sizes().vec() != want || p->v.sizes().vec() != want ||
        static_cast<int64_t>(p->tokens.size()) != o || o != prefix[0]->length()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix: block ", i, "'s K/V are not [kv_heads, o, head_dim] = [", c.num_key_value_heads,
          ", ", prefix[0] ? prefix[0]->length() : 0, ", ", c.head_dim, "] with o tokens"));
    }
  }
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    BlockHooks hooks = model.block(i).hooks();
    hooks.prefix = prefix[i];
    model.mutable_block(i).set_hooks(std::move(hooks));
  }
  return Status();
}

int64_t PrefixLength(const LlamaModel& model) {
  if (model.num_blocks() == 0 || !model.block(0).hooks().prefix) return 0;
  return model.block(0).hooks().prefix->length();
}

std::vector<int32_t> GenerateGreedy(const LlamaModel& model, const std::vector<int32_t>& prompt,
                                    int64_t max_new_tokens, int32_t stop_token) {
  // With a prefix that ends with the prompt's BOS, the prompt's BOS is the prefix's.
  const PrefixKv* prefix =
      model.num_blocks() > 0 ? model.block(0).hooks().prefix.get() : nullptr;
  const int64_t o = prefix != nullptr ? prefix->length() : 0;
  const bool drop_bos = o > 0 && !prompt.empty() && prompt[0] == prefix->tokens.back();
  std::vector<int32_t> tokens = prompt;
  if (drop_bos) tokens.erase(tokens.begin());
  const int64_t limit = model.config().max_position_embeddings;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    if (static_cast<int64_t>(tokens.size()) >= limit) break;
    std::vector<int64_t> ids(tokens.begin(), tokens.end());
    at::Tensor input = at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong)
                           .clone();
    at::Tensor logits = model.Forward(input);
    const int32_t next = static_cast<int32_t>(logits[0][-1].argmax().item<int64_t>());
    if (next == stop_token) break;
    tokens.push_back(next);
  }
  if (drop_bos) tokens.insert(tokens.begin(), prompt[0]);
  return tokens;
}

namespace {
int EnvThreads() {
  const char* env = std::getenv("QCAL_NUM_THREADS");
  return env ? std::atoi(env) : 0;
}
}  // namespace

int AutoComputeThreads(const LlamaConfig& config) {
  if (EnvThreads() > 0) return EnvThreads();
  if (config.hidden_size < 512) return 1;
  return AvailableCpus();
}

void SetComputeThreads(int threads) {
  if (threads <= 0) threads = EnvThreads();
  if (threads <= 0) threads = AvailableCpus();
  at::set_num_threads(threads);
  static const std::string blas = kernels::PinBlasToOneThread();
  (void)blas;
}

}  // namespace qcal::model
