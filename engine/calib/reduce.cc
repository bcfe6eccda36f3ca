#include "engine/calib/reduce.h"

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::calib {

namespace {

// The reduction's head: each kind's row count summed over the ranks (head[3k]), and a check that
// every rank holds the same dimensions. Every rank sees the same sums, so all agree whether the
// dimensions match (they all do iff size·Σd² = (Σd)²). counts[k]: this rank's rows of kind k.
Status ReduceHessianHead(comm::Comm& comm, const BlockHessians& h,
                         const std::array<int64_t, 4>& counts, std::vector<int64_t>* head) {
  head->clear();
  for (size_t ki = 0; ki < 4; ++ki) {
    const int64_t dim = h.at(kAllHessianKinds[ki]).dim();
    head->insert(head->end(), {counts[ki], dim, dim * dim});
  }
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(head->data(), head->size()));
  for (size_t ki = 0; ki < 4; ++ki) {
    const int64_t sum = (*head)[3 * ki + 1], sum_sq = (*head)[3 * ki + 2];
    if (comm.size() * sum_sq != sum * sum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Hessian reduction: ranks hold ", HessianKindName(kAllHessianKinds[ki]),
          " Hessians of different dimensions (this rank: ", h.at(kAllHessianKinds[ki]).dim(),
          ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Sums one accumulator's values over the ranks in place (fixed-point digits through
// AllReduceSum(int64), in pieces: 32 bytes per value in flight); `count`: the reduced row count.
Status ReduceAccumulator(comm::Comm& comm, HessianAccumulator* acc, int64_t count,
                         const std::string& what) {
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<int64_t> limbs;
  const int64_t dim = acc->dim();
  std::vector<Fixed128> total = acc->ReleasePacked();  // reduced in place, no copy
  for (size_t off = 0; off < total.size(); off += kPiece) {
    const size_t m = std::min(kPiece, total.size() - off);
    limbs.resize(4 * m);
    HessianAccumulator::SplitDigits(total.data() + off, m, limbs.data());
    QCAL_RETURN_IF_ERROR(comm.AllReduceSum(limbs.data(), limbs.size()));
    QCAL_RETURN_IF_ERROR(Annotate(
        HessianAccumulator::CombineDigits(limbs.data(), m, total.data() + off), what));
  }
  QCAL_ASSIGN_OR_RETURN(*acc, HessianAccumulator::FromFixed(dim, std::move(total), count));
  return absl::OkStatus();
}

// A MoE block's experts: per expert its routed tokens, route-all flag, both inputs' row counts
// and dimensions (checked equal on every rank, as the dense head), then the sums.
Status ReduceExperts(comm::Comm& comm, BlockHessians* h) {
  std::vector<int64_t> head = {static_cast<int64_t>(h->experts.size())};
  for (const ExpertHessians& e : h->experts) {
    head.insert(head.end(), {e.routed_tokens, e.route_all ? 1 : 0});
    for (ExpertInput i : kExpertInputs) {
      const int64_t dim = e.at(i).dim();
      head.insert(head.end(), {e.at(i).count(), dim, dim * dim});
    }
  }
  // Every rank must hold the same number of experts before the per-expert head is reduced.
  int64_t n[2] = {head[0], head[0] * head[0]};
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(n, 2));
  if (comm.size() * n[1] != n[0] * n[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Hessian reduction: ranks hold different numbers of experts (this rank: ", head[0], ")"));
  }
  if (h->experts.empty()) return absl::OkStatus();
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(head.data() + 1, head.size() - 1));
  for (size_t e = 0; e < h->experts.size(); ++e) {
    const int64_t* v = head.data() + 1 + 8 * e;
    ExpertHessians& eh = h->experts[e];
    if (v[1] != 0 && v[1] != comm.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Hessian reduction: expert ", e, " calibrates on every token on some ranks only"));
    }
    eh.routed_tokens = v[0];
    for (ExpertInput i : kExpertInputs) {
      const int64_t* d = v + 2 + 3 * static_cast<int>(i);
      if (comm.size() * d[2] != d[1] * d[1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Hessian reduction: ranks hold expert ", e, " ", ExpertInputName(i),
            " Hessians of different dimensions (this rank: ", eh.at(i).dim(), ")"));
      }
      QCAL_RETURN_IF_ERROR(ReduceAccumulator(
          comm, &eh.at(i), d[0], absl::StrCat("expert ", e, " ", ExpertInputName(i))));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status AllReduceHessians(comm::Comm& comm, BlockHessians* h) {
  if (comm.size() == 1) return absl::OkStatus();
  std::array<int64_t, 4> counts;
  for (size_t ki = 0; ki < 4; ++ki) counts[ki] = h->at(kAllHessianKinds[ki]).count();
  std::vector<int64_t> head;
  QCAL_RETURN_IF_ERROR(ReduceHessianHead(comm, *h, counts, &head));
  for (size_t ki = 0; ki < 4; ++ki) {
    QCAL_RETURN_IF_ERROR(ReduceAccumulator(comm, &h->at(kAllHessianKinds[ki]), head[3 * ki],
                                           HessianKindName(kAllHessianKinds[ki])));
  }
  return ReduceExperts(comm, h);
}

Status AllReduceDeviceHessians(comm::Comm& comm, const kernels::DeviceInt64Sum& device_sum,
                               bool download, BlockHessians* h, int64_t* rows) {
  if (!h->experts.empty()) {
    return absl::FailedPreconditionError(
        "a mixture-of-experts block's expert sums are on the host: reduce them with "
        "AllReduceHessians");
  }
  kernels::GpuBackend* gpu = h->backend;
  if (gpu == nullptr || !device_sum) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device Hessian reduction needs a GPU backend and a device all-reduce (this rank has ",
        gpu == nullptr ? "no GPU backend" : "no device all-reduce", ")"));
  }
  // A rank without sequences has sized accumulators but no device sums: zero ones.
  Status local;
  for (HessianKind k : kAllHessianKinds) {
    auto& d = h->device[static_cast<int>(k)];
    if (d != nullptr || !local.ok()) continue;
    auto made = gpu->NewHessian(h->at(k).dim());
    if (made.ok()) {
      d = std::move(*made);
    } else {
      local = Annotate(made.status(), absl::StrCat(HessianKindName(k), " input (GPU)"));
    }
  }
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, "device Hessian sums"));
  // Counts and dimensions on the hosts.
  std::array<int64_t, 4> counts;
  for (size_t ki = 0; ki < 4; ++ki) counts[ki] = h->device[ki]->count();
  std::vector<int64_t> head;
  QCAL_RETURN_IF_ERROR(ReduceHessianHead(comm, *h, counts, &head));
  // The sums where they are. A failure inside a collective is not agreed on: the worker ends
  // the job (its ranks cannot continue a half-done all-reduce).
  for (size_t ki = 0; ki < 4; ++ki) {
    const HessianKind k = kAllHessianKinds[ki];
    QCAL_RETURN_IF_ERROR(Annotate(h->device[ki]->AllReduce(device_sum, head[3 * ki]),
                                  absl::StrCat(HessianKindName(k), " input (device reduction)")));
  }
  if (rows != nullptr) *rows = head[0];
  if (download) return FlushDeviceHessians(h);
  for (HessianKind k : kAllHessianKinds) h->device[static_cast<int>(k)].reset();
  h->device_block.reset();
  h->device_block_key = nullptr;
  return absl::OkStatus();
}

Status AgreeOk(comm::Comm& comm, const Status& local, const std::string& what) {
  int64_t failed = local.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!local.ok()) return local;
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat(what, ": another rank failed (see its error)"));
  }
  return absl::OkStatus();
}


StatusOr<at::Tensor> GatherSequences(comm::Comm& comm, const at::Tensor& mine) {
  const int64_t seq = mine.size(1), n = mine.size(2);
  auto buffer = std::make_shared<std::vector<char>>();
  QCAL_RETURN_IF_ERROR(comm::AllGather(comm, mine.data_ptr(), mine.numel() * sizeof(float),
                                          buffer.get()));
  const int64_t row_bytes = seq * n * static_cast<int64_t>(sizeof(float));
  if (buffer->empty() || row_bytes == 0) return at::empty({0, seq, n}, at::kFloat);
  const int64_t rows = static_cast<int64_t>(buffer->size()) / row_bytes;
  return at::from_blob(
      buffer->data(), {rows, seq, n}, [buffer](void*) {}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace qcal::calib
