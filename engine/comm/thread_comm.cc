// ThreadComm: N ranks as N threads of one process (c10d-style threads-as-ranks for unit tests).
//
// Every collective is two rendezvous on a shared group: each rank posts its buffer and call
// signature, waits for all (1), checks that every rank made the same call, reads what it needs
// from the other ranks' buffers into private memory, waits again (2) so no buffer is written
// while another rank may still read it, then writes its own buffer. Sums add the ranks' values
// in rank order on every rank, so all ranks get identical bits. A mismatched call (different
// collective, count or root) is InvalidArgument on every rank; a rank whose communicator is
// destroyed breaks the group, so the others' pending and later collectives return Aborted
// instead of hanging.
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "engine/comm/comm.h"

namespace qcal::comm {
namespace {

enum class Op { kSumI64, kSumF64, kBroadcast, kGather, kBarrier };

const char* OpName(Op op) {
  switch (op) {
    case Op::kSumI64: return "AllReduceSum(int64)";
    case Op::kSumF64: return "AllReduceSum(double)";
    case Op::kBroadcast: return "Broadcast";
    case Op::kGather: return "Gather";
    case Op::kBarrier: return "Barrier";
  }
  return "?";
}

struct Post {
  Op op = Op::kBarrier;
  const void* data = nullptr;
  size_t count = 0;  // elements (sums), bytes (broadcast, gather)
  int root = 0;
};

struct Group {
  explicit Group(int n) : size(n), posts(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;          // guarded by mu
  uint64_t generation = 0;  // guarded by mu
  bool broken = false;      // guarded by mu
  std::string why;          // guarded by mu
  std::vector<Post> posts;  // slot r written by rank r before rendezvous 1, read after it
};

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  ~ThreadComm() override {
    std::lock_guard<std::mutex> lock(group_->mu);
    if (!group_->broken) {
      group_->broken = true;
      group_->why = absl::StrCat("thread rank ", rank_, " left the group");
    }
    group_->cv.notify_all();
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  std::string name() const override { return "threads"; }

  Status AllReduceSum(int64_t* data, size_t count) override {
    return Sum<int64_t>(Op::kSumI64, data, count);
  }
  Status AllReduceSum(double* data, size_t count) override {
    return Sum<double>(Op::kSumF64, data, count);
  }

  Status Broadcast(void* data, size_t bytes, int root) override {
    QCAL_RETURN_IF_ERROR(CheckRoot(root));
    QCAL_RETURN_IF_ERROR(Enter({Op::kBroadcast, data, bytes, root}));
    if (rank_ != root && bytes > 0) std::memcpy(data, group_->posts[root].data, bytes);
    return Rendezvous();  // the root's buffer stays untouched until every rank copied it
  }

  Status Gather(const void* data, size_t bytes, int root, std::vector<char>* out) override {
    QCAL_RETURN_IF_ERROR(CheckRoot(root));
    // Sizes may differ per rank, so the count is not part of the signature check.
    QCAL_RETURN_IF_ERROR(Enter({Op::kGather, data, bytes, root}, /*check_count=*/false));
    if (rank_ == root) {
      size_t total = 0;
      for (const Post& p : group_->posts) total += p.count;
      out->resize(total);
      size_t offset = 0;
      for (const Post& p : group_->posts) {
        if (p.count > 0) std::memcpy(out->data() + offset, p.data, p.count);
        offset += p.count;
      }
    }
    return Rendezvous();
  }

  Status Barrier() override {
    QCAL_RETURN_IF_ERROR(Enter({Op::kBarrier, nullptr, 0, 0}));
    return Rendezvous();  // no rank posts its next call while another still checks this one
  }

 private:
  template <typename T>
  Status Sum(Op op, T* data, size_t count) {
    QCAL_RETURN_IF_ERROR(Enter({op, data, count, 0}));
    std::vector<T> acc(count, T(0));
    for (const Post& p : group_->posts) {
      const T* v = static_cast<const T*>(p.data);
      for (size_t i = 0; i < count; ++i) acc[i] += v[i];
    }
    QCAL_RETURN_IF_ERROR(Rendezvous());
    if (count > 0) std::memcpy(data, acc.data(), count * sizeof(T));
    return absl::OkStatus();
  }

  Status CheckRoot(int root) const {
    if (root < 0 || root >= group_->size) {
      return absl::InvalidArgumentError(
          absl::StrCat("thread comm: root ", root, " is not a rank of ", group_->size));
    }
    return absl::OkStatus();
  }

  // Posts this rank's call, waits for every rank and checks they made the same call.
  Status Enter(const Post& post, bool check_count = true) {
    group_->posts[rank_] = post;
    QCAL_RETURN_IF_ERROR(Rendezvous());
    for (int r = 0; r < group_->size; ++r) {
      const Post& p = group_->posts[r];
      if (p.op != post.op || p.root != post.root || (check_count && p.count != post.count)) {
        const Status s = absl::InvalidArgumentError(absl::StrCat(
            "thread comm: rank ", rank_, " called ", OpName(post.op), " (count ", post.count,
            ", root ", post.root, ") but rank ", r, " called ", OpName(p.op), " (count ",
            p.count, ", root ", p.root, ")"));
        // Every rank sees the mismatch here; break the group so nobody waits on a later call.
        Break(std::string(s.message()));
        return s;
      }
    }
    return absl::OkStatus();
  }

  Status Rendezvous() {
    Group& g = *group_;
    std::unique_lock<std::mutex> lock(g.mu);
    if (g.broken) return absl::AbortedError(absl::StrCat("thread comm broken: ", g.why));
    const uint64_t gen = g.generation;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      ++g.generation;
      g.cv.notify_all();
      return absl::OkStatus();
    }
    g.cv.wait(lock, [&] { return g.generation != gen || g.broken; });
    if (g.generation != gen) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat("thread comm broken: ", g.why));
  }

  void Break(const std::string& why) {
    std::lock_guard<std::mutex> lock(group_->mu);
    if (!group_->broken) {
      group_->broken = true;
      group_->why = why;
    }
    group_->cv.notify_all();
  }

  std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> MakeThreadComms(int n) {
  std::vector<std::unique_ptr<Comm>> comms;
  if (n < 1) return comms;
  auto group = std::make_shared<Group>(n);
  for (int r = 0; r < n; ++r) comms.push_back(std::make_unique<ThreadComm>(group, r));
  return comms;
}

}  // namespace qcal::comm
