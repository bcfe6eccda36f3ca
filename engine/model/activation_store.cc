#include "engine/model/activation_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/io_util.h"
#include "common/safe_fs.h"

namespace qcal::model {
namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The errno of the failed call, with the free space when the disk is full (io::ErrnoError: the
// one message every file a job writes gives).
Status IoError(const std::string& path, const char* what) {
  return io::ErrnoError(errno, path, what);
}

int64_t EnvInt(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : 0;
}

}  // namespace

StatusOr<std::unique_ptr<ActivationStore>> ActivationStore::Create(
    std::vector<std::vector<int64_t>> shapes, int64_t budget_bytes,
    const std::string& spill_path) {
  std::unique_ptr<ActivationStore> s(new ActivationStore());
  s->shapes_ = std::move(shapes);
  s->written_.assign(s->shapes_.size(), false);
  for (const auto& shape : s->shapes_) {
    s->offsets_.push_back(s->total_bytes_);
    s->total_bytes_ += Numel(shape) * static_cast<int64_t>(sizeof(float));
  }
  if (s->total_bytes_ <= budget_bytes) {
    s->held_.resize(s->shapes_.size());
    return s;
  }
  s->path_ = spill_path;
  QCAL_ASSIGN_OR_RETURN(s->fd_, OpenNoFollow(spill_path, O_RDWR | O_CREAT | O_TRUNC, 0600,
                                             "cannot create the activation spill file"));
  return s;
}

ActivationStore::~ActivationStore() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
}

StatusOr<at::Tensor> ActivationStore::Get(int64_t c) const {
  if (c < 0 || c >= chunks() || !written_[c]) {
    return absl::FailedPreconditionError(absl::StrCat("activation chunk ", c, " was not written"));
  }
  if (!spilled()) return held_[c];
  at::Tensor t = at::empty(shapes_[c], at::kFloat);
  char* p = static_cast<char*>(t.data_ptr());
  size_t left = t.numel() * sizeof(float);
  off_t off = offsets_[c];
  while (left > 0) {
    const ssize_t n = ::pread(fd_, p, left, off);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return IoError(path_, "cannot read spilled activations");
    }
    p += n;
    left -= static_cast<size_t>(n);
    off += n;
  }
  return t;
}

Status ActivationStore::Put(int64_t c, const at::Tensor& x) {
  if (c < 0 || c >= chunks()) {
    return absl::OutOfRangeError(absl::StrCat("activation chunk ", c, " of ", chunks()));
  }
  if (x.sizes().vec() != shapes_[c]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activation chunk ", c, " is [", absl::StrJoin(x.sizes().vec(), ", "), "], declared [",
        absl::StrJoin(shapes_[c], ", "), "]"));
  }
  const at::Tensor t = x.detach().to(at::kCPU, at::kFloat).contiguous();
  written_[c] = true;
  if (!spilled()) {
    held_[c] = t;
    return Status();
  }
  const char* p = static_cast<const char*>(t.data_ptr());
  size_t left = t.numel() * sizeof(float);
  off_t off = offsets_[c];
  while (left > 0) {
    const ssize_t n = ::pwrite(fd_, p, left, off);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return IoError(path_, "cannot write spilled activations");
    }
    p += n;
    left -= static_cast<size_t>(n);
    off += n;
  }
  return Status();
}

int64_t DefaultMaxMemory() {
  const int64_t pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const int64_t physical = pages > 0 && page > 0 ? pages * page : (int64_t{8} << 30);
  int64_t local = EnvInt("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local <= 0) local = EnvInt("SLURM_NTASKS_PER_NODE");
  if (local <= 0) local = 1;
  return physical / 2 / local;
}

}  // namespace qcal::model
