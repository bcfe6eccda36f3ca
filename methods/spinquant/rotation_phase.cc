#include "methods/spinquant/rotation_phase.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/recipe_section.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "engine/calib/calibration.h"
#include "engine/calib/hessian.h"
#include "engine/model/tensor_io.h"

namespace qcal::methods::spinquant {
namespace {

using calib::Fixed128;
constexpr int kGradFracBits = 52;
constexpr double kMaxGradEntry = 1099511627776.0;  // 2^40: |entry| beyond it is refused

// The settings a saved state must match (besides the key).
std::string Fingerprint(const qsim::RotationPlan& plan, const RotationPhaseOptions& o,
                        const at::Tensor& tokens) {
  const RotationTrainingOptions& t = o.training;
  return absl::StrCat("steps=", t.steps, " lr=", FormatDouble(t.lr), " batch=", t.batch,
                      " clip=", FormatDouble(t.grad_clip), " w", t.weight_bits, "a", t.act_bits,
                      "kv", t.kv_bits, " seed=", t.seed,
                      o.choose_init      ? " init=best"
                      : t.identity_init ? " init=identity"
                                        : " init=hadamard",
                      t.loss == RotationTrainingOptions::Loss::kKlToFloat ? " loss=kl"
                                                                               : " loss=ce",
                      t.range_gradient ? " range_gradient" : "",
                      t.smooth ? absl::StrCat(" smooth lr=", FormatDouble(t.smooth_lr))
                               : std::string(),
                      o.validation > 0 ? absl::StrCat(" validation=", o.validation,
                                                      " vw", o.validation_options.weight_bits,
                                                      "a", o.validation_options.act_bits, "kv",
                                                      o.validation_options.kv_bits)
                                       : std::string(),
                      " plan=", plan.Describe(),
                      " tokens=", tokens.size(0), "x", tokens.size(1));
}

// Adds x·2^F, rounded to nearest, to acc (n values).
Status AccumulateFixed(const at::Tensor& x, Fixed128* acc, const char* what) {
  const at::Tensor d = x.to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  const double scale = std::ldexp(1.0, kGradFracBits);
  for (int64_t i = 0; i < d.numel(); ++i) {
    if (!std::isfinite(p[i]) || std::fabs(p[i]) > kMaxGradEntry) {
      return absl::OutOfRangeError(absl::StrCat("rotation training: ", what, " entry ", i,
                                                " is ", p[i], " (non-finite or beyond 2^40)"));
    }
    acc[i] += static_cast<Fixed128>(std::nearbyint(p[i] * scale));
  }
  return Status();
}

// Sums acc over the ranks in place (exact), in chunks of 2^20 values.
Status AllReduceFixed(comm::Comm& comm, std::vector<Fixed128>* acc) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<int64_t> limbs;
  for (size_t b = 0; b < acc->size(); b += kChunk) {
    const size_t n = std::min(kChunk, acc->size() - b);
    limbs.assign(4 * n, 0);
    calib::HessianAccumulator::SplitDigits(acc->data() + b, n, limbs.data());
    QCAL_RETURN_IF_ERROR(comm.AllReduceSum(limbs.data(), limbs.size()));
    QCAL_RETURN_IF_ERROR(
        calib::HessianAccumulator::CombineDigits(limbs.data(), n, acc->data() + b));
  }
  return Status();
}

at::Tensor FromFixed(const Fixed128* v, int64_t n, double divisor, at::IntArrayRef shape) {
  at::Tensor t = at::empty({n}, at::kDouble);
  double* p = t.data_ptr<double>();
  const double scale = std::ldexp(1.0, -kGradFracBits);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(v[i]) * scale / divisor;
  return t.view(shape);
}

struct State {
  at::Tensor r1, r2;
  at::Tensor s, adam_m, adam_v;  // smoothing log-scales and their Adam moments (training.smooth)
  std::vector<double> losses;
  std::string init;  // hadamard | identity
  // With validation: the held-out scores so far and the best-scoring rotations.
  std::vector<std::pair<int64_t, double>> validation;
  at::Tensor best_r1, best_r2, best_s;
  int64_t best_step = 0;
};

// One Adam step (β1 0.9, β2 0.999, ε 1e-8, bias-corrected; `step` counts from 0) on x with
// gradient g, in float64 (the same bits on every rank).
void AdamStep(at::Tensor* x, at::Tensor* m, at::Tensor* v, const at::Tensor& g, double lr,
              int64_t step) {
  constexpr double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  *m = *m * b1 + g * (1 - b1);
  *v = *v * b2 + g * g * (1 - b2);
  const double c1 = 1 - std::pow(b1, static_cast<double>(step + 1));
  const double c2 = 1 - std::pow(b2, static_cast<double>(step + 1));
  *x = *x - lr * (*m / c1) / ((*v / c2).sqrt() + eps);
}

Status SaveState(const std::string& path, const State& s, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("state_key", key);
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "r1", s.r1));
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "r2", s.r2));
  if (s.s.defined()) {
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "smooth", s.s));
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "smooth_adam_m", s.adam_m));
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "smooth_adam_v", s.adam_v));
  }
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(
      &writer, "losses",
      at::tensor(s.losses.empty() ? std::vector<double>{0.0} : s.losses, at::kDouble)));
  writer.SetMetadata("steps", std::to_string(s.losses.size()));
  writer.SetMetadata("init", s.init);
  if (!s.validation.empty()) {
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "validation", ScoresTensor(s.validation)));
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "best_r1", s.best_r1));
    QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "best_r2", s.best_r2));
    if (s.best_s.defined()) {
      QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "best_smooth", s.best_s));
    }
    writer.SetMetadata("best_step", std::to_string(s.best_step));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return calib::WriteCacheChecksum(path);
}

// The two files a training state alternates between: state_path and its ".b" twin. A save
// replaces the older one, so a kill while a save is under way -- the data renamed into place but
// its checksum not yet -- leaves the other, one checkpoint older, intact and verifiable.
std::string StateSlotPath(const std::string& path, int slot) {
  if (slot == 0) return path;
  const std::string ext = ".safetensors";
  if (absl::EndsWith(path, ext)) {
    return absl::StrCat(path.substr(0, path.size() - ext.size()), ".b", ext);
  }
  return path + ".b";
}

// The saved state at `path` when it is usable for `key` and these shapes; NotFound when there is
// none; another error (logged by the caller, then ignored) when it is stale or damaged.
StatusOr<State> LoadState(const std::string& path, const std::string& key, int64_t hidden,
                          int64_t layers, int64_t head_dim, int64_t steps, bool validation,
                          int64_t smooth) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return absl::NotFoundError(path);
  QCAL_RETURN_IF_ERROR(calib::VerifyCacheChecksum(path));
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const auto& meta = file->metadata();
  auto k = meta.find("state_key");
  auto n = meta.find("steps");
  if (k == meta.end() || k->second != key || n == meta.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": made for other calibration data or training settings"));
  }
  int64_t done = 0;
  if (!absl::SimpleAtoi(n->second, &done) || done < 1 || done > steps) {
    return absl::DataLossError(absl::StrCat(path, ": bad step count '", n->second, "'"));
  }
  State s;
  auto read = [&](const char* name, std::vector<int64_t> shape) -> StatusOr<at::Tensor> {
    const TensorInfo* info = file->Find(name);
    if (info == nullptr || info->dtype != DType::kF64 || info->shape != shape) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "' missing or not F64 ",
                                              model::ShapeStr(shape)));
    }
    at::Tensor t = at::empty(shape, at::kDouble);
    std::memcpy(t.data_ptr<double>(), file->Data(*info), t.numel() * sizeof(double));
    return t;
  };
  QCAL_ASSIGN_OR_RETURN(s.r1, read("r1", {hidden, hidden}));
  QCAL_ASSIGN_OR_RETURN(s.r2, read("r2", {layers, head_dim, head_dim}));
  if (smooth > 0) {
    QCAL_ASSIGN_OR_RETURN(s.s, read("smooth", {layers, smooth}));
    QCAL_ASSIGN_OR_RETURN(s.adam_m, read("smooth_adam_m", {layers, smooth}));
    QCAL_ASSIGN_OR_RETURN(s.adam_v, read("smooth_adam_v", {layers, smooth}));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor losses, read("losses", {done}));
  s.losses.assign(losses.data_ptr<double>(), losses.data_ptr<double>() + done);
  auto init = meta.find("init");
  if (init == meta.end() || (init->second != "hadamard" && init->second != "identity")) {
    return absl::DataLossError(absl::StrCat(path, ": no start recorded"));
  }
  s.init = init->second;
  if (!validation) return s;
  const TensorInfo* scores = file->Find("validation");
  auto best = meta.find("best_step");
  if (scores == nullptr || scores->shape.size() != 2 || scores->shape[0] < 1 ||
      best == meta.end() || !absl::SimpleAtoi(best->second, &s.best_step) || s.best_step < 0 ||
      s.best_step > done) {
    return absl::DataLossError(absl::StrCat(path, ": held-out scores missing or damaged"));
  }
  QCAL_ASSIGN_OR_RETURN(at::Tensor v, read("validation", {scores->shape[0], 2}));
  for (int64_t i = 0; i < v.size(0); ++i) {
    s.validation.emplace_back(static_cast<int64_t>(v[i][0].item<double>()),
                              v[i][1].item<double>());
  }
  QCAL_ASSIGN_OR_RETURN(s.best_r1, read("best_r1", {hidden, hidden}));
  QCAL_ASSIGN_OR_RETURN(s.best_r2, read("best_r2", {layers, head_dim, head_dim}));
  if (smooth > 0) {
    QCAL_ASSIGN_OR_RETURN(s.best_s, read("best_smooth", {layers, smooth}));
  }
  return s;
}

// The mean loss of rotations (r1, r2) on the sequences `tokens` [m, s] under `options`
// (RotationGradients::Losses), sliced over the ranks and summed exactly (as a step's loss): the
// same value on every rank, for any rank count.
StatusOr<double> HeldOutLoss(comm::Comm& comm, RotationGradients& grads,
                             const at::Tensor& r1, const at::Tensor& r2, const at::Tensor& smooth,
                             const at::Tensor& tokens,
                             const RotationTrainingOptions& options, const char* what) {
  const int64_t m = tokens.size(0);
  const comm::Range mine = comm::SliceForRank(m, comm.rank(), comm.size());
  std::vector<Fixed128> acc(1, 0);
  Status local;
  if (mine.end > mine.begin) {
    auto losses =
        grads.Losses(r1, r2, tokens.narrow(0, mine.begin, mine.end - mine.begin), options, smooth);
    local = losses.status();
    for (size_t i = 0; local.ok() && i < losses->size(); ++i) {
      local = AccumulateFixed(at::tensor({(*losses)[i]}, at::kDouble), acc.data(), "loss");
    }
  }
  int64_t failed = local.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!local.ok()) return Annotate(local, absl::StrCat("rotation training: ", what));
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat("rotation training: ", what, " failed on another rank"));
  }
  QCAL_RETURN_IF_ERROR(AllReduceFixed(comm, &acc));
  return FromFixed(acc.data(), 1, static_cast<double>(m), {1}).item<double>();
}

// The held-out score after `step` steps (it was scored: the start and the checkpoints).
double ScoreAt(const std::vector<std::pair<int64_t, double>>& scores, int64_t step) {
  for (const auto& s : scores) {
    if (s.first == step) return s.second;
  }
  return std::numeric_limits<double>::infinity();
}

Status BroadcastTensor(comm::Comm& comm, at::Tensor* t) {
  *t = t->contiguous();
  return comm.Broadcast(t->data_ptr<double>(), t->numel() * sizeof(double), 0);
}

}  // namespace

at::Tensor ScoresTensor(const std::vector<std::pair<int64_t, double>>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size()), 2}, at::kDouble);
  for (size_t i = 0; i < v.size(); ++i) {
    t[i][0] = static_cast<double>(v[i].first);
    t[i][1] = v[i].second;
  }
  return t;
}

StatusOr<RotationPhaseResult> TrainRotationsDataParallel(comm::Comm& comm,
                                                        model::ModelSource* source,
                                                        const qsim::RotationPlan& plan,
                                                        const at::Tensor& tokens,
                                                        const RotationPhaseOptions& o) {
  const RotationTrainingOptions& t = o.training;
  const LlamaConfig& c = source->config();
  const int64_t layers = c.num_hidden_layers, hid = c.hidden_size, d = c.head_dim;
  if (tokens.dim() != 2 || tokens.size(0) < 1 || tokens.size(1) < 2) {
    return absl::InvalidArgumentError("rotation training: no calibration tokens");
  }
  if (t.steps < 1 || t.batch < 1 || !(t.lr > 0) || o.checkpoint_every < 1) {
    return absl::InvalidArgumentError(
        "rotation training: steps, batch, lr and checkpoint_every must be positive");
  }
  if (o.validation < 0 || o.validation >= tokens.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotation training: ", o.validation, " held-out sequences of ", tokens.size(0),
        " leave none to train on"));
  }
  const bool validate = o.validation > 0;
  const int64_t seqs = tokens.size(0) - o.validation;  // trained on: [0, seqs)
  const at::Tensor held_out = tokens.narrow(0, seqs, o.validation);
  QCAL_ASSIGN_OR_RETURN(auto grads,
                        RotationGradients::Create(source, plan, t, o.cache_bytes));
  const std::string key = absl::StrCat(o.state_key, " | ", Fingerprint(plan, o, tokens));
  const int64_t ns = t.smooth ? SmoothingSize(c) : 0;
  auto score = [&](const at::Tensor& r1, const at::Tensor& r2,
                   const at::Tensor& sm) -> StatusOr<double> {
    if (o.held_out_score) return o.held_out_score(r1, r2, sm, held_out);
    return HeldOutLoss(comm, *grads, r1, r2, sm, held_out, o.validation_options,
                       "scoring the held-out sequences");
  };

  // The starting state: rank 0's saved one when usable, else the plan's Hadamards (or the
  // identity).
  // Of the two state files (StateSlotPath), the usable one with more steps.
  State state;
  int64_t start = 0;
  int last_slot = -1;  // the slot holding the newest usable state; saves go to the other
  if (comm.rank() == 0 && !o.state_path.empty()) {
    std::vector<std::string> unusable;
    for (int slot = 0; slot < 2; ++slot) {
      const std::string path = StateSlotPath(o.state_path, slot);
      auto loaded = LoadState(path, key, hid, layers, d, t.steps, validate, ns);
      if (loaded.ok()) {
        const int64_t steps = static_cast<int64_t>(loaded->losses.size());
        if (steps > start) {
          state = std::move(*loaded);
          start = steps;
          last_slot = slot;
        }
      } else if (!absl::IsNotFound(loaded.status())) {
        unusable.push_back(absl::StrCat(path, ": ", loaded.status().message()));
      }
    }
    for (const std::string& why : unusable) {
      if (start > 0) {
        QCAL_LOG_INFO("rotation training: not using {}", why);
      } else {
        QCAL_LOG_WARN("rotation training: not resuming from {}", why);
      }
    }
  }
  QCAL_RETURN_IF_ERROR(comm.Broadcast(&start, sizeof(start), 0));
  RotationPhaseResult result;
  if (start == 0) {
    const at::Tensor eye1 = at::eye(hid, at::kDouble);
    const at::Tensor eye2 = at::eye(d, at::kDouble).expand({layers, d, d}).contiguous();
    QCAL_ASSIGN_OR_RETURN(auto init, qsim::DenseRotations(plan, layers));
    const at::Tensor had1 = init.first.t().contiguous();  // R = Tᵀ
    const at::Tensor had2 = init.second.transpose(1, 2).contiguous();
    bool identity = t.identity_init;
    double start_score = 0;
    // The scales start at 0 (no scaling).
    if (ns > 0) {
      state.s = at::zeros({layers, ns}, at::kDouble);
      state.adam_m = at::zeros({layers, ns}, at::kDouble);
      state.adam_v = at::zeros({layers, ns}, at::kDouble);
    }
    if (o.choose_init) {
      double lh = 0, li = 0;
      if (validate) {
        QCAL_ASSIGN_OR_RETURN(lh, score(had1, had2, state.s));
        QCAL_ASSIGN_OR_RETURN(li, score(eye1, eye2, state.s));
      } else {
        const at::Tensor first = tokens.narrow(0, 0, std::min<int64_t>(seqs, 4 * t.batch));
        QCAL_ASSIGN_OR_RETURN(lh, HeldOutLoss(comm, *grads, had1, had2, state.s, first, t,
                                              "choosing the start"));
        QCAL_ASSIGN_OR_RETURN(li, HeldOutLoss(comm, *grads, eye1, eye2, state.s, first, t,
                                              "choosing the start"));
      }
      identity = li < lh;
      start_score = identity ? li : lh;
      QCAL_LOG_INFO("rotation training: start loss on {} {} sequences: Hadamard {:.6f}, identity "
                    "{:.6f}; starting from the {}",
                    validate ? o.validation : std::min<int64_t>(seqs, 4 * t.batch),
                    validate ? "held-out" : "training", lh, li,
                    identity ? "identity" : "Hadamards");
    }
    state.r1 = identity ? eye1 : had1;
    state.r2 = identity ? eye2 : had2;
    state.init = identity ? "identity" : "hadamard";
    state.losses.clear();
    if (validate) {
      if (!o.choose_init) {
        QCAL_ASSIGN_OR_RETURN(start_score, score(state.r1, state.r2, state.s));
      }
      state.validation = {{0, start_score}};
      state.best_r1 = state.r1;
      state.best_r2 = state.r2;
      state.best_s = state.s;
      state.best_step = 0;
    }
  } else {
    int64_t counts[2] = {static_cast<int64_t>(state.validation.size()),
                         state.init == "identity" ? 1 : 0};
    QCAL_RETURN_IF_ERROR(comm.Broadcast(counts, sizeof(counts), 0));
    if (comm.rank() != 0) {
      state.r1 = at::empty({hid, hid}, at::kDouble);
      state.r2 = at::empty({layers, d, d}, at::kDouble);
      state.losses.assign(start, 0.0);
      state.init = counts[1] ? "identity" : "hadamard";
      state.validation.assign(counts[0], {0, 0.0});
      if (validate) {
        state.best_r1 = at::empty({hid, hid}, at::kDouble);
        state.best_r2 = at::empty({layers, d, d}, at::kDouble);
        if (ns > 0) state.best_s = at::empty({layers, ns}, at::kDouble);
      }
      if (ns > 0) {
        state.s = at::empty({layers, ns}, at::kDouble);
        state.adam_m = at::empty({layers, ns}, at::kDouble);
        state.adam_v = at::empty({layers, ns}, at::kDouble);
      }
    }
    QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.r1));
    QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.r2));
    if (ns > 0) {
      QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.s));
      QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.adam_m));
      QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.adam_v));
    }
    QCAL_RETURN_IF_ERROR(comm.Broadcast(state.losses.data(), start * sizeof(double), 0));
    if (validate) {
      QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.best_r1));
      QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.best_r2));
      if (ns > 0) QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.best_s));
      QCAL_RETURN_IF_ERROR(comm.Broadcast(&state.best_step, sizeof(state.best_step), 0));
      QCAL_RETURN_IF_ERROR(comm.Broadcast(
          state.validation.data(), state.validation.size() * sizeof(state.validation[0]), 0));
    }
    QCAL_LOG_INFO("rotation training: resuming at step {} of {} from {}", start, t.steps,
                  StateSlotPath(o.state_path, std::max(last_slot, 0)));
  }
  result.resumed_from = start;

  const int64_t n1 = hid * hid, n2 = layers * d * d, n3 = layers * ns;
  const int64_t total = 1 + n1 + n2 + n3;
  const comm::Range mine = comm::SliceForRank(t.batch, comm.rank(), comm.size());
  std::vector<Fixed128> acc;
  int64_t taken = 0;
  try {
    for (int64_t step = start; step < t.steps; ++step) {
      acc.assign(total, 0);
      Status local;
      for (int64_t i = mine.begin; i < mine.end && local.ok(); ++i) {
        const at::Tensor seq = tokens[(step * t.batch + i) % seqs];
        auto r = grads->Sequence(state.r1, state.r2, seq, state.s);
        if (!r.ok()) {
          local = r.status();
          break;
        }
        local = AccumulateFixed(at::tensor({r->loss}, at::kDouble), acc.data(), "loss");
        if (local.ok()) local = AccumulateFixed(r->g1, acc.data() + 1, "R1 gradient");
        if (local.ok()) local = AccumulateFixed(r->g2, acc.data() + 1 + n1, "R2 gradient");
        if (local.ok() && ns > 0) {
          local = AccumulateFixed(r->gs, acc.data() + 1 + n1 + n2, "smoothing gradient");
        }
      }
      int64_t failed = local.ok() ? 0 : 1;
      QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
      if (!local.ok()) return Annotate(local, absl::StrCat("rotation training step ", step));
      if (failed > 0) {
        return absl::AbortedError(
            absl::StrCat("rotation training step ", step, " failed on another rank"));
      }
      QCAL_RETURN_IF_ERROR(AllReduceFixed(comm, &acc));
      const double b = static_cast<double>(t.batch);
      const double loss = FromFixed(acc.data(), 1, b, {1}).item<double>();
      at::Tensor g1 = FromFixed(acc.data() + 1, n1, b, {hid, hid});
      at::Tensor g2 = FromFixed(acc.data() + 1 + n1, n2, b, {layers, d, d});
      if (t.grad_clip > 0) {
        const double norm =
            std::sqrt(g1.pow(2).sum().item<double>() + g2.pow(2).sum().item<double>());
        if (norm > t.grad_clip) {
          g1 = g1 * (t.grad_clip / norm);
          g2 = g2 * (t.grad_clip / norm);
        }
      }
      const double lr = RotationLr(t, step);
      state.r1 = qsim::CayleyStep(state.r1, g1, lr,
                                  qsim::QrRetractionStep(t.seed, step, 0, t.cayley.qr_period),
                                  t.cayley);
      std::vector<at::Tensor> next;
      for (int64_t l = 0; l < layers; ++l) {
        next.push_back(qsim::CayleyStep(
            state.r2[l], g2[l], lr, qsim::QrRetractionStep(t.seed, step, 1 + l, t.cayley.qr_period),
            t.cayley));
      }
      state.r2 = at::stack(next, 0);
      if (ns > 0) {  // Adam on the scales, unclipped, at the rotations' schedule
        const at::Tensor gs = FromFixed(acc.data() + 1 + n1 + n2, n3, b, {layers, ns});
        AdamStep(&state.s, &state.adam_m, &state.adam_v, gs, lr / t.lr * t.smooth_lr, step);
      }
      state.losses.push_back(loss);
      ++taken;
      QCAL_LOG_INFO("rotation training step {}/{}: loss {:.6f}, lr {:.4g}", step + 1, t.steps,
                    loss, lr);
      const bool checkpoint = (step + 1) % o.checkpoint_every == 0;
      if (validate && (checkpoint || step + 1 == t.steps)) {
        QCAL_ASSIGN_OR_RETURN(const double v, score(state.r1, state.r2, state.s));
        const double best = ScoreAt(state.validation, state.best_step);
        state.validation.emplace_back(step + 1, v);
        if (v < best) {  // strictly: the earliest of equal scores stays
          state.best_r1 = state.r1;
          state.best_r2 = state.r2;
          state.best_s = state.s;
          state.best_step = step + 1;
        }
        QCAL_LOG_INFO("rotation training: held-out loss after step {}: {:.6f} (best: {:.6f}, "
                      "after step {})", step + 1, v, std::min(v, best), state.best_step);
      }
      const bool stop = o.stop_after >= 0 && taken >= o.stop_after && step + 1 < t.steps;
      if ((checkpoint || stop) && !o.state_path.empty() && step + 1 < t.steps) {
        Status saved;
        if (comm.rank() == 0) {
          const int slot = last_slot == 0 ? 1 : 0;
          saved = SaveState(StateSlotPath(o.state_path, slot), state, key);
          if (saved.ok()) last_slot = slot;
        }
        int64_t bad = saved.ok() ? 0 : 1;
        QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&bad, 1));
        if (!saved.ok()) return Annotate(saved, "rotation training: saving its state");
        if (bad > 0) return absl::AbortedError("rotation training: rank 0 could not save");
      }
      if (stop) {
        return absl::AbortedError(
            absl::StrCat("rotation training stopped after ", taken, " steps (stop_after)"));
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rotation training: ", e.what()));
  }
  const at::Tensor& r1 = validate ? state.best_r1 : state.r1;
  const at::Tensor& r2 = validate ? state.best_r2 : state.r2;
  result.t1 = r1.t().contiguous();
  result.t2 = r2.transpose(1, 2).contiguous();
  if (ns > 0) result.smooth = (validate ? state.best_s : state.s).contiguous();
  result.losses = std::move(state.losses);
  result.init = state.init;
  result.validation = std::move(state.validation);
  result.selected_step = validate ? state.best_step : t.steps;
  if (validate) {
    QCAL_LOG_INFO("rotation training: the rotations after step {} of {} scored best on the "
                  "held-out sequences ({:.6f}; the start: {:.6f})",
                  result.selected_step, t.steps, ScoreAt(result.validation, result.selected_step),
                  result.validation[0].second);
  }
  return result;
}

}  // namespace qcal::methods::spinquant
