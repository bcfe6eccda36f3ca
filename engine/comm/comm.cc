// SelfComm (a world of one) and SliceForRank.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/comm/comm.h"

namespace qcal::comm {
namespace {

class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "self"; }
  Status AllReduceSum(int64_t*, size_t) override { return absl::OkStatus(); }
  Status AllReduceSum(double*, size_t) override { return absl::OkStatus(); }
  Status Broadcast(void*, size_t, int root) override { return CheckRoot(root); }
  Status Gather(const void* data, size_t bytes, int root, std::vector<char>* out) override {
    QCAL_RETURN_IF_ERROR(CheckRoot(root));
    const char* p = static_cast<const char*>(data);
    out->assign(p, p + bytes);
    return absl::OkStatus();
  }
  Status Barrier() override { return absl::OkStatus(); }

 private:
  static Status CheckRoot(int root) {
    if (root != 0) {
      return absl::InvalidArgumentError(absl::StrCat("self comm: root ", root, " is not rank 0"));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Comm> MakeSelfComm() { return std::make_unique<SelfComm>(); }

Status AllGather(Comm& comm, const void* data, size_t bytes, std::vector<char>* out,
                 std::vector<size_t>* sizes) {
  const int n = comm.size(), me = comm.rank();
  std::vector<int64_t> counts(n, 0);
  counts[me] = static_cast<int64_t>(bytes);
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(counts.data(), counts.size()));
  size_t total = 0;
  std::vector<size_t> offsets(n);
  for (int r = 0; r < n; ++r) {
    if (counts[r] < 0) {
      return absl::InternalError(absl::StrCat("AllGather: rank ", r, " sends ", counts[r],
                                              " bytes"));
    }
    offsets[r] = total;
    total += static_cast<size_t>(counts[r]);
  }
  out->resize(total);
  if (bytes > 0) std::memcpy(out->data() + offsets[me], data, bytes);
  for (int r = 0; r < n; ++r) {
    if (counts[r] == 0) continue;  // every rank knows the counts: all skip the same roots
    QCAL_RETURN_IF_ERROR(
        comm.Broadcast(out->data() + offsets[r], static_cast<size_t>(counts[r]), r));
  }
  if (sizes != nullptr) sizes->assign(counts.begin(), counts.end());
  return absl::OkStatus();
}

Status AllToAll(Comm& comm, const std::vector<std::vector<char>>& send,
                std::vector<std::vector<char>>* recv) {
  const int n = comm.size(), me = comm.rank();
  if (static_cast<int>(send.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("AllToAll: ", send.size(), " messages for ",
                                                   n, " ranks"));
  }
  // counts[s * n + d]: the bytes rank s sends rank d (every rank fills its row).
  std::vector<int64_t> counts(static_cast<size_t>(n) * n, 0);
  for (int d = 0; d < n; ++d) counts[static_cast<size_t>(me) * n + d] = send[d].size();
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(counts.data(), counts.size()));
  recv->assign(n, {});
  std::vector<char> gathered;
  for (int d = 0; d < n; ++d) {
    int64_t to_d = 0;
    for (int s = 0; s < n; ++s) to_d += counts[static_cast<size_t>(s) * n + d];
    if (to_d == 0) continue;  // every rank knows the counts: all skip the same roots
    QCAL_RETURN_IF_ERROR(comm.Gather(send[d].data(), send[d].size(), d, &gathered));
    if (d != me) continue;
    if (static_cast<int64_t>(gathered.size()) != to_d) {
      return absl::InternalError(absl::StrCat("AllToAll: rank ", me, " received ",
                                              gathered.size(), " bytes, expected ", to_d));
    }
    size_t at = 0;
    for (int s = 0; s < n; ++s) {
      const size_t c = static_cast<size_t>(counts[static_cast<size_t>(s) * n + d]);
      (*recv)[s].assign(gathered.data() + at, gathered.data() + at + c);
      at += c;
    }
    gathered = {};
  }
  return absl::OkStatus();
}

Range SliceForRank(int64_t total, int rank, int size) {
  Range r;
  if (total <= 0 || size <= 0 || rank < 0 || rank >= size) return r;
  const int64_t base = total / size, extra = total % size;
  r.begin = rank * base + std::min<int64_t>(rank, extra);
  r.end = r.begin + base + (rank < extra ? 1 : 0);
  return r;
}

}  // namespace qcal::comm
