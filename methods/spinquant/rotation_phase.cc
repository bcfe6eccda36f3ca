#include "methods/spinquant/rotation_phase.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/recipe_section.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "worker/calib/calibration.h"
#include "worker/calib/hessian.h"
#include "worker/model/tensor_io.h"

namespace qcal::methods::spinquant {
namespace {

using calib::Fixed128;
constexpr int kGradFracBits = 52;
constexpr double kMaxGradEntry = 1099511627776.0;  // 2^40: |entry| beyond it is refused

// The settings a saved state must match (besides the key).
std::string Fingerprint(const qsim::RotationPlan& plan, const RotationPhaseOptions& o,
                        const at::Tensor& tokens) {
  const qsim::RotationTrainingOptions& t = o.training;
  return absl::StrCat("steps=", t.steps, " lr=", FormatDouble(t.lr), " batch=", t.batch,
                      " clip=", FormatDouble(t.grad_clip), " w", t.weight_bits, "a", t.act_bits,
                      "kv", t.kv_bits, " seed=", t.seed,
                      o.choose_init      ? " init=best"
                      : t.identity_init ? " init=identity"
                                        : " init=hadamard",
                      t.loss == qsim::RotationTrainingOptions::Loss::kKlToFloat ? " loss=kl"
                                                                               : " loss=ce",
                      t.range_gradient ? " range_gradient" : "", " plan=", plan.Describe(),
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
Status AllReduceFixed(runtime::Comm& comm, std::vector<Fixed128>* acc) {
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
  std::vector<double> losses;
};

Status SaveState(const std::string& path, const State& s, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("state_key", key);
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "r1", s.r1));
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(&writer, "r2", s.r2));
  QCAL_RETURN_IF_ERROR(model::AddF64Tensor(
      &writer, "losses",
      at::tensor(s.losses.empty() ? std::vector<double>{0.0} : s.losses, at::kDouble)));
  writer.SetMetadata("steps", std::to_string(s.losses.size()));
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return calib::WriteCacheChecksum(path);
}

// The saved state at `path` when it is usable for `key` and these shapes; NotFound when there is
// none; another error (logged by the caller, then ignored) when it is stale or damaged.
StatusOr<State> LoadState(const std::string& path, const std::string& key, int64_t hidden,
                          int64_t layers, int64_t head_dim, int64_t steps) {
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
  QCAL_ASSIGN_OR_RETURN(at::Tensor losses, read("losses", {done}));
  s.losses.assign(losses.data_ptr<double>(), losses.data_ptr<double>() + done);
  return s;
}

// The mean loss of rotations (r1, r2) on calibration sequences [0, m), sliced over the ranks and
// summed exactly (as a step's loss): the same value on every rank.
StatusOr<double> MeanLoss(runtime::Comm& comm, qsim::RotationGradients& grads, const at::Tensor& r1,
                          const at::Tensor& r2, const at::Tensor& tokens, int64_t m) {
  const runtime::Range mine = runtime::SliceForRank(m, comm.rank(), comm.size());
  std::vector<Fixed128> acc(1, 0);
  Status local;
  for (int64_t i = mine.begin; i < mine.end && local.ok(); ++i) {
    auto r = grads.Sequence(r1, r2, tokens[i]);
    local = r.ok() ? AccumulateFixed(at::tensor({r->loss}, at::kDouble), acc.data(), "loss")
                   : r.status();
  }
  int64_t failed = local.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!local.ok()) return Annotate(local, "rotation training: choosing the start");
  if (failed > 0) {
    return absl::AbortedError("rotation training: choosing the start failed on another rank");
  }
  QCAL_RETURN_IF_ERROR(AllReduceFixed(comm, &acc));
  return FromFixed(acc.data(), 1, static_cast<double>(m), {1}).item<double>();
}

Status BroadcastTensor(runtime::Comm& comm, at::Tensor* t) {
  *t = t->contiguous();
  return comm.Broadcast(t->data_ptr<double>(), t->numel() * sizeof(double), 0);
}

}  // namespace

StatusOr<RotationPhaseResult> TrainRotationsDataParallel(runtime::Comm& comm,
                                                        model::ModelSource* source,
                                                        const qsim::RotationPlan& plan,
                                                        const at::Tensor& tokens,
                                                        const RotationPhaseOptions& o) {
  const qsim::RotationTrainingOptions& t = o.training;
  const LlamaConfig& c = source->config();
  const int64_t layers = c.num_hidden_layers, hid = c.hidden_size, d = c.head_dim;
  if (tokens.dim() != 2 || tokens.size(0) < 1 || tokens.size(1) < 2) {
    return absl::InvalidArgumentError("rotation training: no calibration tokens");
  }
  if (t.steps < 1 || t.batch < 1 || !(t.lr > 0) || o.checkpoint_every < 1) {
    return absl::InvalidArgumentError(
        "rotation training: steps, batch, lr and checkpoint_every must be positive");
  }
  QCAL_ASSIGN_OR_RETURN(auto grads,
                        qsim::RotationGradients::Create(source, plan, t, o.cache_bytes));
  const std::string key = absl::StrCat(o.state_key, " | ", Fingerprint(plan, o, tokens));

  // The starting state: rank 0's saved one when usable, else the plan's Hadamards.
  State state;
  int64_t start = 0;
  if (comm.rank() == 0 && !o.state_path.empty()) {
    auto loaded = LoadState(o.state_path, key, hid, layers, d, t.steps);
    if (loaded.ok()) {
      state = std::move(*loaded);
      start = static_cast<int64_t>(state.losses.size());
    } else if (!absl::IsNotFound(loaded.status())) {
      QCAL_LOG_WARN("rotation training: not resuming from {}: {}", o.state_path,
                    std::string(loaded.status().message()));
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
    if (o.choose_init) {
      const int64_t m = std::min<int64_t>(tokens.size(0), 4 * t.batch);
      QCAL_ASSIGN_OR_RETURN(const double lh, MeanLoss(comm, *grads, had1, had2, tokens, m));
      QCAL_ASSIGN_OR_RETURN(const double li, MeanLoss(comm, *grads, eye1, eye2, tokens, m));
      identity = li < lh;
      QCAL_LOG_INFO("rotation training: start loss on {} sequences: Hadamard {:.6f}, identity "
                    "{:.6f}; starting from the {}", m, lh, li,
                    identity ? "identity" : "Hadamards");
    }
    state.r1 = identity ? eye1 : had1;
    state.r2 = identity ? eye2 : had2;
    result.init = identity ? "identity" : "hadamard";
    state.losses.clear();
  } else {
    if (comm.rank() != 0) {
      state.r1 = at::empty({hid, hid}, at::kDouble);
      state.r2 = at::empty({layers, d, d}, at::kDouble);
      state.losses.assign(start, 0.0);
    }
    QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.r1));
    QCAL_RETURN_IF_ERROR(BroadcastTensor(comm, &state.r2));
    QCAL_RETURN_IF_ERROR(comm.Broadcast(state.losses.data(), start * sizeof(double), 0));
    QCAL_LOG_INFO("rotation training: resuming at step {} of {} from {}", start, t.steps,
                  o.state_path);
  }
  result.resumed_from = start;

  const int64_t n1 = hid * hid, n2 = layers * d * d, total = 1 + n1 + n2;
  const int64_t seqs = tokens.size(0);
  const runtime::Range mine = runtime::SliceForRank(t.batch, comm.rank(), comm.size());
  std::vector<Fixed128> acc;
  int64_t taken = 0;
  try {
    for (int64_t step = start; step < t.steps; ++step) {
      acc.assign(total, 0);
      Status local;
      for (int64_t i = mine.begin; i < mine.end && local.ok(); ++i) {
        const at::Tensor seq = tokens[(step * t.batch + i) % seqs];
        auto r = grads->Sequence(state.r1, state.r2, seq);
        if (!r.ok()) {
          local = r.status();
          break;
        }
        local = AccumulateFixed(at::tensor({r->loss}, at::kDouble), acc.data(), "loss");
        if (local.ok()) local = AccumulateFixed(r->g1, acc.data() + 1, "R1 gradient");
        if (local.ok()) local = AccumulateFixed(r->g2, acc.data() + 1 + n1, "R2 gradient");
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
      const double lr = qsim::RotationLr(t, step);
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
      state.losses.push_back(loss);
      ++taken;
      QCAL_LOG_INFO("rotation training step {}/{}: loss {:.6f}, lr {:.4g}", step + 1, t.steps,
                    loss, lr);
      const bool stop = o.stop_after >= 0 && taken >= o.stop_after && step + 1 < t.steps;
      const bool save = (step + 1) % o.checkpoint_every == 0 || stop;
      if (save && !o.state_path.empty() && step + 1 < t.steps) {
        Status saved;
        if (comm.rank() == 0) saved = SaveState(o.state_path, state, key);
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
  result.t1 = state.r1.t().contiguous();
  result.t2 = state.r2.transpose(1, 2).contiguous();
  result.losses = std::move(state.losses);
  return result;
}

}  // namespace qcal::methods::spinquant
