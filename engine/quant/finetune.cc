#include "engine/quant/finetune.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <utility>

// The one translation unit that needs LibTorch's optimizers (and autograd's backward()).
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/seed.h"
#include "engine/model/llama.h"

namespace qcal::quant {
namespace {

using Clock = std::chrono::steady_clock;
using model::LinearKind;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Streams derived from the recipe seed (common/seed.h DeriveSeed): split, per-block shuffles, e2e.
constexpr uint64_t kSplitStream = 0x5350;      // "SP"
constexpr uint64_t kBlockStream = 0x424c4b;    // "BLK"
constexpr uint64_t kEndToEndStream = 0x453245;  // "E2E"

// Fisher–Yates with an explicit modulo draw: std::shuffle's use of the engine is unspecified,
// and the split must be the same with every standard library.
void Shuffle(std::vector<int64_t>* v, std::mt19937_64* rng) {
  for (int64_t i = static_cast<int64_t>(v->size()) - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>((*rng)() % static_cast<uint64_t>(i + 1));
    std::swap((*v)[i], (*v)[j]);
  }
}

at::Tensor IndexTensor(const std::vector<int64_t>& idx, int64_t begin, int64_t end) {
  return at::from_blob(const_cast<int64_t*>(idx.data() + begin), {end - begin}, at::kLong)
      .clone();
}

// The parameters of one Adam run, by learning rate.
struct TunableParams {
  std::vector<at::Tensor> plain;  // lr: norms, float weights, untied head
  std::vector<at::Tensor> signs;  // sign_lr: the layers' tunable vectors (Linear::TunableVectors)
  std::vector<at::Tensor> All() const {
    std::vector<at::Tensor> all = plain;
    all.insert(all.end(), signs.begin(), signs.end());
    return all;
  }
  int64_t Values() const {
    int64_t n = 0;
    for (const at::Tensor& t : All()) n += t.numel();
    return n;
  }
};

void SetTrainable(const TunableParams& params, bool on) {
  for (at::Tensor t : params.All()) {
    t.set_requires_grad(on);
    if (!on) t.mutable_grad().reset();
  }
}

std::vector<at::Tensor> Snapshot(const TunableParams& params) {
  std::vector<at::Tensor> snap;
  for (const at::Tensor& t : params.All()) snap.push_back(t.detach().clone());
  return snap;
}

void Restore(const TunableParams& params, const std::vector<at::Tensor>& snap) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> all = params.All();
  for (size_t i = 0; i < all.size(); ++i) all[i].copy_(snap[i]);
}

struct TrainOutcome {
  double initial = 0;  // evaluation loss before any step
  double best = 0;     // evaluation loss of the restored parameters
  int64_t best_epoch = 0;
  int64_t steps = 0;
  FinetuneCurve curve;  // evaluation loss after each epoch (epoch 0 first), mean training loss
};

// Adam over `params` for stage.epochs epochs of shuffled minibatches of `train`; after every
// epoch `eval()` (no grad) is compared with the best so far, and the best parameters (the
// starting point being epoch 0) are restored at the end. batch_loss(indices) returns the mean
// loss of those sequences with a graph to the parameters.
TrainOutcome TrainKeepBest(const TunableParams& params, double lr, double sign_lr,
                           const FinetuneStage& stage, const std::vector<int64_t>& train,
                           uint64_t seed,
                           const std::function<at::Tensor(const at::Tensor&)>& batch_loss,
                           const std::function<double()>& eval) {
  TrainOutcome out;
  out.initial = out.best = eval();
  out.curve.heldout.push_back(out.initial);
  if (stage.epochs <= 0 || train.empty() || params.All().empty()) return out;
  SetTrainable(params, true);
  std::vector<at::Tensor> best = Snapshot(params);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!params.plain.empty()) {
    groups.emplace_back(params.plain, std::make_unique<torch::optim::AdamOptions>(lr));
  }
  if (!params.signs.empty()) {
    groups.emplace_back(params.signs, std::make_unique<torch::optim::AdamOptions>(sign_lr));
  }
  torch::optim::Adam adam(std::move(groups), torch::optim::AdamOptions(lr));
  std::mt19937_64 rng(seed);
  std::vector<int64_t> order = train;
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t batch = std::max<int64_t>(1, stage.batch);
  for (int64_t epoch = 1; epoch <= stage.epochs; ++epoch) {
    Shuffle(&order, &rng);
    at::Tensor loss_sum;  // summed where the losses are (no host sync per step)
    int64_t batches = 0;
    for (int64_t b = 0; b < n; b += batch) {
      adam.zero_grad();
      at::Tensor loss = batch_loss(IndexTensor(order, b, std::min(n, b + batch)));
      loss.backward();
      adam.step();
      ++out.steps;
      const at::Tensor l = loss.detach().to(at::kDouble);
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
      ++batches;
    }
    out.curve.train.push_back(loss_sum.item<double>() / static_cast<double>(batches));
    const double v = eval();
    out.curve.heldout.push_back(v);
    if (v < out.best) {  // NaN never wins
      out.best = v;
      out.best_epoch = epoch;
      best = Snapshot(params);
    }
  }
  Restore(params, best);
  SetTrainable(params, false);
  return out;
}

// Mean squared error of block(inputs[idx]) against targets[idx], summed in double.
double BlockMse(const model::DecoderBlock& block, const model::Rope& rope,
                const at::Tensor& inputs, const at::Tensor& targets,
                const std::vector<int64_t>& idx, int64_t batch) {
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t count = 0;
  const int64_t n = static_cast<int64_t>(idx.size());
  for (int64_t b = 0; b < n; b += batch) {
    const at::Tensor i = IndexTensor(idx, b, std::min(n, b + batch)).to(inputs.device());
    const at::Tensor d =
        (block.Forward(inputs.index_select(0, i), rope) - targets.index_select(0, i))
            .to(at::kDouble);
    sum += model::SumToDouble(d.pow(2));
    count += d.numel();
  }
  return count ? sum / static_cast<double>(count) : std::nan("");
}

Status CheckStage(const FinetuneStage& stage, const std::string& what) {
  if (stage.epochs < 0 || stage.batch < 1 || !(stage.lr > 0) || !(stage.holdout >= 0) ||
      !(stage.holdout < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " fine-tuning: need epochs >= 0, batch >= 1, lr > 0, 0 <= holdout < 1 (got epochs ",
        stage.epochs, ", batch ", stage.batch, ", lr ", stage.lr, ", holdout ", stage.holdout,
        ")"));
  }
  return absl::OkStatus();
}

// The tunable vectors (QuIP#'s su/sv) of every quantized linear of the block, routed experts'
// included (by expert index).
void AddSigns(model::BlockWeights& w, TunableParams* params) {
  auto add = [params](std::unique_ptr<model::Linear>& l) {
    if (l == nullptr) return;
    for (at::Tensor& t : l->TunableVectors()) params->signs.push_back(t);
  };
  for (LinearKind k : model::kAllLinears) add(w.linears[static_cast<int>(k)]);
  if (w.moe == nullptr) return;
  for (model::ExpertWeights& e : w.moe->experts) {
    for (std::unique_ptr<model::Linear>& l : e.linears) add(l);
  }
}

// Where `l` sits in `w` (a BlockWeights, const or not): a dense linear's slot, or a routed
// expert's. Null when the block has no such linear.
template <typename Weights>
auto SlotOf(Weights& w, const TunedLinear& l) -> decltype(&w.linears[0]) {
  if (l.expert < 0) return &w.linears[static_cast<int>(l.kind)];
  if (w.moe == nullptr || l.expert >= static_cast<int64_t>(w.moe->experts.size()) ||
      (l.kind != LinearKind::kGate && l.kind != LinearKind::kUp && l.kind != LinearKind::kDown)) {
    return nullptr;
  }
  return &w.moe->experts[l.expert].linears[static_cast<int>(ExpertRoleOf(l.kind))];
}

// Every linear of a block: the dense ones it has, then each routed expert's gate, up, down.
std::vector<TunedLinear> BlockLinearsOf(const model::BlockWeights& w) {
  std::vector<TunedLinear> out;
  for (LinearKind k : model::kAllLinears) {
    if (w.has(k)) out.push_back({k, -1});
  }
  if (w.moe != nullptr) {
    for (int64_t e = 0; e < static_cast<int64_t>(w.moe->experts.size()); ++e) {
      for (model::ExpertLinear k : model::kExpertLinears) {
        out.push_back({model::ExpertLinearKind(k), e});
      }
    }
  }
  return out;
}

}  // namespace

SequenceSplit SplitSequences(int64_t n, double holdout, uint64_t seed) {
  SequenceSplit split;
  std::vector<int64_t> perm(std::max<int64_t>(n, 0));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  int64_t held = 0;
  if (holdout > 0 && n >= 2) {
    held = std::clamp<int64_t>(std::llround(holdout * static_cast<double>(n)), 1, n - 1);
  }
  std::mt19937_64 rng(DeriveSeed(seed, kSplitStream));
  Shuffle(&perm, &rng);
  split.holdout.assign(perm.begin(), perm.begin() + held);
  split.train.assign(perm.begin() + held, perm.end());
  std::sort(split.holdout.begin(), split.holdout.end());
  std::sort(split.train.begin(), split.train.end());
  return split;
}

struct BlockTuner::State {
  State(const LlamaConfig& config, model::BlockWeights start) : block(config, std::move(start)) {}
  FinetuneOptions options;
  LlamaConfig config;
  int64_t layer = 0;
  const model::BlockWeights* float_weights = nullptr;  // the caller's, valid until Finish
  const model::Rope* rope = nullptr;
  at::Tensor inputs, targets;
  SequenceSplit split;
  Clock::time_point t0;
  // The block's linears (BlockLinearsOf); the working block starts as a float copy, float_w[i]
  // aliasing the weight of linear i's DenseLinear (DenseLinear keeps a contiguous tensor as is),
  // so Adam's in-place updates reach Forward.
  std::vector<TunedLinear> linears;
  std::vector<at::Tensor> float_w;
  std::vector<bool> quantized;
  model::DecoderBlock block;
  BlockTaskResult result;
  const std::vector<int64_t>& eval_idx() const {
    return split.holdout.empty() ? split.train : split.holdout;
  }
  // The index of `l` in linears, or -1.
  int64_t IndexOf(const TunedLinear& l) const {
    for (size_t i = 0; i < linears.size(); ++i) {
      if (linears[i] == l) return static_cast<int64_t>(i);
    }
    return -1;
  }
};

const std::vector<std::vector<LinearKind>>& BlockTuner::Groups() {
  static const std::vector<std::vector<LinearKind>> groups = {
      {LinearKind::kQ, LinearKind::kK, LinearKind::kV},
      {LinearKind::kO},
      {LinearKind::kGate, LinearKind::kUp},
      {LinearKind::kDown}};
  return groups;
}

std::vector<TunedLinear> BlockTuner::GroupLinears(size_t g) const {
  std::vector<TunedLinear> out;
  const std::vector<LinearKind>& kinds = Groups().at(g);
  auto in_group = [&kinds](LinearKind k) {
    return std::find(kinds.begin(), kinds.end(), k) != kinds.end();
  };
  for (const TunedLinear& l : s_->linears) {
    if (l.expert < 0 && in_group(l.kind)) out.push_back(l);
  }
  for (const TunedLinear& l : s_->linears) {
    if (l.expert >= 0 && in_group(l.kind)) out.push_back(l);
  }
  return out;
}

BlockTuner::BlockTuner(std::unique_ptr<State> state) : s_(std::move(state)) {}
BlockTuner::~BlockTuner() = default;

StatusOr<std::unique_ptr<BlockTuner>> BlockTuner::Start(const FinetuneOptions& options,
                                                        const LlamaConfig& config, int64_t layer,
                                                        const model::BlockWeights& float_weights,
                                                        const model::Rope& rope,
                                                        const at::Tensor& inputs_in,
                                                        const at::Tensor& targets_in) {
  const auto t0 = Clock::now();
  const std::string where = absl::StrCat("block ", layer);
  QCAL_RETURN_IF_ERROR(CheckStage(options.stage, where));
  if (inputs_in.dim() != 3 || inputs_in.size(0) < 1 || inputs_in.size(2) != config.hidden_size ||
      !inputs_in.sizes().equals(targets_in.sizes()) ||
      inputs_in.size(1) > rope.max_positions()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": fine-tuning needs inputs and targets of the same shape [N >= 1, S <= ",
        rope.max_positions(), ", ", config.hidden_size, "]"));
  }
  const at::Device device = options.device;
  const std::vector<TunedLinear> linears = BlockLinearsOf(float_weights);
  std::vector<at::Tensor> float_w;
  model::BlockWeights start;
  start.layer = float_weights.layer;
  start.input_norm = float_weights.input_norm.detach().to(device, at::kFloat).clone();
  start.post_norm = float_weights.post_norm.detach().to(device, at::kFloat).clone();
  if (float_weights.moe != nullptr) {
    start.moe = std::make_unique<model::MoeWeights>();
    // The router is not tuned: the float model's, as the quantized block keeps it.
    start.moe->router = float_weights.moe->router.detach().to(device, at::kFloat).clone();
    start.moe->experts.resize(float_weights.moe->experts.size());
  }
  for (const TunedLinear& l : linears) {
    float_w.push_back(
        (*SlotOf(float_weights, l))->DenseWeight().detach().to(device, at::kFloat).clone());
    *SlotOf(start, l) = std::make_unique<model::DenseLinear>(float_w.back());
  }
  auto s = std::make_unique<State>(config, std::move(start));
  s->t0 = t0;
  s->options = options;
  s->config = config;
  s->layer = layer;
  s->float_weights = &float_weights;
  s->rope = &rope;
  s->inputs = inputs_in.detach().to(device, at::kFloat).contiguous();
  s->targets = targets_in.detach().to(device, at::kFloat).contiguous();
  if (!device.is_cpu()) {
    QCAL_LOG_INFO("block {}: fine-tuning on {} ({} sequences)", layer, device.str(),
                  s->inputs.size(0));
  }
  s->split = SplitSequences(s->inputs.size(0), options.stage.holdout, options.seed);
  s->linears = linears;
  s->float_w = std::move(float_w);
  s->quantized.assign(linears.size(), false);
  s->result.layer = layer;
  return std::unique_ptr<BlockTuner>(new BlockTuner(std::move(s)));
}

const at::Tensor& BlockTuner::Weight(const TunedLinear& linear) const {
  static const at::Tensor none;
  const int64_t i = s_->IndexOf(linear);
  return i < 0 ? none : s_->float_w[i];
}

Status BlockTuner::Install(const TunedLinear& linear, QuantizedLinear rounded) {
  const std::string name =
      absl::StrCat("block ", s_->layer, " ", LinearProblemName(linear.kind, linear.expert));
  const int64_t i = s_->IndexOf(linear);
  if (i < 0) return absl::InvalidArgumentError(name + ": the block has no such linear");
  QCAL_RETURN_IF_ERROR(Annotate(rounded.layer->MoveTo(s_->options.device), name));
  s_->result.linears.push_back(rounded.metrics);
  *SlotOf(s_->block.mutable_weights(), linear) = std::move(rounded.layer);
  s_->quantized[i] = true;
  s_->float_w[i] = at::Tensor();
  return Status();
}

Status BlockTuner::MeasureBaseline(
    std::vector<std::pair<TunedLinear, std::unique_ptr<model::Linear>>> others) {
  // The no-FT baseline: the first group as just rounded (from float weights, before any tuning),
  // the other linears rounded from the float weights too, the float norms and router.
  State& s = *s_;
  model::BlockWeights& w = s.block.mutable_weights();
  model::BlockWeights base;
  base.layer = w.layer;
  base.input_norm = s.float_weights->input_norm.detach().to(s.options.device, at::kFloat);
  base.post_norm = s.float_weights->post_norm.detach().to(s.options.device, at::kFloat);
  if (w.moe != nullptr) {
    base.moe = std::make_unique<model::MoeWeights>();
    base.moe->router = w.moe->router;
    base.moe->experts.resize(w.moe->experts.size());
  }
  for (size_t i = 0; i < s.linears.size(); ++i) {
    const TunedLinear& l = s.linears[i];
    if (s.quantized[i]) {
      *SlotOf(base, l) = std::move(*SlotOf(w, l));
      continue;
    }
    auto it = std::find_if(others.begin(), others.end(),
                           [&l](const auto& o) { return o.first == l && o.second != nullptr; });
    const std::string name =
        absl::StrCat("block ", s.layer, " baseline ", LinearProblemName(l.kind, l.expert));
    if (it == others.end()) {
      return absl::InvalidArgumentError(name + ": the fine-tuning baseline has no rounded layer");
    }
    QCAL_RETURN_IF_ERROR(Annotate(it->second->MoveTo(s.options.device), name));
    *SlotOf(base, l) = std::move(it->second);
  }
  const auto t0 = Clock::now();
  model::DecoderBlock base_block(s.config, std::move(base));
  s.result.mse_before_ft =
      BlockMse(base_block, *s.rope, s.inputs, s.targets, s.eval_idx(), s.options.stage.batch);
  s.result.finetune_seconds += Seconds(t0);
  for (size_t i = 0; i < s.linears.size(); ++i) {
    if (s.quantized[i]) {
      *SlotOf(w, s.linears[i]) = std::move(*SlotOf(base_block.mutable_weights(), s.linears[i]));
    }
  }
  return Status();
}

Status BlockTuner::TuneGroup(size_t g) {
  State& s = *s_;
  const auto tg = Clock::now();
  const FinetuneStage& stage = s.options.stage;
  const double lr = stage.lr, sign_lr = stage.lr * s.options.sign_lr_multiplier;
  model::BlockWeights& w = s.block.mutable_weights();
  TunableParams params;
  params.plain = {w.input_norm, w.post_norm};
  for (size_t i = 0; i < s.linears.size(); ++i) {
    if (!s.quantized[i]) params.plain.push_back(s.float_w[i]);
  }
  AddSigns(w, &params);
  const std::vector<int64_t>& eval_idx = s.eval_idx();
  const TrainOutcome outcome = TrainKeepBest(
      params, lr, sign_lr, stage, s.split.train,
      DeriveSeed(s.options.seed, kBlockStream, static_cast<uint64_t>(s.layer) * 8 + g),
      [&](const at::Tensor& host_i) {
        const at::Tensor i = host_i.to(s.inputs.device());
        return (s.block.Forward(s.inputs.index_select(0, i), *s.rope) -
                s.targets.index_select(0, i))
            .pow(2)
            .mean();
      },
      [&] { return BlockMse(s.block, *s.rope, s.inputs, s.targets, eval_idx, stage.batch); });
  QCAL_LOG_INFO(
      "block {} group {}/{}: {} values tuned, held-out MSE {:.4g} -> {:.4g} (best epoch {} of "
      "{}, {} steps, {:.1f} s)",
      s.layer, g + 1, Groups().size(), params.Values(), outcome.initial, outcome.best,
      outcome.best_epoch, stage.epochs, outcome.steps, Seconds(tg));
  if (g + 1 == Groups().size()) s.result.mse_after_ft = outcome.best;
  s.result.ft_curves.push_back(outcome.curve);
  s.result.finetune_seconds += Seconds(tg);
  return Status();
}

StatusOr<BlockTaskResult> BlockTuner::Finish() {
  model::BlockWeights& w = s_->block.mutable_weights();
  if (!s_->options.device.is_cpu()) {
    const at::Device cpu(at::kCPU);
    w.input_norm = w.input_norm.detach().to(cpu);
    w.post_norm = w.post_norm.detach().to(cpu);
    if (w.moe != nullptr) w.moe->router = w.moe->router.detach().to(cpu);
    for (const TunedLinear& l : s_->linears) {
      QCAL_RETURN_IF_ERROR(
          Annotate((*SlotOf(w, l))->MoveTo(cpu),
                   absl::StrCat("block ", s_->layer, " ", LinearProblemName(l.kind, l.expert))));
    }
  }
  s_->result.weights = std::move(w);
  s_->result.seconds = Seconds(s_->t0);
  return std::move(s_->result);
}

StatusOr<TunableModel> AssembleTunableModel(const LlamaConfig& config,
                                            model::NonBlockWeights non_block,
                                            std::vector<model::BlockWeights> blocks) {
  if (static_cast<int64_t>(blocks.size()) != config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("AssembleTunableModel: ", blocks.size(),
                                                   " blocks for a model of ",
                                                   config.num_hidden_layers));
  }
  TunableModel t;
  const at::Tensor embed = non_block.embed;
  t.final_norm = non_block.final_norm;
  t.head = non_block.head_tied ? embed : non_block.head;
  t.head_tied = non_block.head_tied;
  std::vector<model::DecoderBlock> decoder;
  decoder.reserve(blocks.size());
  for (model::BlockWeights& b : blocks) decoder.emplace_back(config, std::move(b));
  t.model = std::make_unique<model::LlamaModel>(config, embed, std::move(decoder), t.final_norm,
                                                std::make_unique<model::DenseLinear>(t.head));
  return t;
}

StatusOr<EndToEndResult> FinetuneEndToEnd(const FinetuneOptions& options,
                                          TunableModel* quantized, const TeacherOutputs& teacher,
                                          const at::Tensor& tokens_in) {
  const auto t0 = Clock::now();
  const FinetuneStage& stage = options.stage;
  QCAL_RETURN_IF_ERROR(CheckStage(stage, "end-to-end"));
  if (quantized == nullptr || !quantized->model) {
    return absl::InvalidArgumentError("end-to-end fine-tuning: no quantized model");
  }
  model::LlamaModel& qm = *quantized->model;
  const LlamaConfig& qc = qm.config();
  if (!quantized->final_norm.defined() || !quantized->head.defined() ||
      quantized->final_norm.numel() != qc.hidden_size ||
      !quantized->head.sizes().equals({qc.vocab_size, qc.hidden_size})) {
    return absl::InvalidArgumentError(
        "end-to-end fine-tuning: TunableModel's final_norm/head are missing or misshapen");
  }
  if (tokens_in.dim() != 2 || tokens_in.size(0) < 1 || tokens_in.size(1) < 1 ||
      tokens_in.size(1) > qm.rope().max_positions() ||
      tokens_in.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError(absl::StrCat(
        "end-to-end fine-tuning: tokens must be [N >= 1, 1 <= S <= ", qm.rope().max_positions(),
        "] int64"));
  }
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t n = tokens.size(0);
  if (!teacher.hidden.defined() || teacher.hidden.dim() != 3 || teacher.hidden.size(0) != n ||
      teacher.hidden.size(1) != tokens.size(1) || teacher.hidden.size(2) != qc.hidden_size ||
      teacher.head == nullptr || !teacher.final_norm.defined()) {
    return absl::InvalidArgumentError(
        "end-to-end fine-tuning: the teacher's hidden states do not match the tokens and model");
  }
  const int64_t batch = stage.batch;
  const SequenceSplit split = SplitSequences(n, stage.holdout, options.seed);
  const std::vector<int64_t>& eval_idx = split.holdout.empty() ? split.train : split.holdout;
  EndToEndResult result;
  result.train_sequences = static_cast<int64_t>(split.train.size());
  result.holdout_sequences = static_cast<int64_t>(split.holdout.size());

  // The student's embeddings (not tuned), once.
  const at::Tensor& teacher_hidden = teacher.hidden;
  at::Tensor student_embed;
  {
    at::NoGradGuard no_grad;
    student_embed = qm.Embed(tokens);
  }
  const double eps = qc.rms_norm_eps;
  auto student_logits = [&](const at::Tensor& i) {
    at::Tensor h = student_embed.index_select(0, i);
    for (int64_t l = 0; l < qm.num_blocks(); ++l) h = qm.block(l).Forward(h, qm.rope());
    return at::matmul(model::RmsNorm(h, quantized->final_norm, eps), quantized->head.t());
  };
  // Per-token KL(p_teacher || p_student), [b, S].
  auto token_kl = [&](const at::Tensor& i) {
    at::Tensor target;
    {
      at::NoGradGuard no_grad;
      const at::Tensor h = teacher_hidden.index_select(0, i);
      target = at::log_softmax(teacher.head->Forward(model::RmsNorm(h, teacher.final_norm, eps)),
                               -1);
    }
    const at::Tensor student = at::log_softmax(student_logits(i), -1);
    return (target.exp() * (target - student)).sum(-1);
  };
  auto eval = [&] {
    at::NoGradGuard no_grad;
    double sum = 0;
    int64_t count = 0;
    const int64_t m = static_cast<int64_t>(eval_idx.size());
    for (int64_t b = 0; b < m; b += batch) {
      const at::Tensor kl = token_kl(IndexTensor(eval_idx, b, std::min(m, b + batch)));
      sum += model::SumToDouble(kl);
      count += kl.numel();
    }
    return count ? sum / static_cast<double>(count) : std::nan("");
  };

  TunableParams params;
  for (int64_t l = 0; l < qm.num_blocks(); ++l) {
    model::BlockWeights& w = qm.mutable_block(l).mutable_weights();
    params.plain.push_back(w.input_norm);
    params.plain.push_back(w.post_norm);
    AddSigns(w, &params);
  }
  params.plain.push_back(quantized->final_norm);
  if (!quantized->head_tied) params.plain.push_back(quantized->head);
  result.head_tuned = !quantized->head_tied;
  result.tuned_tensors = static_cast<int64_t>(params.All().size());
  result.tuned_values = params.Values();

  const TrainOutcome outcome = TrainKeepBest(
      params, stage.lr, stage.lr * options.sign_lr_multiplier, stage, split.train,
      DeriveSeed(options.seed, kEndToEndStream),
      [&](const at::Tensor& i) { return token_kl(i).mean(); }, eval);
  result.heldout_kl_before = outcome.initial;
  result.heldout_kl_after = outcome.best;
  result.best_epoch = outcome.best_epoch;

  // The tuned final norm and head must be the ones the model computes with (TunableModel's
  // contract); a model assembled some other way would silently keep its old head.
  {
    at::NoGradGuard no_grad;
    const at::Tensor h = teacher_hidden.narrow(0, 0, 1);
    const at::Tensor mine =
        at::matmul(model::RmsNorm(h, quantized->final_norm, eps), quantized->head.t());
    if (!at::allclose(qm.Head(h), mine, 1e-5, 1e-5)) {
      return absl::InternalError(
          "end-to-end fine-tuning: TunableModel's final_norm/head are not shared with its model");
    }
  }
  result.seconds = Seconds(t0);
  QCAL_LOG_INFO(
      "end-to-end: {} tensors ({} values{}) tuned, held-out KL {:.5g} -> {:.5g} nats/token (best "
      "epoch {} of {}, {} steps, {:.1f} s)",
      result.tuned_tensors, result.tuned_values, result.head_tuned ? ", incl. lm_head" : "",
      result.heldout_kl_before, result.heldout_kl_after, result.best_epoch, stage.epochs,
      outcome.steps, result.seconds);
  return result;
}

}  // namespace qcal::quant
