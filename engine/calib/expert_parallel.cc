#include "engine/calib/expert_parallel.h"

#include <cstring>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::calib {
namespace {

// The bytes of one exchange message, appended in order (host byte order: every rank of a job is
// the same build on the same kind of machine).
class Writer {
 public:
  explicit Writer(std::vector<char>* out) : out_(out) {}
  void I64(int64_t v) { Bytes(&v, sizeof(v)); }
  // A tensor's values (float32 or int64, any layout) in row-major order.
  void Values(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    Bytes(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  }

 private:
  void Bytes(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    out_->insert(out_->end(), c, c + n);
  }
  std::vector<char>* out_;
};

// Reads a message Writer wrote; every read is checked against the message's length.
class Reader {
 public:
  Reader(const std::vector<char>& in, int from) : in_(in), from_(from) {}
  StatusOr<int64_t> I64() {
    int64_t v;
    QCAL_RETURN_IF_ERROR(Bytes(&v, sizeof(v)));
    return v;
  }
  // A fresh tensor of `shape` (float32 or int64) from the next values.
  StatusOr<at::Tensor> Values(const std::vector<int64_t>& shape, at::ScalarType dtype) {
    at::Tensor t = at::empty(shape, dtype);
    QCAL_RETURN_IF_ERROR(Bytes(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size()));
    return t;
  }
  bool done() const { return at_ == in_.size(); }

 private:
  Status Bytes(void* p, size_t n) {
    if (n > in_.size() - at_) {
      return absl::InternalError(absl::StrCat("expert exchange: the message from rank ", from_,
                                              " ends after ", in_.size(), " bytes"));
    }
    if (n > 0) std::memcpy(p, in_.data() + at_, n);
    at_ += n;
    return Status();
  }
  const std::vector<char>& in_;
  int from_;
  size_t at_ = 0;
};

// Rows [first, first + c) of `rows` (in token order) for each sequence of seq_len tokens: the
// sizes of the per-sequence runs.
std::vector<int64_t> RowsPerSequence(const at::Tensor& rows, int64_t seq_len) {
  std::vector<int64_t> runs;
  const at::Tensor r = rows.to(at::kCPU).contiguous();
  const int64_t* p = r.data_ptr<int64_t>();
  int64_t current = -1;
  for (int64_t i = 0; i < r.numel(); ++i) {
    const int64_t seq = p[i] / seq_len;
    if (seq != current) {
      runs.push_back(0);
      current = seq;
    }
    ++runs.back();
  }
  return runs;
}

}  // namespace

std::vector<at::Tensor> ZeroExpertOutputs(const model::ExpertCall& call) {
  std::vector<at::Tensor> out(call.inputs.size());
  for (size_t e = 0; e < call.inputs.size(); ++e) {
    if (call.inputs[e].defined()) out[e] = at::zeros_like(call.inputs[e]);
  }
  return out;
}

comm::Range ExpertsOfRank(int64_t experts, int rank, int size) {
  return comm::SliceForRank(experts, rank, size);
}

Status SizeExpertHessians(const model::DecoderBlock& block, comm::Range owned,
                          BlockHessians* h) {
  if (!block.is_moe()) {
    return absl::InvalidArgumentError(absl::StrCat("block ", block.layer(), " has no experts"));
  }
  const model::MoeWeights& moe = *block.weights().moe;
  const int64_t experts = static_cast<int64_t>(moe.experts.size());
  if (owned.begin < 0 || owned.end > experts || owned.begin > owned.end) {
    return absl::InvalidArgumentError(absl::StrCat("experts [", owned.begin, ", ", owned.end,
                                                   ") of a block of ", experts));
  }
  if (!h->route_all.empty() && static_cast<int64_t>(h->route_all.size()) != experts) {
    return absl::InvalidArgumentError(absl::StrCat("route-all flags for ", h->route_all.size(),
                                                   " experts, the block has ", experts));
  }
  if (h->experts.empty()) h->experts.resize(experts);
  if (static_cast<int64_t>(h->experts.size()) != experts) {
    return absl::InvalidArgumentError(absl::StrCat("Hessians for ", h->experts.size(),
                                                   " experts, the block has ", experts));
  }
  for (int64_t e = owned.begin; e < owned.end; ++e) {
    ExpertHessians& eh = h->experts[e];
    eh.route_all = !h->route_all.empty() && h->route_all[e];
    const model::ExpertWeights& ex = moe.experts[e];
    if (ex.linears[0] == nullptr || ex.linears[1] == nullptr || ex.linears[2] == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", block.layer(), ": expert ", e, " is not loaded in this process"));
    }
    const int64_t dims[2] = {ex.linear(model::ExpertLinear::kGate).in_features(),
                             ex.linear(model::ExpertLinear::kDown).in_features()};
    for (ExpertInput i : kExpertInputs) {
      HessianAccumulator& acc = eh.at(i);
      const int64_t n = dims[static_cast<int>(i)];
      if (acc.dim() == 0) acc = HessianAccumulator(n);
      if (acc.dim() != n) {
        return absl::InvalidArgumentError(absl::StrCat("expert ", e, " ", ExpertInputName(i),
                                                       " Hessian has dim ", acc.dim(),
                                                       ", expected ", n));
      }
    }
  }
  return Status();
}

StatusOr<std::vector<at::Tensor>> RunOwnedExperts(const model::DecoderBlock& block,
                                                  const model::ExpertCall& call, int64_t seq_len,
                                                  comm::Range owned, BlockHessians* h) {
  QCAL_RETURN_IF_ERROR(SizeExpertHessians(block, owned, h));
  const model::MoeWeights& moe = *block.weights().moe;
  const int64_t experts = static_cast<int64_t>(moe.experts.size());
  if (static_cast<int64_t>(call.inputs.size()) != experts ||
      static_cast<int64_t>(call.rows.size()) != experts) {
    return absl::InternalError(absl::StrCat("an expert call for ", call.inputs.size(),
                                            " experts, the block has ", experts));
  }
  if (seq_len < 1) return absl::InternalError("an expert call without sequences");
  std::vector<at::Tensor> out(experts);
  // Llama 4's logits for the route-all inputs' scales: made once per call, as the block's
  // router makes them.
  const bool scaled_input = block.router_kind() == RouterKind::kSigmoidTopKInput;
  at::Tensor logits;
  for (int64_t e = owned.begin; e < owned.end; ++e) {
    ExpertHessians& eh = h->experts[e];
    const model::ExpertWeights& ex = moe.experts[e];
    const model::Linear& gate = ex.linear(model::ExpertLinear::kGate);
    const model::Linear& up = ex.linear(model::ExpertLinear::kUp);
    const model::Linear& down = ex.linear(model::ExpertLinear::kDown);
    const at::Tensor& in = call.inputs[e];
    if (in.defined() && in.size(0) > 0) {
      // The block's expert forward (model::ExpertForward), its two inputs kept.
      const at::Tensor down_in = at::silu(gate.Forward(in)) * up.Forward(in);
      out[e] = down.Forward(down_in);
      eh.routed_tokens += in.size(0);
      if (!eh.route_all) {
        int64_t first = 0;
        for (int64_t c : RowsPerSequence(call.rows[e], seq_len)) {
          Status added = eh.at(ExpertInput::kGateUp).Add(in.narrow(0, first, c));
          if (!added.ok()) {
            return Annotate(added, absl::StrCat("expert ", e, " gate_up input"));
          }
          added = eh.at(ExpertInput::kDown).Add(down_in.narrow(0, first, c));
          if (!added.ok()) return Annotate(added, absl::StrCat("expert ", e, " down input"));
          first += c;
        }
      }
    }
    if (!eh.route_all) continue;
    if (!call.h.defined() || call.h.dim() != 3) {
      return absl::InternalError(absl::StrCat(
          "expert ", e, " calibrates on every token, but the call has no [seqs, seq, hidden] "
          "hidden state"));
    }
    const at::Tensor& hx = call.h;
    at::Tensor all = hx;
    if (scaled_input) {
      if (!logits.defined()) logits = model::LinearRows(hx.reshape({-1, hx.size(-1)}), moe.router);
      all = hx * at::sigmoid(logits.select(1, e)).view({hx.size(0), hx.size(1), 1});
    }
    const at::Tensor down_all = at::silu(gate.Forward(all)) * up.Forward(all);
    Status added = eh.at(ExpertInput::kGateUp).Add(all);
    if (added.ok()) added = eh.at(ExpertInput::kDown).Add(down_all);
    if (!added.ok()) return Annotate(added, absl::StrCat("expert ", e, " (every token)"));
  }
  return out;
}

ExpertExchange::ExpertExchange(comm::Comm& comm, const model::DecoderBlock& block,
                               BlockHessians* h)
    : comm_(comm),
      block_(block),
      h_(h),
      experts_(block.is_moe() ? static_cast<int64_t>(block.weights().moe->experts.size()) : 0),
      hidden_(block.is_moe() ? block.weights().moe->router.size(1) : 0) {
  for (int r = 0; r < comm.size(); ++r) {
    ranges_.push_back(ExpertsOfRank(experts_, r, comm.size()));
    bool wants = false;
    for (int64_t e = ranges_.back().begin; e < ranges_.back().end; ++e) {
      wants = wants || (!h->route_all.empty() && h->route_all[e]);
    }
    wants_h_.push_back(wants);
  }
  owned_ = ranges_[comm.rank()];
}

std::vector<at::Tensor> ExpertExchange::Run(const model::ExpertCall& call, int64_t seq_len) {
  if (exchanged_) {
    // A second call in one step would pair with the others' next exchange: refuse it locally
    // (the step then fails on every rank through FinishStep's status).
    if (status_.ok()) {
      status_ = absl::InternalError("expert exchange: two forward calls in one calibration step");
    }
    return ZeroExpertOutputs(call);
  }
  return Exchange(&call, seq_len);
}

Status ExpertExchange::FinishStep() {
  if (!exchanged_) (void)Exchange(nullptr, 0);
  exchanged_ = false;
  return std::exchange(status_, Status());
}

std::vector<at::Tensor> ExpertExchange::Exchange(const model::ExpertCall* call,
                                                 int64_t seq_len) {
  exchanged_ = true;
  const int n = comm_.size(), me = comm_.rank();
  auto fail = [&](const Status& s) {
    if (status_.ok()) status_ = s;
  };
  if (call != nullptr && (static_cast<int64_t>(call->inputs.size()) != experts_ ||
                          static_cast<int64_t>(call->rows.size()) != experts_)) {
    fail(absl::InternalError("expert exchange: a call for another number of experts"));
    call = nullptr;
  }
  // To each owner: [has call, h dims..., seq_len, whether h follows, h, then per owned expert
  // its row count, rows and inputs]. This rank's own experts run on its call directly.
  std::vector<std::vector<char>> send(n), got;
  if (call != nullptr) {
    for (int o = 0; o < n; ++o) {
      if (o == me) continue;
      Writer w(&send[o]);
      w.I64(1);
      w.I64(call->h.dim());
      for (int64_t d : call->h.sizes()) w.I64(d);
      w.I64(seq_len);
      w.I64(wants_h_[o] ? 1 : 0);
      if (wants_h_[o]) w.Values(call->h.to(at::kFloat));
      for (int64_t e = ranges_[o].begin; e < ranges_[o].end; ++e) {
        const at::Tensor& in = call->inputs[e];
        const int64_t m = in.defined() ? in.size(0) : 0;
        w.I64(m);
        if (m == 0) continue;
        w.Values(call->rows[e].to(at::kCPU, at::kLong));
        w.Values(in.to(at::kCPU, at::kFloat));
      }
    }
  }
  Status sent = comm::AllToAll(comm_, send, &got);
  send.assign(n, {});
  if (!sent.ok()) {
    fail(Annotate(sent, "expert exchange"));
    return call != nullptr ? ZeroExpertOutputs(*call) : std::vector<at::Tensor>();
  }
  // This rank's experts on every rank's rows, in rank order.
  std::vector<at::Tensor> mine;  // its own call's outputs of its experts
  std::vector<std::vector<char>> back(n);
  for (int s = 0; s < n; ++s) {
    if (s == me) {
      if (call == nullptr) continue;
      StatusOr<std::vector<at::Tensor>> outs = RunOwnedExperts(block_, *call, seq_len, owned_, h_);
      if (!outs.ok()) fail(outs.status());
      mine = outs.ok() ? *std::move(outs) : ZeroExpertOutputs(*call);
      continue;
    }
    if (got[s].empty()) continue;
    // Parse rank s's rows of this rank's experts.
    Reader r(got[s], s);
    model::ExpertCall theirs;
    theirs.rows.resize(experts_);
    theirs.inputs.resize(experts_);
    std::vector<int64_t> counts(experts_, 0);
    int64_t their_seq = 0;
    const Status parsed = [&]() -> Status {
      QCAL_ASSIGN_OR_RETURN(const int64_t has, r.I64());
      if (has != 1) return absl::InternalError("expert exchange: a malformed message");
      QCAL_ASSIGN_OR_RETURN(const int64_t dims, r.I64());
      if (dims < 1 || dims > 8) return absl::InternalError("expert exchange: a malformed shape");
      std::vector<int64_t> shape(dims);
      for (int64_t& d : shape) {
        QCAL_ASSIGN_OR_RETURN(d, r.I64());
        if (d < 0) return absl::InternalError("expert exchange: a malformed shape");
      }
      QCAL_ASSIGN_OR_RETURN(their_seq, r.I64());
      QCAL_ASSIGN_OR_RETURN(const int64_t with_h, r.I64());
      if (with_h == 1) {
        QCAL_ASSIGN_OR_RETURN(theirs.h, r.Values(shape, at::kFloat));
      }
      for (int64_t e = owned_.begin; e < owned_.end; ++e) {
        QCAL_ASSIGN_OR_RETURN(counts[e], r.I64());
        if (counts[e] < 0) return absl::InternalError("expert exchange: a malformed row count");
        if (counts[e] == 0) continue;
        QCAL_ASSIGN_OR_RETURN(theirs.rows[e], r.Values({counts[e]}, at::kLong));
        QCAL_ASSIGN_OR_RETURN(theirs.inputs[e], r.Values({counts[e], hidden_}, at::kFloat));
      }
      if (!r.done()) return absl::InternalError("expert exchange: trailing bytes in a message");
      return Status();
    }();
    got[s] = {};
    std::vector<at::Tensor> outs;
    if (parsed.ok()) {
      StatusOr<std::vector<at::Tensor>> ran =
          RunOwnedExperts(block_, theirs, their_seq, owned_, h_);
      if (ran.ok()) {
        outs = *std::move(ran);
      } else {
        fail(ran.status());
      }
    } else {
      fail(Annotate(parsed, absl::StrCat("from rank ", s)));
    }
    // The outputs in expert order (zeros after a failure, so the sender's forward finishes).
    Writer w(&back[s]);
    for (int64_t e = owned_.begin; e < owned_.end; ++e) {
      if (counts[e] == 0) continue;
      const bool have = e < static_cast<int64_t>(outs.size()) && outs[e].defined() &&
                        outs[e].numel() == counts[e] * hidden_;
      w.Values(have ? outs[e].to(at::kFloat) : at::zeros({counts[e], hidden_}, at::kFloat));
    }
  }
  Status returned = comm::AllToAll(comm_, back, &got);
  back.assign(n, {});
  if (call == nullptr) return {};
  if (!returned.ok()) {
    fail(Annotate(returned, "expert exchange (outputs)"));
    return ZeroExpertOutputs(*call);
  }
  std::vector<at::Tensor> outputs(experts_);
  for (int64_t e = owned_.begin; e < owned_.end; ++e) {
    if (e < static_cast<int64_t>(mine.size())) outputs[e] = std::move(mine[e]);
  }
  for (int o = 0; o < n; ++o) {
    if (o == me) continue;
    Reader r(got[o], o);
    for (int64_t e = ranges_[o].begin; e < ranges_[o].end; ++e) {
      const at::Tensor& in = call->inputs[e];
      if (!in.defined() || in.size(0) == 0) continue;
      StatusOr<at::Tensor> y = r.Values({in.size(0), hidden_}, at::kFloat);
      if (!y.ok()) {
        fail(y.status());
        outputs[e] = at::zeros_like(in);
        continue;
      }
      outputs[e] = *std::move(y);
    }
    if (status_.ok() && !r.done()) {
      fail(absl::InternalError(absl::StrCat("expert exchange: trailing bytes from rank ", o)));
    }
  }
  return outputs;
}

}  // namespace qcal::calib
