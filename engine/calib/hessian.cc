#include "engine/calib/hessian.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/cpu.h"
#include "engine/calib/expert_parallel.h"
#include "kernels/fixed_point.h"
#include "kernels/gpu_backend.h"

namespace qcal::calib {

namespace {

constexpr double kUnscale = 0x1p-51;  // 2^-(F+1): T holds two rounded copies of each product

inline double ToDouble(Fixed128 v) { return static_cast<double>(v); }  // round to nearest

Status OverflowError(int64_t n) {
  return absl::OutOfRangeError(absl::StrCat(
      "Hessian [", n, "x", n, "]: an input product is not finite or the fixed-point sum left its ",
      "range (|sum| < 2^76 per entry, resolution 2^-", kHessianFracBits, ")"));
}

}  // namespace

HessianRows HessianBandForRank(int64_t n, int rank, int size, int64_t strip_rows) {
  if (n <= 0 || size <= 1) return {0, std::max<int64_t>(n, 0)};
  // Packed values in rows [0, r): r·n − r(r−1)/2. Band k ends at the first strip boundary where
  // that reaches k+1 shares of the total, so the cut is a function of (n, k, size) alone and
  // consecutive ranks' bands meet.
  const int64_t strips = (n + strip_rows - 1) / strip_rows;
  auto values_before = [&](int64_t r) {
    return static_cast<long double>(r) * n - static_cast<long double>(r) * (r - 1) / 2;
  };
  const long double total = values_before(n);
  auto cut = [&](int k) -> int64_t {  // end row of band k (k = size - 1: n)
    if (k >= size - 1) return n;
    if (k < 0) return 0;
    const long double want = total * (k + 1) / size;
    for (int64_t s = 1; s <= strips; ++s) {
      const int64_t r = std::min(n, s * strip_rows);
      if (values_before(r) >= want) return r;
    }
    return n;
  };
  return {cut(rank - 1), cut(rank)};
}

HessianAccumulator::HessianAccumulator(int64_t n, int64_t strip_rows)
    : n_(n),
      strip_rows_(strip_rows),
      rows_{0, n},
      packed_(static_cast<size_t>(n * (n + 1) / 2), 0) {}

StatusOr<HessianAccumulator> HessianAccumulator::Band(int64_t n, HessianRows rows,
                                                      int64_t strip_rows) {
  const bool aligned = [&] {
    if (strip_rows < 1 || rows.begin < 0 || rows.end > n || rows.begin > rows.end) return false;
    return (rows.begin % strip_rows == 0 || rows.begin == n) &&
           (rows.end % strip_rows == 0 || rows.end == n);
  }();
  if (!aligned) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hessian band [", rows.begin, ", ", rows.end, ") of ", n,
                     " rows is not made of whole ", strip_rows, "-row strips"));
  }
  HessianAccumulator acc(0, strip_rows);
  acc.n_ = n;
  acc.rows_ = rows;
  const int64_t end = rows.end * n - rows.end * (rows.end - 1) / 2;
  acc.packed_.assign(static_cast<size_t>(end - acc.packed_begin()), 0);
  return acc;
}

StatusOr<HessianAccumulator> HessianAccumulator::FromSum(const at::Tensor& sum, int64_t count) {
  if (sum.dim() != 2 || sum.size(0) != sum.size(1)) {
    return absl::InvalidArgumentError("HessianAccumulator::FromSum: sum must be [n, n]");
  }
  HessianAccumulator acc(sum.size(0));
  const at::Tensor s = sum.to(at::kDouble).contiguous();
  if (!kernels::AccumulateSymmetricFixed(s.data_ptr<double>(), acc.n_, at::get_num_threads(),
                                         acc.packed_.data())) {
    return OverflowError(acc.n_);
  }
  acc.count_ = count;
  return acc;
}

StatusOr<HessianAccumulator> HessianAccumulator::FromFixed(int64_t n, std::vector<Fixed128> packed,
                                                           int64_t count) {
  if (n < 0 || packed.size() != static_cast<size_t>(n * (n + 1) / 2) || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("HessianAccumulator::FromFixed: ",
                                                   packed.size(), " packed values for n = ", n,
                                                   " (want n(n+1)/2), count ", count));
  }
  HessianAccumulator acc(0);
  acc.n_ = n;
  acc.rows_ = {0, n};
  acc.packed_ = std::move(packed);
  acc.count_ = count;
  return acc;
}

Status HessianAccumulator::Add(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  if (x.scalar_type() == at::kDouble) {
    if (is_band()) {
      return absl::InvalidArgumentError("a Hessian band accumulates fp32 inputs only");
    }
    at::Tensor rows = x.reshape({-1, n_});
    const at::Tensor p = at::mm(rows.t(), rows).contiguous();
    if (!kernels::AccumulateSymmetricFixed(p.data_ptr<double>(), n_, at::get_num_threads(),
                                           packed_.data())) return OverflowError(n_);
    count_ += rows.size(0);
    return absl::OkStatus();
  }
  // Products in fp32 (fp32 GEMM runs at twice the fp64 rate on CPU, and TF32/fp32 on GPU), one
  // product per sequence, so that every product has the same shape whatever the batching or the
  // split over ranks; each upper-triangle entry is then rounded once into the exact integer sum
  // (counted twice: T is the symmetrised sum, see the header).
  at::Tensor seqs = x.dim() >= 3 ? x.reshape({-1, x.size(-2), n_}) : x.reshape({1, -1, n_});
  seqs = seqs.to(at::kFloat).contiguous();
  if (!kernels::AccumulateHessianFixed(seqs.data_ptr<float>(), seqs.size(0), seqs.size(1), n_,
                                      rows_, strip_rows_, at::get_num_threads(), packed_.data())) {
    return OverflowError(n_);
  }
  count_ += seqs.size(0) * seqs.size(1);
  return absl::OkStatus();
}

Status HessianAccumulator::Merge(const HessianAccumulator& other) {
  if (other.n_ != n_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot merge a ", other.n_, "-dim Hessian into a ", n_, "-dim one"));
  }
  if (!(other.rows_ == rows_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot merge the Hessian rows [", other.rows_.begin, ", ", other.rows_.end,
        ") into rows [", rows_.begin, ", ", rows_.end, ")"));
  }
  for (size_t i = 0; i < packed_.size(); ++i) {
    if (!kernels::AddFixed128(&packed_[i], other.packed_[i])) return OverflowError(n_);
  }
  count_ += other.count_;
  return absl::OkStatus();
}

at::Tensor HessianAccumulator::sum() const {
  TORCH_CHECK(!is_band(), "HessianAccumulator::sum() of a band (rows ", rows_.begin, "..",
              rows_.end, " of ", n_, "): only whole Hessians have an fp64 form");
  return SymmetricSumFromPacked(packed_.data(), n_);
}

at::Tensor SymmetricSumFromPacked(const void* packed_bytes, int64_t n) {
  at::Tensor out = at::empty({n, n}, at::kDouble);
  double* o = out.data_ptr<double>();
  const char* bytes = static_cast<const char*>(packed_bytes);
  // In 16-row tasks on qcal's threads (qcal's TUs are not built with OpenMP, so at::parallel_for
  // would run serially here).
  constexpr int64_t kRowsPerTask = 16;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  qcal::ParallelTasks(tasks, at::get_num_threads(), [&](int64_t t) {
    for (int64_t i = t * kRowsPerTask; i < std::min(n, (t + 1) * kRowsPerTask); ++i) {
      // Row i's values start at packed index i·n − i(i−1)/2; read through memcpy, since mapped
      // bytes are only 8-byte aligned.
      const char* row = bytes + (i * n - i * (i - 1) / 2) * sizeof(Fixed128);
      for (int64_t j = i; j < n; ++j) {
        Fixed128 v;
        std::memcpy(&v, row + (j - i) * sizeof(Fixed128), sizeof(v));
        o[i * n + j] = ToDouble(v) * kUnscale;
      }
    }
  });
  // Mirror (separate pass: the lower triangle of row i is written by other rows' owners).
  qcal::ParallelTasks(tasks, at::get_num_threads(), [&](int64_t t) {
    for (int64_t i = t * kRowsPerTask; i < std::min(n, (t + 1) * kRowsPerTask); ++i) {
      for (int64_t j = 0; j < i; ++j) o[i * n + j] = o[j * n + i];
    }
  });
  return out;
}

at::Tensor HessianAccumulator::Mean() const {
  TORCH_CHECK(!is_band(), "HessianAccumulator::Mean() of a band (rows ", rows_.begin, "..",
              rows_.end, " of ", n_, "): only whole Hessians have an fp64 form");
  if (count_ == 0) return at::zeros({n_, n_}, at::kDouble);
  return sum().div_(static_cast<double>(count_));
}

std::vector<Fixed128> HessianAccumulator::ReleasePacked() {
  std::vector<Fixed128> out = std::move(packed_);
  packed_ = {};
  n_ = 0;
  rows_ = {};
  count_ = 0;
  return out;
}

at::Tensor BlockHessians::Mean(HessianKind k) const {
  const HessianAccumulator& acc = at(k);
  if (acc.dim() > 0 || stored == nullptr) return acc.Mean();
  return stored->Mean(k);
}

at::Tensor BlockHessians::ExpertMean(int64_t expert, ExpertInput input) const {
  if (expert >= 0 && expert < static_cast<int64_t>(experts.size())) {
    const HessianAccumulator& acc = experts[expert].at(input);
    if (acc.dim() > 0 || stored == nullptr) return acc.Mean();
  }
  if (stored == nullptr) return at::Tensor();
  return stored->ExpertMean(expert, input);
}

const char* ExpertInputName(ExpertInput input) {
  return input == ExpertInput::kGateUp ? "gate_up" : "down";
}

at::Tensor HessianMeans::For(model::LinearKind linear) {
  if (h_ == nullptr) return at::Tensor();
  const int kind = static_cast<int>(HessianKindOf(linear));
  if (kind != current_) {
    mean_ = at::Tensor();  // the previous kind's
    mean_ = h_->Mean(static_cast<HessianKind>(kind));
    h_->h[kind].ReleasePacked();
    current_ = kind;
  }
  return mean_;
}

void HessianAccumulator::SplitDigits(const Fixed128* values, size_t n, int64_t* limbs) {
  for (size_t i = 0; i < n; ++i) kernels::SplitFixedDigits(values[i], limbs + 4 * i);
}

Status HessianAccumulator::CombineDigits(const int64_t* limbs, size_t n, Fixed128* values) {
  for (size_t i = 0; i < n; ++i) {
    if (!kernels::CombineFixedDigits(limbs + 4 * i, &values[i])) {
      return absl::OutOfRangeError(absl::StrCat(
          "reduced Hessian value ", i, " leaves the 128-bit fixed-point range (or its digits are "
          "malformed)"));
    }
  }
  return absl::OkStatus();
}

const char* HessianKindName(HessianKind kind) {
  switch (kind) {
    case HessianKind::kQkv: return "qkv";
    case HessianKind::kO: return "o";
    case HessianKind::kGateUp: return "gate_up";
    case HessianKind::kDown: return "down";
  }
  return "?";
}

HessianKind HessianKindOf(model::LinearKind linear) {
  switch (linear) {
    case model::LinearKind::kQ:
    case model::LinearKind::kK:
    case model::LinearKind::kV: return HessianKind::kQkv;
    case model::LinearKind::kO: return HessianKind::kO;
    case model::LinearKind::kGate:
    case model::LinearKind::kUp: return HessianKind::kGateUp;
    case model::LinearKind::kDown: return HessianKind::kDown;
  }
  return HessianKind::kQkv;
}

namespace {

// x [seqs, seq, n] (or 2-D: all rows one sequence) into a device accumulator: the same
// per-sequence products as HessianAccumulator::Add, on the GPU.
Status AddOnDevice(kernels::DeviceHessian* device, const at::Tensor& x) {
  const at::Tensor c = x.to(at::kFloat).contiguous();
  const int64_t n = c.size(-1);
  const int64_t seqs = c.dim() >= 3 ? c.numel() / (c.size(-2) * n) : 1;
  const int64_t t = c.dim() >= 3 ? c.size(-2) : c.numel() / std::max<int64_t>(n, 1);
  return device->Add(c.data_ptr<float>(), seqs, t);
}

// A linear wrapped for one calibration pass: it forwards to the wrapped one and records what it
// reads; the first error sticks (the caller reports it after the pass), and Release gives the
// wrapped linear back.
class WrappedLinear : public model::Linear {
 public:
  explicit WrappedLinear(std::unique_ptr<model::Linear> inner) : inner_(std::move(inner)) {}
  const Status& status() const { return status_; }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }
  std::unique_ptr<model::Linear> Release() { return std::move(inner_); }

 protected:
  std::unique_ptr<model::Linear> inner_;
  mutable Status status_;
};

// Forwards to the wrapped layer and records the input (all borrowed): into the CPU accumulator,
// the GPU backend's when one is active, or, for sharded calibration, as a captured tensor.
class RecordingLinear final : public WrappedLinear {
 public:
  RecordingLinear(std::unique_ptr<model::Linear> inner, HessianAccumulator* acc,
                  kernels::DeviceHessian* device = nullptr,
                  std::vector<at::Tensor>* captured = nullptr)
      : WrappedLinear(std::move(inner)), acc_(acc), device_(device), captured_(captured) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    // The first error sticks (the accumulator is unusable after it); the forward goes on and
    // the caller reports it after the pass.
    if (captured_ && status_.ok()) {
      if (x.dim() != 3) {
        status_ = absl::InternalError(
            absl::StrCat("a captured linear input must be [seqs, seq, n], got ", x.dim(), " dims"));
      } else {
        captured_->push_back(x.detach().to(at::kFloat).contiguous());
      }
    } else if (device_ && status_.ok()) {
      status_ = AddOnDevice(device_, x);
    } else if (acc_ && status_.ok()) {
      status_ = acc_->Add(x);
    }
    return inner_->Forward(x);
  }

 private:
  HessianAccumulator* acc_;
  kernels::DeviceHessian* device_;
  std::vector<at::Tensor>* captured_;
};

// A stand-in that returns zeros of the wrapped linear's output shape (CountRoutedTokens).
class ZeroLinear final : public model::Linear {
 public:
  ZeroLinear(int64_t in, int64_t out) : in_(in), out_(out) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out_;
    return at::zeros(sizes, x.options());
  }
  int64_t in_features() const override { return in_; }
  int64_t out_features() const override { return out_; }
  at::Tensor DenseWeight() const override { return at::zeros({out_, in_}, at::kFloat); }

 private:
  int64_t in_, out_;
};

// The linears that record a distinct input: q (for k and v), o, gate (for up), down.
bool RecordsInput(model::LinearKind k) {
  return k == model::LinearKind::kQ || k == model::LinearKind::kO ||
         k == model::LinearKind::kGate || k == model::LinearKind::kDown;
}

// Runs x through the block in chunks of `batch` sequences and concatenates the outputs.
StatusOr<at::Tensor> ForwardInChunks(model::DecoderBlock& block, const at::Tensor& x,
                                     const model::Rope& rope, int64_t batch) {
  std::vector<at::Tensor> outs;
  try {
    for (int64_t s = 0; s < x.size(0); s += batch) {
      outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block forward failed: ", e.what()));
  }
  return at::cat(outs, 0);
}

}  // namespace

Status FlushDeviceHessians(BlockHessians* hessians) {
  hessians->device_block.reset();
  hessians->device_block_key = nullptr;
  for (HessianKind k : kAllHessianKinds) {
    std::shared_ptr<kernels::DeviceHessian> d = std::move(hessians->device[static_cast<int>(k)]);
    if (d == nullptr) continue;
    int64_t count = 0;
    auto packed = d->Finish(&count);
    if (!packed.ok()) return Annotate(packed.status(), absl::StrCat(HessianKindName(k), " input"));
    HessianAccumulator& acc = hessians->at(k);
    QCAL_ASSIGN_OR_RETURN(HessianAccumulator part,
                          HessianAccumulator::FromFixed(acc.dim(), std::move(*packed), count));
    const Status merged = acc.Merge(part);
    if (!merged.ok()) return Annotate(merged, absl::StrCat(HessianKindName(k), " input"));
  }
  return absl::OkStatus();
}

namespace {

// The block's forward on the device (GpuBackend::NewBlock: weights uploaded once per block, the
// four linear inputs summed into the device Hessians where they are produced) for a plain block:
// no hooks, no K-sort, dense fp32 linears, a shape the device kernels take. Same chunks of
// `batch` sequences as the CPU forward. False (nothing done) when the block or the backend does
// not allow it; the caller then runs the CPU forward.
StatusOr<bool> DeviceForward(model::DecoderBlock& block, const at::Tensor& x,
                             const model::Rope& rope, int64_t batch, BlockHessians* hessians,
                             kernels::GpuBackend* gpu, at::Tensor* out) {
  const model::BlockHooks& hooks = block.hooks();
  const model::BlockWeights& w = block.weights();
  if (hooks.qk_rotation.defined() || hooks.kv_cache || hooks.prefix || w.rope_perm.defined()) {
    return false;
  }
  // Llama 4's dense layers (NoPE, qk-norm, chunks, interleaved RoPE) run on the CPU.
  if (!block.plain_llama() || rope.interleaved()) return false;
  auto plain = [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_cuda();
  };
  kernels::BlockForwardWeights bw;
  for (model::LinearKind k : model::kAllLinears) {
    const auto* d = dynamic_cast<const model::DenseLinear*>(&w.linear(k));
    if (d == nullptr || !plain(d->DenseWeight())) return false;
    bw.linears[static_cast<int>(k)] = d->DenseWeight().data_ptr<float>();
  }
  if (!plain(w.input_norm) || !plain(w.post_norm)) return false;
  bw.input_norm = w.input_norm.data_ptr<float>();
  bw.post_norm = w.post_norm.data_ptr<float>();
  kernels::BlockForwardShape shape;
  shape.hidden = x.size(2);
  shape.intermediate = w.linear(model::LinearKind::kGate).out_features();
  shape.heads = block.heads();
  shape.kv_heads = block.kv_heads();
  shape.head_dim = block.head_dim();
  shape.rms_eps = block.rms_eps();
  if (!kernels::CheckBlockForwardShape(shape).ok()) return false;
  const int64_t t = x.size(1);
  if (t > rope.max_positions()) return false;  // the CPU forward reports it
  if (hessians->device_block == nullptr || hessians->device_block_key != bw.linears[0]) {
    hessians->device_block.reset();
    StatusOr<std::unique_ptr<kernels::DeviceBlock>> b =
        gpu->NewBlock(shape, bw, hessians->forward_precision);
    if (!b.ok()) {
      if (b.status().code() == absl::StatusCode::kUnimplemented) return false;
      return Annotate(b.status(), "device block forward");
    }
    hessians->device_block = std::move(*b);
    hessians->device_block_key = bw.linears[0];
  }
  const at::Tensor cos = rope.cos_table().narrow(0, 0, t).contiguous();
  const at::Tensor sin = rope.sin_table().narrow(0, 0, t).contiguous();
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(xc);
  kernels::DeviceHessian* taps[4];
  for (int k = 0; k < 4; ++k) taps[k] = hessians->device[k].get();
  const int64_t seqs = xc.size(0), row = t * shape.hidden;
  for (int64_t s = 0; s < seqs; s += batch) {
    const int64_t ns = std::min(batch, seqs - s);
    QCAL_RETURN_IF_ERROR(Annotate(
        hessians->device_block->Forward(xc.data_ptr<float>() + s * row, ns, t,
                                        cos.data_ptr<float>(), sin.data_ptr<float>(), taps,
                                        y.data_ptr<float>() + s * row),
        "device block forward"));
  }
  *out = std::move(y);
  return true;
}

}  // namespace

namespace {

// Sizes the accumulators of the block's dense inputs (those of the linears it has: a Mixtral
// block has no MLP linears) when empty; InvalidArgument when one already has another size.
Status SizeDenseAccumulators(const model::BlockWeights& w, BlockHessians* hessians) {
  for (model::LinearKind k : model::kAllLinears) {
    if (!w.has(k)) continue;
    HessianAccumulator& acc = hessians->at(HessianKindOf(k));
    const int64_t n = w.linear(k).in_features();
    if (acc.dim() == 0) acc = HessianAccumulator(n);
    if (acc.dim() != n) {
      return absl::InvalidArgumentError(absl::StrCat("Hessian for ", model::LinearName(k),
                                                     " has dim ", acc.dim(), ", expected ", n));
    }
  }
  return Status();
}

// Installs `hooks` on the block until the returned cleanup runs, which gives the block its own
// hooks back.
auto SwapHooks(model::DecoderBlock& block, model::BlockHooks hooks) {
  model::BlockHooks saved = block.hooks();
  block.set_hooks(std::move(hooks));
  return absl::MakeCleanup([&block, saved = std::move(saved)]() mutable {
    block.set_hooks(std::move(saved));
  });
}

}  // namespace

// ForwardCollectingHessians for a MoE block, on the CPU: the dense inputs as in a dense block
// (Mixtral has no MLP linears; Llama 4's are the shared expert), and the routed experts through
// BlockHooks::run_experts: on this process (RunOwnedExperts over every expert) or, with an
// exchange, on the ranks that own them (expert_parallel.h). Either way each expert sums its
// routed rows per sequence, or, when it calibrates on every token, every token of the call's
// normalised hidden state (the block's own, exactly as its feed-forward reads it).
StatusOr<at::Tensor> ForwardCollectingMoeHessians(model::DecoderBlock& block, const at::Tensor& x,
                                                  const model::Rope& rope, int64_t batch,
                                                  BlockHessians* hessians,
                                                  ExpertExchange* exchange) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  if (!block.is_moe()) {
    return absl::InvalidArgumentError(absl::StrCat("block ", block.layer(), " has no experts"));
  }
  if (exchange != nullptr && x.size(0) > batch) {
    return absl::InternalError(absl::StrCat(
        "an expert-parallel step takes one chunk of at most ", batch, " sequences, got ",
        x.size(0)));
  }
  at::NoGradGuard no_grad;
  model::BlockWeights& w = block.mutable_weights();
  const int64_t experts = static_cast<int64_t>(w.moe->experts.size());
  QCAL_RETURN_IF_ERROR(SizeDenseAccumulators(w, hessians));
  if (!hessians->route_all.empty() &&
      static_cast<int64_t>(hessians->route_all.size()) != experts) {
    return absl::InvalidArgumentError(absl::StrCat("route-all flags for ",
                                                   hessians->route_all.size(),
                                                   " experts, the block has ", experts));
  }
  const comm::Range mine = exchange != nullptr ? exchange->owned() : comm::Range{0, experts};
  if (x.size(0) == 0) {
    // A rank without sequences still has sized accumulators (its experts' too).
    QCAL_RETURN_IF_ERROR(SizeExpertHessians(block, mine, hessians));
    return x;
  }

  // The dense linears that are present (q records for k and v, gate for up).
  std::array<RecordingLinear*, 4> dense{};
  for (model::LinearKind k : model::kAllLinears) {
    auto& slot = w.linears[static_cast<int>(k)];
    if (slot == nullptr) continue;
    const bool records = RecordsInput(k);
    auto rec = std::make_unique<RecordingLinear>(
        std::move(slot), records ? &hessians->at(HessianKindOf(k)) : nullptr);
    if (records) dense[static_cast<int>(HessianKindOf(k))] = rec.get();
    slot = std::move(rec);
  }
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) {
      if (slot != nullptr) slot = static_cast<WrappedLinear*>(slot.get())->Release();
    }
  });
  const int64_t seq_len = x.size(1);
  Status experts_status;
  model::BlockHooks hooks = block.hooks();
  hooks.run_experts = [&](const model::ExpertCall& call) -> std::vector<at::Tensor> {
    if (exchange != nullptr) return exchange->Run(call, seq_len);
    StatusOr<std::vector<at::Tensor>> out = RunOwnedExperts(block, call, seq_len, mine, hessians);
    if (out.ok()) return *std::move(out);
    if (experts_status.ok()) experts_status = out.status();
    return ZeroExpertOutputs(call);
  };
  auto restore_hooks = SwapHooks(block, std::move(hooks));
  std::vector<at::Tensor> outs;
  try {
    for (int64_t s = 0; s < x.size(0); s += batch) {
      outs.push_back(block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block forward failed: ", e.what()));
  }
  QCAL_RETURN_IF_ERROR(experts_status);
  for (HessianKind k : kAllHessianKinds) {
    if (RecordingLinear* r = dense[static_cast<int>(k)]; r != nullptr && !r->status().ok()) {
      return Annotate(r->status(), absl::StrCat(HessianKindName(k), " input"));
    }
  }
  return at::cat(outs, 0);
}

Status CountRoutedTokens(model::DecoderBlock& block, const at::Tensor& x, const model::Rope& rope,
                         int64_t batch, std::vector<int64_t>* tokens) {
  if (!block.is_moe()) {
    return absl::InvalidArgumentError(absl::StrCat("block ", block.layer(), " has no experts"));
  }
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  at::NoGradGuard no_grad;
  model::BlockWeights& w = block.mutable_weights();
  const int64_t experts = static_cast<int64_t>(w.moe->experts.size());
  if (tokens->empty()) tokens->assign(experts, 0);
  if (static_cast<int64_t>(tokens->size()) != experts) {
    return absl::InvalidArgumentError(absl::StrCat("token counts for ", tokens->size(),
                                                   " experts, the block has ", experts));
  }
  // Zero stand-ins for the shared expert's linears, swapped back on every path; the routed
  // experts are not run at all (run_experts returns zeros), so a block loaded with only some of
  // its experts counts too.
  std::vector<std::unique_ptr<model::Linear>*> slots;
  for (model::LinearKind k : {model::LinearKind::kGate, model::LinearKind::kUp,
                              model::LinearKind::kDown}) {
    if (w.has(k)) slots.push_back(&w.linears[static_cast<int>(k)]);
  }
  std::vector<std::unique_ptr<model::Linear>> real;
  for (auto* slot : slots) {
    auto zero = std::make_unique<ZeroLinear>((*slot)->in_features(), (*slot)->out_features());
    real.push_back(std::exchange(*slot, std::move(zero)));
  }
  auto swap_back = absl::MakeCleanup([&] {
    for (size_t i = 0; i < slots.size(); ++i) *slots[i] = std::move(real[i]);
  });
  model::BlockHooks hooks = block.hooks();
  hooks.on_routing = [prev = hooks.on_routing, tokens, experts](const model::Routing& r) {
    if (prev) prev(r);
    const at::Tensor chosen = r.experts.to(at::kCPU).contiguous();
    const int64_t* c = chosen.data_ptr<int64_t>();
    for (int64_t i = 0; i < chosen.numel(); ++i) {
      if (c[i] >= 0 && c[i] < experts) ++(*tokens)[c[i]];
    }
  };
  hooks.run_experts = ZeroExpertOutputs;
  auto restore_hooks = SwapHooks(block, std::move(hooks));
  try {
    for (int64_t s = 0; s < x.size(0); s += batch) {
      (void)block.Forward(x.narrow(0, s, std::min(batch, x.size(0) - s)), rope);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block forward (routing only) failed: ", e.what()));
  }
  return Status();
}

StatusOr<at::Tensor> ForwardCollectingHessians(model::DecoderBlock& block, const at::Tensor& x,
                                               const model::Rope& rope, int64_t batch,
                                               BlockHessians* hessians, bool flush_device) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  at::NoGradGuard no_grad;
  auto forward = [&]() { return ForwardInChunks(block, x, rope, batch); };
  if (hessians == nullptr) return x.size(0) == 0 ? x : forward();
  if (block.is_moe()) {
    return ForwardCollectingMoeHessians(block, x, rope, batch, hessians, /*exchange=*/nullptr);
  }
  model::BlockWeights& w = block.mutable_weights();
  QCAL_RETURN_IF_ERROR(SizeDenseAccumulators(w, hessians));
  if (x.size(0) == 0) return x;  // a rank without sequences still has sized accumulators
  // With a GPU backend the products and their exact sums run on the device; the sums are
  // merged into the CPU accumulators after the pass (the same integer format, so reductions
  // across ranks, caches and rounding are unchanged).
  std::array<std::shared_ptr<kernels::DeviceHessian>, 4>& device = hessians->device;
  if (kernels::GpuBackend* gpu = hessians->backend; gpu != nullptr) {
    for (HessianKind k : kAllHessianKinds) {
      if (device[static_cast<int>(k)] != nullptr) continue;  // kept from an earlier call
      auto d = gpu->NewHessian(hessians->at(k).dim());
      if (!d.ok()) return Annotate(d.status(), absl::StrCat(HessianKindName(k), " input (GPU)"));
      device[static_cast<int>(k)] = std::move(*d);
    }
    at::Tensor out;
    QCAL_ASSIGN_OR_RETURN(const bool on_device,
                          DeviceForward(block, x, rope, batch, hessians, gpu, &out));
    if (on_device) {
      if (flush_device) QCAL_RETURN_IF_ERROR(FlushDeviceHessians(hessians));
      return out;
    }
  }
  // Wrap: only one linear per distinct input records (q records for k and v).
  std::array<RecordingLinear*, 4> recorders{};
  for (model::LinearKind k : model::kAllLinears) {
    const bool records = RecordsInput(k);
    auto& slot = w.linears[static_cast<int>(k)];
    auto rec = std::make_unique<RecordingLinear>(
        std::move(slot), records ? &hessians->at(HessianKindOf(k)) : nullptr,
        records ? device[static_cast<int>(HessianKindOf(k))].get() : nullptr);
    if (records) recorders[static_cast<int>(HessianKindOf(k))] = rec.get();
    slot = std::move(rec);
  }
  // Unwrap on every exit path, so the block is left as it was.
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) slot = static_cast<RecordingLinear*>(slot.get())->Release();
  });
  QCAL_ASSIGN_OR_RETURN(at::Tensor out, forward());
  for (HessianKind k : kAllHessianKinds) {
    const Status& s = recorders[static_cast<int>(k)]->status();
    if (!s.ok()) return Annotate(s, absl::StrCat(HessianKindName(k), " input"));
  }
  if (flush_device) QCAL_RETURN_IF_ERROR(FlushDeviceHessians(hessians));
  return out;
}

StatusOr<at::Tensor> ForwardCapturingInputs(model::DecoderBlock& block, const at::Tensor& x,
                                            const model::Rope& rope, int64_t batch,
                                            std::array<at::Tensor, 4>* inputs) {
  if (x.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("block inputs must be [seqs, seq, hidden], got ", x.dim(), " dims"));
  }
  if (batch < 1) return absl::InvalidArgumentError("batch must be >= 1");
  if (block.is_moe()) {
    return absl::UnimplementedError(absl::StrCat(
        "block ", block.layer(), " is a mixture-of-experts block: sharded Hessians "
        "(calibration.shard_hessians) capture dense inputs only; calibrate it unsharded"));
  }
  at::NoGradGuard no_grad;
  model::BlockWeights& w = block.mutable_weights();
  std::array<std::vector<at::Tensor>, 4> parts;
  std::array<RecordingLinear*, 4> recorders{};
  for (model::LinearKind k : model::kAllLinears) {
    const bool records = RecordsInput(k);
    const int kind = static_cast<int>(HessianKindOf(k));
    auto& slot = w.linears[static_cast<int>(k)];
    auto rec = std::make_unique<RecordingLinear>(std::move(slot), nullptr, nullptr,
                                                 records ? &parts[kind] : nullptr);
    if (records) recorders[kind] = rec.get();
    slot = std::move(rec);
  }
  auto unwrap = absl::MakeCleanup([&w] {
    for (auto& slot : w.linears) slot = static_cast<RecordingLinear*>(slot.get())->Release();
  });
  at::Tensor out = x;
  if (x.size(0) > 0) {
    QCAL_ASSIGN_OR_RETURN(out, ForwardInChunks(block, x, rope, batch));
  }
  for (HessianKind k : kAllHessianKinds) {
    const int kind = static_cast<int>(k);
    const Status& s = recorders[kind]->status();
    if (!s.ok()) return Annotate(s, absl::StrCat(HessianKindName(k), " input"));
    const int64_t n = recorders[kind]->in_features();
    (*inputs)[kind] = parts[kind].empty() ? at::empty({0, x.size(1), n}, at::kFloat)
                      : parts[kind].size() == 1 ? std::move(parts[kind][0])
                                                : at::cat(parts[kind], 0);
  }
  return out;
}

}  // namespace qcal::calib
