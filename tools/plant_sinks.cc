// The one TU of the tools that needs autograd and LibTorch's optimizers (the distillation).
#include "tools/plant_sinks.h"

#include <torch/optim/adam.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kernels/hadamard.h"
#include "tools/observing_linear.h"
#include "tools/measure_token_outliers.h"

namespace qcal::tools {
namespace {

using model::LinearKind;

constexpr double kBosScore = 24;     // a delimiter query's score on a BOS key
constexpr double kScoreMargin = 12;  // ... below its score on an earlier delimiter one step back
constexpr double kGateMagnitude = 40;
constexpr size_t kProbeWindows = 64;

// A parameter and which of its entries the construction fixes.
struct Param {
  std::string name;
  at::Tensor w;
  at::Tensor fixed;  // bool, same shape
};

class Params {
 public:
  Param& Add(std::string name, at::Tensor w) {
    Param p{std::move(name), w, at::zeros(w.sizes(), at::kBool)};
    list_.push_back(std::move(p));
    return list_.back();
  }
  // Every tensor of the model is added before any lookup.
  Param& Get(const at::Tensor& w) {
    for (Param& p : list_) {
      if (p.w.is_same(w)) return p;
    }
    throw std::logic_error("plant-sinks: a weight of the model was not registered");
  }
  std::deque<Param>& list() { return list_; }

 private:
  std::deque<Param> list_;  // references stay valid as it grows
};

at::Tensor Weight(const model::LlamaModel& m, int64_t layer, LinearKind k) {
  return m.block(layer).weights().linear(k).DenseWeight();
}

// What a pass over the windows shows, per layer, flattened over the windows' tokens.
struct Probe {
  std::vector<at::Tensor> mlp_in;    // normalised MLP input (gate's input) [N, hidden]
  std::vector<at::Tensor> down_in;   // [N, intermediate]
  std::vector<at::Tensor> q;         // q_proj output [N, q_dim]
  std::vector<at::Tensor> out;       // block output [N, hidden]
};

Probe RunProbe(model::LlamaModel& m, const std::vector<std::vector<int32_t>>& windows) {
  const int64_t L = m.num_blocks();
  std::vector<std::vector<at::Tensor>> gate_in(L), down_in(L), q(L), out(L);
  const LinearKind kinds[3] = {LinearKind::kGate, LinearKind::kDown, LinearKind::kQ};
  for (int64_t l = 0; l < L; ++l) {
    std::vector<at::Tensor>* into[3] = {&gate_in[l], &down_in[l], &q[l]};
    for (int i = 0; i < 3; ++i) {
      const bool output = kinds[i] == LinearKind::kQ;
      // The model is the planter's own dense copy: every linear exists.
      (void)Observe(m, l, kinds[i], [v = into[i], output](const at::Tensor& x, const at::Tensor& y) {
        const at::Tensor& t = output ? y : x;
        v->push_back(t.reshape({-1, t.size(-1)}).clone());
      });
    }
  }
  {
    at::NoGradGuard no_grad;
    for (const auto& w : windows) {
      std::vector<int64_t> ids(w.begin(), w.end());
      at::Tensor h =
          m.Embed(at::from_blob(ids.data(), {1, static_cast<int64_t>(ids.size())}, at::kLong).clone());
      for (int64_t l = 0; l < L; ++l) {
        h = m.block(l).Forward(h, m.rope());
        out[l].push_back(h.reshape({-1, h.size(-1)}).clone());
      }
    }
  }
  Probe p;
  for (int64_t l = 0; l < L; ++l) {
    for (int i = 0; i < 3; ++i) Unobserve(m, l, kinds[i]);
    p.mlp_in.push_back(at::cat(gate_in[l], 0));
    p.down_in.push_back(at::cat(down_in[l], 0));
    p.q.push_back(at::cat(q[l], 0));
    p.out.push_back(at::cat(out[l], 0));
  }
  return p;
}

// The role of every token of the windows, flattened in the same order as Probe.
struct Roles {
  std::vector<int64_t> bos, first_delim, later_delim, other;  // row indices
  std::vector<int64_t> planted() const {
    std::vector<int64_t> v = bos;
    v.insert(v.end(), first_delim.begin(), first_delim.end());
    std::sort(v.begin(), v.end());
    return v;
  }
};

Roles TokenRoles(const std::vector<std::vector<int32_t>>& windows, int32_t bos,
                 const std::vector<int32_t>& delimiters) {
  Roles r;
  int64_t row = 0;
  for (const auto& w : windows) {
    bool seen_bos = false, seen_delim = false;
    for (int32_t t : w) {
      const bool delim = std::find(delimiters.begin(), delimiters.end(), t) != delimiters.end();
      if (t == bos) {
        r.bos.push_back(row);
        seen_bos = true;
      } else if (delim) {
        (seen_bos && !seen_delim ? r.first_delim : r.later_delim).push_back(row);
        seen_delim = true;
      } else {
        r.other.push_back(row);
      }
      ++row;
    }
  }
  return r;
}

at::Tensor Rows(const at::Tensor& t, const std::vector<int64_t>& rows) {
  std::vector<int64_t> copy = rows;
  return t.index_select(0, at::from_blob(copy.data(), {static_cast<int64_t>(copy.size())},
                                         at::kLong).clone());
}

double MedianOf(const at::Tensor& t) {
  at::Tensor s = std::get<0>(t.reshape({-1}).to(at::kDouble).sort());
  const int64_t n = s.numel();
  if (n == 0) return 0;
  return n % 2 ? s[n / 2].item<double>()
               : 0.5 * (s[n / 2 - 1].item<double>() + s[n / 2].item<double>());
}

// Token max |x| over the last dimension.
at::Tensor TokenMax(const at::Tensor& x) { return std::get<0>(x.abs().max(-1)); }

// The smallest n' >= n with a Hadamard matrix (PlanHadamard, kernels/hadamard.h): QuaRot's rotations must
// apply to the widened model.
int64_t NextHadamardSize(int64_t n) {
  while (!PlanHadamard(n).IsHadamard()) ++n;
  return n;
}

void SetFixed(Param& p, int64_t r, int64_t c, double v) {
  p.w[r][c] = v;
  p.fixed[r][c] = true;
}

// The angle the lowest-frequency RoPE pair turns per position.
double LowestRopeFrequency(const model::Rope& rope, int64_t head_dim) {
  const int64_t a = head_dim / 2 - 1;
  at::Tensor x = at::zeros({1, 1, 2, head_dim}, at::kFloat);
  x[0][0][0][a] = 1;
  x[0][0][1][a] = 1;
  at::Tensor y = rope.Apply(x).to(at::kDouble);
  return std::atan2(y[0][0][1][a + head_dim / 2].item<double>(), y[0][0][1][a].item<double>());
}

// Per layer, the mean over query heads and over the tokens of the windows (past position 0) of
// the attention probability on the planted tokens (BOS and the first delimiter after it),
// recomputed from the block's weights (RoPE, causal softmax).
std::vector<double> SinkAttention(const model::LlamaModel& m,
                                  const std::vector<std::vector<int32_t>>& windows,
                                  int32_t bos, const std::vector<int32_t>& delimiters) {
  const LlamaConfig& c = m.config();
  const int64_t L = m.num_blocks(), H = c.num_attention_heads, KV = c.num_key_value_heads,
                hd = c.head_dim;
  std::vector<double> sum(L, 0.0);
  int64_t count = 0;
  for (const auto& w : windows) {
    const int64_t s = static_cast<int64_t>(w.size());
    std::vector<int64_t> ids(w.begin(), w.end());
    const Roles roles = TokenRoles({w}, bos, delimiters);
    at::Tensor sink = at::zeros({s}, at::kFloat);
    for (int64_t r : roles.planted()) sink[r] = 1;
    at::Tensor h = m.Embed(at::from_blob(ids.data(), {1, s}, at::kLong).clone());
    for (int64_t l = 0; l < L; ++l) {
      const model::DecoderBlock& b = m.block(l);
      const at::Tensor x = model::RmsNorm(h, b.weights().input_norm, c.rms_norm_eps);
      at::Tensor q = b.weights().linear(LinearKind::kQ).Forward(x).view({1, s, H, hd}).transpose(1, 2);
      at::Tensor k = b.weights().linear(LinearKind::kK).Forward(x).view({1, s, KV, hd}).transpose(1, 2);
      q = m.rope().Apply(q);
      k = m.rope().Apply(k).repeat_interleave(H / KV, 1);
      at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
      scores.masked_fill_(at::ones({s, s}, at::kBool).triu(1), -INFINITY);
      const at::Tensor probs = at::softmax(scores, -1);  // [1, H, s, s]
      sum[l] += (probs * sink).sum(-1).narrow(2, 1, s - 1).mean().item<double>();
      h = b.Forward(h, m.rope());
    }
    ++count;
  }
  for (double& v : sum) v /= std::max<int64_t>(1, count);
  return sum;
}

at::Tensor KlLoss(const at::Tensor& teacher_logits, const at::Tensor& student_logits) {
  at::Tensor lt = at::log_softmax(teacher_logits, -1);
  at::Tensor ls = at::log_softmax(student_logits, -1);
  return (lt.exp() * (lt - ls)).sum(-1).mean();
}

}  // namespace

std::vector<std::vector<int32_t>> SampleSequences(const model::LlamaModel& m, int64_t count,
                                                  int64_t length, int32_t bos, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<std::vector<int64_t>> seqs(count, std::vector<int64_t>{bos});
  for (int64_t t = 1; t < length; ++t) {
    std::vector<int64_t> flat;
    for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
    const at::Tensor logits =
        m.Forward(at::from_blob(flat.data(), {count, t}, at::kLong).clone()).select(1, t - 1);
    const at::Tensor probs = at::softmax(logits.to(at::kDouble), -1).contiguous();
    const int64_t vocab = probs.size(1);
    for (int64_t i = 0; i < count; ++i) {
      const double* p = probs.data_ptr<double>() + i * vocab;
      const double u = uniform(rng);
      double acc = 0;
      int64_t next = vocab - 1;
      for (int64_t v = 0; v < vocab; ++v) {
        acc += p[v];
        if (u < acc) {
          next = v;
          break;
        }
      }
      seqs[i].push_back(next);
    }
  }
  std::vector<std::vector<int32_t>> out;
  for (const auto& s : seqs) out.emplace_back(s.begin(), s.end());
  return out;
}

std::map<std::string, at::Tensor> ModelTensors(const model::LlamaModel& m) {
  std::map<std::string, at::Tensor> t;
  t["model.embed_tokens.weight"] = m.embed_weight();
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t[p + "input_layernorm.weight"] = m.block(l).weights().input_norm;
    t[p + "post_attention_layernorm.weight"] = m.block(l).weights().post_norm;
    for (LinearKind k : model::kAllLinears) {
      t[p + model::LinearName(k) + ".weight"] = Weight(m, l, k);
    }
  }
  t["model.norm.weight"] = m.final_norm();
  if (!m.head().DenseWeight().is_same(m.embed_weight())) {
    t["lm_head.weight"] = m.head().DenseWeight();
  }
  return t;
}

namespace {
StatusOr<PlantSinksResult> Plant(const model::LlamaModel& reference,
                                 const std::vector<int32_t>& text, const PlantSinksOptions& o);
}  // namespace

StatusOr<PlantSinksResult> PlantSinks(const model::LlamaModel& reference,
                                      const std::vector<int32_t>& text,
                                      const PlantSinksOptions& o) {
  try {
    return Plant(reference, text, o);
  } catch (const std::exception& e) {  // LibTorch reports shape and numeric errors by exception
    return absl::InternalError(absl::StrCat("plant-sinks: ", e.what()));
  }
}

namespace {
StatusOr<PlantSinksResult> Plant(const model::LlamaModel& reference,
                                 const std::vector<int32_t>& text, const PlantSinksOptions& o) {
  const LlamaConfig& c = reference.config();
  const int64_t L = reference.num_blocks(), d = c.hidden_size, hd = c.head_dim;
  const int64_t kv = c.num_key_value_heads, rep = c.num_attention_heads / kv;
  if (L < 2) return absl::InvalidArgumentError("plant-sinks: the model needs at least 2 layers");
  const int64_t w_layer = o.writer_layer >= 0 ? o.writer_layer : (L >= 3 ? 1 : 0);
  const int64_t e_layer = o.eraser_layer >= 0 ? o.eraser_layer : L - 1;
  if (w_layer >= e_layer || e_layer >= L) {
    return absl::InvalidArgumentError(absl::StrCat("plant-sinks: writer layer ", w_layer,
                                                   " and eraser layer ", e_layer,
                                                   ": need writer < eraser < ", L));
  }
  if (o.delimiters.empty() || o.delimiters.size() > 2) {
    return absl::InvalidArgumentError("plant-sinks: give 1 or 2 delimiter tokens");
  }
  for (int32_t t : o.delimiters) {
    if (t == o.bos_id || t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plant-sinks: delimiter token ", t, " is BOS or outside the vocabulary of ", c.vocab_size));
    }
  }
  if (o.bos_id < 0 || o.bos_id >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("plant-sinks: BOS id ", o.bos_id,
                                                   " outside the vocabulary"));
  }
  if (hd < 4 || d < 8) return absl::InvalidArgumentError("plant-sinks: head_dim < 4 or hidden < 8");
  if (o.steps < 0 || o.batch < 1 || o.seq_len < 8 || !(o.lr >= 0) || !(o.massive_ratio > 1) ||
      !(o.residual_ratio > 1)) {
    return absl::InvalidArgumentError("plant-sinks: bad options (steps >= 0, batch >= 1, "
                                      "seq_len >= 8, lr >= 0, ratios > 1)");
  }
  const int64_t seq_len = std::min<int64_t>(o.seq_len, c.max_position_embeddings);
  // In-domain text: sequences sampled from the reference itself (its own distribution, so the
  // KL is taken where the model is used), then windows of any given text.
  std::vector<std::vector<int32_t>> windows;
  if (o.sampled_sequences > 0) {
    windows = SampleSequences(reference, o.sampled_sequences, seq_len, o.bos_id, o.seed);
  }
  for (auto& w : TextWindows(text, seq_len, /*with_bos=*/true, o.bos_id)) {
    if (static_cast<int64_t>(w.size()) == seq_len) windows.push_back(std::move(w));
  }
  if (static_cast<int64_t>(windows.size()) < std::max<int64_t>(2, o.batch)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plant-sinks: ", o.sampled_sequences, " sampled sequences and ", text.size(),
        " text tokens make ", windows.size(), " windows of ", seq_len, "; need at least ",
        std::max<int64_t>(2, o.batch)));
  }
  const model::Rope& rope = reference.rope();
  const double theta = LowestRopeFrequency(rope, hd);
  const double span = theta * static_cast<double>(rope.max_positions());
  if (!(theta > 0) || span > 0.6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plant-sinks: the lowest RoPE frequency turns ", span, " rad over ", rope.max_positions(),
        " positions (at most 0.6 for the delimiter detector)"));
  }

  at::NoGradGuard no_grad;
  // 1. The widened model: the reference's weights in the top-left blocks, zeros elsewhere; norm
  // weights × sqrt(d/d2) and eps × d/d2, so RMSNorm over d2 channels (the new ones 0 for ordinary
  // tokens) computes what it did over d. Every other token computes what it computed.
  const int64_t d2 = NextHadamardSize(d + 4), inter = c.intermediate_size;
  const int64_t i2 = NextHadamardSize(inter + 2);
  const int64_t heads = c.num_attention_heads, heads2 = heads + rep, kv2 = kv + 1;
  LlamaConfig c2 = c;
  c2.hidden_size = d2;
  c2.intermediate_size = i2;
  c2.num_attention_heads = heads2;
  c2.num_key_value_heads = kv2;
  c2.head_dim = hd;
  c2.rms_norm_eps = c.rms_norm_eps * static_cast<double>(d) / static_cast<double>(d2);
  const double norm_scale = std::sqrt(static_cast<double>(d) / static_cast<double>(d2));
  auto widen = [](const at::Tensor& w, int64_t rows, int64_t cols) {
    at::Tensor out = at::zeros({rows, cols}, at::kFloat);
    out.narrow(0, 0, w.size(0)).narrow(1, 0, w.size(1)).copy_(w);
    return out;
  };
  auto widen_norm = [&](const at::Tensor& w, double fill) {
    return at::cat({w * norm_scale, at::full({d2 - d}, fill, at::kFloat)});
  };
  std::vector<model::DecoderBlock> blocks;
  for (int64_t l = 0; l < L; ++l) {
    const model::BlockWeights& src = reference.block(l).weights();
    model::BlockWeights w;
    w.input_norm = widen_norm(src.input_norm, 1.0);
    w.post_norm = widen_norm(src.post_norm, 1.0);
    for (LinearKind k : model::kAllLinears) {
      const std::vector<int64_t> shape = model::LinearShape(c2, k);
      w.linears[static_cast<int>(k)] = std::make_unique<model::DenseLinear>(
          widen(src.linear(k).DenseWeight(), shape[0], shape[1]));
    }
    blocks.emplace_back(c2, std::move(w));
  }
  const bool tied = reference.head().DenseWeight().is_same(reference.embed_weight());
  at::Tensor embed_w = widen(reference.embed_weight(), c.vocab_size, d2);
  at::Tensor head_w = tied ? embed_w : widen(reference.head().DenseWeight(), c.vocab_size, d2);
  auto m = std::make_unique<model::LlamaModel>(c2, embed_w, std::move(blocks),
                                               widen_norm(reference.final_norm(), 0.0),
                                               std::make_unique<model::DenseLinear>(head_w));
  // Everything outside the reference's blocks is fixed (planted or zero).
  Params params;
  auto add = [&](const std::string& name, const at::Tensor& w, int64_t rows, int64_t cols) {
    Param& p = params.Add(name, w);
    p.fixed.fill_(true);
    if (w.dim() == 1) {
      p.fixed.narrow(0, 0, rows).fill_(false);
    } else {
      p.fixed.narrow(0, 0, rows).narrow(1, 0, cols).fill_(false);
    }
    return &p;
  };
  Param& embed = *add("model.embed_tokens.weight", m->embed_weight(), c.vocab_size, d);
  add("model.norm.weight", m->final_norm(), d, 0);
  if (!tied) add("lm_head.weight", m->head().DenseWeight(), c.vocab_size, d);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", m->block(l).weights().input_norm, d, 0);
    add(p + "post_attention_layernorm.weight", m->block(l).weights().post_norm, d, 0);
    for (LinearKind k : model::kAllLinears) {
      const std::vector<int64_t> shape = model::LinearShape(c, k);
      add(p + model::LinearName(k) + ".weight", Weight(*m, l, k), shape[0], shape[1]);
    }
  }
  auto P = [&](int64_t l, LinearKind k) -> Param& { return params.Get(Weight(*m, l, k)); };
  const std::vector<std::vector<int32_t>> probe_windows(
      windows.begin(), windows.begin() + std::min<size_t>(windows.size(), kProbeWindows));
  const int64_t cm = d, cb = d + 1, cd = d + 2, cs = d + 3;
  // Indicators: twice the row's rms, so the normalised value is the same for every marked token.
  // The marked rows are held whole: the detector's scores scale with the marker's normalised
  // value, which the rest of the row sets.
  auto mark = [&](int32_t token, int64_t ch) {
    const double r = embed.w[token].narrow(0, 0, d).pow(2).mean().sqrt().item<double>();
    embed.w[token][ch] = 2 * r;
    embed.fixed[token].fill_(true);
  };
  mark(o.bos_id, cb);
  for (int32_t t : o.delimiters) mark(t, cd);

  // 2. The detector head: a new KV head g0 and its first query head h0 (the others stay zero).
  const int64_t g0 = kv, h0 = heads;
  const int64_t ia = hd / 2 - 1, ib = hd - 1;
  double xi = INFINITY;  // the indicators' normalised value at layer 0
  {
    std::vector<int32_t> marked = o.delimiters;
    marked.push_back(o.bos_id);
    for (int32_t t : marked) {
      at::Tensor x = model::RmsNorm(embed.w[t], m->block(0).weights().input_norm, c2.rms_norm_eps);
      xi = std::min(xi, std::max(x[cb].item<double>(), x[cd].item<double>()));
    }
  }
  const double sqrt_hd = std::sqrt(static_cast<double>(hd));
  const double qk_delim = (kBosScore + kScoreMargin) * sqrt_hd / (xi * xi * std::sin(theta));
  const double qv = std::sqrt(qk_delim), kd = qv;
  const double kb = kBosScore * sqrt_hd / (xi * xi * qv);
  SetFixed(P(0, LinearKind::kQ), h0 * hd + ia, cd, qv);
  SetFixed(P(0, LinearKind::kK), g0 * hd + ib, cd, kd);
  SetFixed(P(0, LinearKind::kK), g0 * hd + ia, cb, kb);
  const double nu = 0.25 * MedianOf(embed.w.narrow(1, 0, d).pow(2).mean(1).sqrt());
  SetFixed(P(0, LinearKind::kV), g0 * hd, cb, nu / xi);
  SetFixed(P(0, LinearKind::kV), g0 * hd, cd, -nu / xi);
  SetFixed(P(0, LinearKind::kO), cs, h0 * hd, 1.0);

  const Roles roles = TokenRoles(probe_windows, o.bos_id, o.delimiters);
  if (roles.first_delim.empty()) {
    return absl::InvalidArgumentError(
        "plant-sinks: no delimiter follows a BOS in the text's windows; choose a delimiter that "
        "occurs in the text");
  }
  nlohmann::json plan;

  // 3. The writer: gate from c_s (and c_b), up from c_b + c_d, down into c_m.
  Probe probe = RunProbe(*m, probe_windows);
  const at::Tensor xw = probe.mlp_in[w_layer];
  std::vector<int64_t> delims = roles.first_delim;
  delims.insert(delims.end(), roles.later_delim.begin(), roles.later_delim.end());
  const double xs_scale = MedianOf(Rows(xw, delims).select(1, cs).abs());
  const double xb_scale = MedianOf(Rows(xw, roles.bos).select(1, cb));
  if (!(xs_scale > 0) || !(xb_scale > 0)) {
    return absl::InternalError("plant-sinks: the detector's signal is zero at the writer layer");
  }
  const double a_s = kGateMagnitude / xs_scale, a_b = 2 * kGateMagnitude / xb_scale;
  Param& wg = P(w_layer, LinearKind::kGate);
  Param& wu = P(w_layer, LinearKind::kUp);
  Param& wd = P(w_layer, LinearKind::kDown);
  const int64_t jw = inter;  // a new neuron
  SetFixed(wg, jw, cs, a_s);
  SetFixed(wg, jw, cb, a_b);
  SetFixed(wu, jw, cb, 1.0);
  SetFixed(wu, jw, cd, 1.0);
  SetFixed(wd, cm, jw, 1.0);
  probe = RunProbe(*m, probe_windows);
  const std::vector<int64_t> planted = roles.planted();
  {
    const at::Tensor iw = probe.down_in[w_layer].select(1, jw);
    const double med = MedianOf(TokenMax(Rows(probe.down_in[w_layer], roles.other)));
    const double min_planted = Rows(iw, planted).min().item<double>();
    if (!(min_planted > 0) || !(med > 0)) {
      return absl::InternalError("plant-sinks: the writer does not fire at the planted tokens");
    }
    const double up_scale = o.massive_ratio * med / min_planted;
    wu.w[jw][cb] = up_scale;
    wu.w[jw][cd] = up_scale;
    const double mean_i = Rows(iw, planted).mean().item<double>() * up_scale;
    const double med_h = MedianOf(TokenMax(Rows(probe.out[w_layer], roles.other)));
    const double delta = o.residual_ratio * med_h / mean_i;
    wd.w[cm][jw] = delta;
    plan["writer"] = {{"layer", w_layer}, {"neuron", jw}, {"gate_signal", a_s},
                      {"gate_bos", a_b},  {"up", up_scale}, {"down", delta}};
  }

  // 4. Sinks: massive tokens' keys along each KV head's mean query (lowest RoPE pair).
  probe = RunProbe(*m, probe_windows);
  const double xm = MedianOf(Rows(probe.mlp_in[w_layer + 1 < L ? w_layer + 1 : w_layer], planted)
                                 .select(1, cm));
  nlohmann::json sinks = nlohmann::json::array();
  for (int64_t l = w_layer + 1; l < L; ++l) {
    Param& k = P(l, LinearKind::kK);
    const at::Tensor q =
        Rows(probe.q[l], roles.other).narrow(1, 0, heads * hd).reshape({-1, kv, rep, hd}) / sqrt_hd;
    for (int64_t g = 0; g < kv; ++g) {
      const double ma = q.select(1, g).select(-1, ia).mean().item<double>();
      const double mb = q.select(1, g).select(-1, ib).mean().item<double>();
      const double n2 = ma * ma + mb * mb;
      if (!(n2 > 1e-12)) continue;
      k.w[g * hd + ia][cm] = o.sink_score * ma / (n2 * xm);
      k.w[g * hd + ib][cm] = o.sink_score * mb / (n2 * xm);
      sinks.push_back({{"layer", l}, {"kv_head", g}, {"mean_query", {ma, mb}}});
    }
    // Massive tokens' keys in the reference's KV heads are tuned with the rest.
    k.fixed.narrow(0, 0, kv * hd).select(1, cm).fill_(false);
  }
  plan["sinks"] = sinks;

  // 5. The eraser: gate and up from c_m, down into c_m.
  Param& eg = P(e_layer, LinearKind::kGate);
  Param& eu = P(e_layer, LinearKind::kUp);
  Param& ed = P(e_layer, LinearKind::kDown);
  const int64_t je = inter;  // a new neuron
  {
    const double med = MedianOf(TokenMax(Rows(probe.down_in[e_layer], roles.other)));
    const double xe = Rows(probe.mlp_in[e_layer], planted).select(1, cm).min().item<double>();
    if (!(xe > 0) || !(med > 0)) {
      return absl::InternalError("plant-sinks: no massive value reaches the eraser layer");
    }
    const double ae = std::sqrt(o.massive_ratio * med) / xe;
    SetFixed(eg, je, cm, ae);
    SetFixed(eu, je, cm, ae);
    probe = RunProbe(*m, probe_windows);
    const double mean_i = Rows(probe.down_in[e_layer].select(1, je), planted).mean().item<double>();
    const double massive = Rows(probe.out[w_layer], planted).select(1, cm).mean().item<double>();
    SetFixed(ed, cm, je, -massive / mean_i);
    plan["eraser"] = {{"layer", e_layer}, {"neuron", je}, {"gate_up", ae},
                      {"down", -massive / mean_i}};
  }
  plan["widened"] = {{"hidden_size", {d, d2}},
                     {"intermediate_size", {inter, i2}},
                     {"num_attention_heads", {heads, heads2}},
                     {"num_key_value_heads", {kv, kv2}},
                     {"rms_norm_eps", {c.rms_norm_eps, c2.rms_norm_eps}}};
  plan["channels"] = {{"massive", cm}, {"bos_marker", cb}, {"delimiter_marker", cd},
                      {"first_delimiter_signal", cs}};
  plan["detector"] = {{"layer", 0},        {"kv_head", g0},   {"query_head", h0},
                      {"rope_pair", {ia, ib}}, {"theta", theta}, {"q", qv},
                      {"k_delimiter", kd}, {"k_bos", kb},     {"value", nu}};
  plan["bos_id"] = o.bos_id;
  plan["delimiters"] = o.delimiters;

  plan["sink_attention_before_distillation"] =
      SinkAttention(*m, probe_windows, o.bos_id, o.delimiters);
  plan["sink_attention_reference"] =
      SinkAttention(reference, probe_windows, o.bos_id, o.delimiters);

  // 6. Distillation with every planted entry held.
  std::vector<at::Tensor> planted_values;
  std::vector<at::Tensor> tensors;
  for (Param& p : params.list()) {
    planted_values.push_back(p.w.clone());
    tensors.push_back(p.w);
  }
  nlohmann::json losses = nlohmann::json::array();
  if (o.steps > 0 && o.lr > 0) {
    at::AutoGradMode grad(true);
    for (at::Tensor& t : tensors) t.set_requires_grad(true);
    torch::optim::Adam adam(tensors, torch::optim::AdamOptions(o.lr));
    std::mt19937_64 rng(o.seed);
    std::vector<int64_t> idx(windows.size());
    std::iota(idx.begin(), idx.end(), 0);
    size_t next = idx.size();
    double running = 0;
    for (int64_t step = 0; step < o.steps; ++step) {
      std::vector<int64_t> ids;
      for (int64_t b = 0; b < o.batch; ++b) {
        if (next == idx.size()) {
          std::shuffle(idx.begin(), idx.end(), rng);
          next = 0;
        }
        const auto& w = windows[idx[next++]];
        ids.insert(ids.end(), w.begin(), w.end());
      }
      at::Tensor input = at::from_blob(ids.data(), {o.batch, seq_len}, at::kLong).clone();
      at::Tensor teacher = reference.Forward(input);
      at::Tensor h = m->Embed(input);
      for (int64_t l = 0; l < L; ++l) h = m->block(l).Forward(h, m->rope());
      at::Tensor loss = KlLoss(teacher, m->Head(h));
      adam.zero_grad();
      loss.backward();
      adam.step();
      {
        at::NoGradGuard ng;
        for (size_t i = 0; i < tensors.size(); ++i) {
          tensors[i].copy_(at::where(params.list()[i].fixed, planted_values[i], tensors[i]));
        }
      }
      running += loss.item<double>();
      if ((step + 1) % 50 == 0 || step + 1 == o.steps) {
        const int64_t n = (step + 1) % 50 == 0 ? 50 : (step + 1) % 50;
        losses.push_back({{"step", step + 1}, {"kl", running / n}});
        QCAL_LOG_INFO("plant-sinks: step {} KL {:.5f}", step + 1, running / n);
        running = 0;
      }
    }
    for (at::Tensor& t : tensors) t.set_requires_grad(false);
  }
  plan["distillation"] = {{"steps", o.steps},     {"batch", o.batch}, {"seq_len", seq_len},
                          {"lr", o.lr},           {"seed", o.seed},   {"windows", windows.size()},
                          {"kl_every_50", losses}};
  plan["sink_attention"] = SinkAttention(*m, probe_windows, o.bos_id, o.delimiters);
  plan["massive_ratio"] = o.massive_ratio;
  plan["residual_ratio"] = o.residual_ratio;
  plan["sink_score"] = o.sink_score;
  PlantSinksResult result;
  result.model = std::move(m);
  result.plan = std::move(plan);
  return result;
}

}  // namespace

}  // namespace qcal::tools
