#include "worker/calib/calibration.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <algorithm>
#include <random>
#include <unordered_set>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/io_util.h"
#include "common/safetensors.h"
#include "common/log.h"
#include "common/text.h"
#include "worker/model/activation_store.h"
#include "worker/model/tensor_io.h"

namespace qcal::calib {
namespace {

std::string Resolve(const std::string& data_root, const std::string& file) {
  if (!file.empty() && file[0] == '/') return file;
  return data_root + "/" + file;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// The cache format written by SaveBlockHessians (files without it hold fp64 sums: stale).
constexpr char kHessianFormat[] = "3";

}  // namespace

StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id) {
  if (spec.files.empty()) return absl::InvalidArgumentError("calibration: no files given");
  if (seq_len < 2) return absl::InvalidArgumentError("calibration: seq_len must be >= 2");
  std::string text;
  std::vector<std::string> paths;
  for (const std::string& f : spec.files) {
    paths.push_back(Resolve(data_root, f));
    QCAL_ASSIGN_OR_RETURN(std::string t, ReadTextFile(paths.back()));
    QCAL_RETURN_IF_ERROR(CheckLooksLikeText(paths.back(), t));
    if (!text.empty()) text += "\n\n";
    text += t;
  }
  const std::string files = absl::StrJoin(paths, ", ");
  const std::vector<int32_t> ids = tokenizer.Encode(text);
  const int64_t window = seq_len - 1;
  if (static_cast<int64_t>(ids.size()) <= window) {
    return absl::InvalidArgumentError(absl::StrCat("calibration text (", files, ") gives ",
                                                   ids.size(),
                                                   " tokens, fewer than one sequence of ",
                                                   seq_len));
  }
  // Text of a handful of distinct tokens (a repeated line, a wrong file) calibrates nothing
  // useful; it is not an error, but the user should know.
  const std::unordered_set<int32_t> distinct(ids.begin(), ids.end());
  const int64_t expected = std::min<int64_t>(100, tokenizer.vocab_size() / 4);
  if (static_cast<int64_t>(distinct.size()) < expected) {
    QCAL_LOG_WARN("calibration text ({}) uses only {} distinct tokens of a vocabulary of {}: "
                  "Hessians from it will not represent real inputs",
                  files, distinct.size(), tokenizer.vocab_size());
  }
  std::mt19937_64 rng(spec.seed);
  std::uniform_int_distribution<int64_t> offset(0, static_cast<int64_t>(ids.size()) - window - 1);
  at::Tensor tokens = at::empty({spec.num_sequences, seq_len}, at::kLong);
  auto acc = tokens.accessor<int64_t, 2>();
  for (int64_t s = 0; s < spec.num_sequences; ++s) {
    const int64_t start = offset(rng);
    acc[s][0] = bos_id;
    for (int64_t j = 0; j < window; ++j) acc[s][j + 1] = ids[start + j];
  }
  return tokens;
}

std::string CalibrationKey(const std::string& inputs_key, const LlamaConfig& config,
                           const CalibrationSpec& spec, int64_t seq_len) {
  std::string canon = absl::StrCat("inputs=", inputs_key, "|", LlamaConfigToJson(config).dump());
  for (const std::string& f : spec.files) absl::StrAppend(&canon, "|data:", f);
  absl::StrAppend(&canon, "|n=", spec.num_sequences, "|len=", seq_len, "|seed=", spec.seed);
  return Fnv1aHex(canon);
}

std::string HessianPath(const std::string& job_dir, int64_t block) {
  return absl::StrCat(job_dir, "/hessians/block_", block, ".safetensors");
}

std::string ActivationPath(const std::string& job_dir, int64_t boundary) {
  return absl::StrCat(job_dir, "/activations/block_", boundary, ".safetensors");
}

std::string CacheChecksumPath(const std::string& path) { return path + ".fnv1a64"; }

Status WriteCacheChecksum(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string sum, FileFnv1aHex(path));
  return WriteFileAtomic(CacheChecksumPath(path), sum + "\n");
}

Status VerifyCacheChecksum(const std::string& path) {
  const std::string sidecar = CacheChecksumPath(path);
  StatusOr<std::string> want = ReadFile(sidecar);
  if (!want.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": no checksum (", sidecar, " is missing: written by an older qcal, or the "
        "write was interrupted); recomputing"));
  }
  const std::string expected = want->substr(0, want->find('\n'));
  QCAL_ASSIGN_OR_RETURN(std::string got, FileFnv1aHex(path));
  if (got != expected) {
    return absl::DataLossError(absl::StrCat(path, ": checksum ", got, " does not match ",
                                            io::Printable(expected), " in ", sidecar,
                                            ": the cached file is damaged; recomputing"));
  }
  return absl::OkStatus();
}

Status SaveBlockHessians(const std::string& path, const BlockHessians& h, const std::string& key) {
  static_assert(sizeof(Fixed128) == 2 * sizeof(int64_t), "int128 is two int64 words");
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  writer.SetMetadata("hessian_format", kHessianFormat);
  writer.SetMetadata("hessian_frac_bits", std::to_string(kHessianFracBits));
  for (HessianKind k : kAllHessianKinds) {
    const HessianAccumulator& acc = h.at(k);
    const std::string base = HessianKindName(k);
    const std::vector<Fixed128>* packed = &acc.packed();
    // Streamed from the accumulator: no copy of the sums (6.6 GB at a 70B down_proj).
    QCAL_RETURN_IF_ERROR(writer.AddStreamed(
        base + ".fixed", DType::kI64, {static_cast<int64_t>(packed->size()), 2},
        [packed](const SafetensorsWriter::ByteSink& sink) {
          return sink(packed->data(), packed->size() * sizeof(Fixed128));
        }));
    const int64_t n = acc.dim();
    QCAL_RETURN_IF_ERROR(writer.Add(base + ".dim", DType::kI64, {}, &n, sizeof(n)));
    const int64_t count = acc.count();
    QCAL_RETURN_IF_ERROR(writer.Add(base + ".count", DType::kI64, {}, &count, sizeof(count)));
  }
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return WriteCacheChecksum(path);
}

namespace {

// A block's Hessian cache file, mapped: each kind's mean from its stored sums, their pages
// released after each use.
class MappedHessianFile final : public StoredHessianSums {
 public:
  struct Kind {
    int64_t n = 0, count = 0;
    const TensorInfo* fixed = nullptr;
  };
  MappedHessianFile(std::unique_ptr<SafetensorsFile> file, std::array<Kind, 4> kinds)
      : file_(std::move(file)), kinds_(kinds) {}
  int64_t dim(HessianKind k) const override { return kinds_[static_cast<int>(k)].n; }
  int64_t count(HessianKind k) const override { return kinds_[static_cast<int>(k)].count; }
  at::Tensor Mean(HessianKind k) const override {
    const Kind& kind = kinds_[static_cast<int>(k)];
    if (kind.count == 0) return at::zeros({kind.n, kind.n}, at::kDouble);
    at::Tensor mean = SymmetricSumFromPacked(file_->Data(*kind.fixed), kind.n)
                          .div_(static_cast<double>(kind.count));
    file_->ReleasePages(*kind.fixed);
    return mean;
  }

 private:
  std::unique_ptr<SafetensorsFile> file_;
  std::array<Kind, 4> kinds_;
};

}  // namespace

StatusOr<BlockHessians> LoadBlockHessians(const std::string& path, const std::string& key,
                                          bool mapped) {
  if (FileSize(path) < 0) return absl::NotFoundError(path + ": no cached Hessians");
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  auto it = file->metadata().find("calibration_key");
  if (it == file->metadata().end() || it->second != key) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cached Hessians were computed for calibration key '",
                     it == file->metadata().end() ? "" : it->second, "', not '", key, "'"));
  }
  auto format = file->metadata().find("hessian_format");
  if (format == file->metadata().end() || format->second != kHessianFormat) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": cached Hessians are in format '",
        format == file->metadata().end() ? "1 (fp64 sums)" : format->second, "', not '",
        kHessianFormat, "' (exact fixed-point sums); recomputing"));
  }
  // Stale files are named as such above; a current one must match its checksum before its
  // sums are used.
  QCAL_RETURN_IF_ERROR(VerifyCacheChecksum(path));
  BlockHessians h;
  std::array<MappedHessianFile::Kind, 4> kinds;
  for (HessianKind k : kAllHessianKinds) {
    const std::string base = HessianKindName(k);
    const TensorInfo* fixed = file->Find(base + ".fixed");
    const TensorInfo* dim = file->Find(base + ".dim");
    const TensorInfo* count = file->Find(base + ".count");
    if (!fixed || !dim || !count || fixed->dtype != DType::kI64 || fixed->shape.size() != 2 ||
        fixed->shape[1] != 2 || dim->dtype != DType::kI64 || dim->numel() != 1 ||
        count->dtype != DType::kI64 || count->numel() != 1) {
      return absl::DataLossError(absl::StrCat(path, ": missing or malformed '", base, "'"));
    }
    int64_t n;
    std::memcpy(&n, file->Data(*dim), sizeof(n));
    if (n < 0 || n > (int64_t{1} << 20) || fixed->shape[0] != n * (n + 1) / 2) {
      return absl::DataLossError(absl::StrCat(path, ": '", base, ".fixed' has ", fixed->shape[0],
                                              " values, expected ", n * (n + 1) / 2));
    }
    int64_t c;
    std::memcpy(&c, file->Data(*count), sizeof(c));
    if (c < 0) return absl::DataLossError(absl::StrCat(path, ": '", base, ".count' is ", c));
    if (mapped) {
      kinds[static_cast<int>(k)] = {n, c, fixed};
      continue;
    }
    std::vector<Fixed128> packed(fixed->shape[0]);
    std::memcpy(packed.data(), file->Data(*fixed), packed.size() * sizeof(Fixed128));
    file->ReleasePages(*fixed);
    auto acc = HessianAccumulator::FromFixed(n, std::move(packed), c);
    if (!acc.ok()) return Annotate(acc.status(), path);
    h.at(k) = std::move(*acc);
  }
  if (mapped) h.stored = std::make_shared<MappedHessianFile>(std::move(file), kinds);
  return h;
}

namespace {

// The reduction's head: each kind's row count summed over the ranks (head[3k]), and a check that
// every rank holds the same dimensions. Every rank sees the same sums, so all agree whether the
// dimensions match (they all do iff size·Σd² = (Σd)²). counts[k]: this rank's rows of kind k.
Status ReduceHessianHead(runtime::Comm& comm, const BlockHessians& h,
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

Status AllReduceHessians(runtime::Comm& comm, BlockHessians* h) {
  if (comm.size() == 1) return absl::OkStatus();
  std::array<int64_t, 4> counts;
  for (size_t ki = 0; ki < 4; ++ki) counts[ki] = h->at(kAllHessianKinds[ki]).count();
  std::vector<int64_t> head;
  QCAL_RETURN_IF_ERROR(ReduceHessianHead(comm, *h, counts, &head));
  // The sums, in pieces (4 int64 limbs per value: 32 bytes per value in flight).
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<int64_t> limbs;
  for (size_t ki = 0; ki < 4; ++ki) {
    HessianAccumulator& acc = h->at(kAllHessianKinds[ki]);
    const int64_t dim = acc.dim();
    std::vector<Fixed128> total = acc.ReleasePacked();  // reduced in place, no copy
    for (size_t off = 0; off < total.size(); off += kPiece) {
      const size_t m = std::min(kPiece, total.size() - off);
      limbs.resize(4 * m);
      HessianAccumulator::SplitDigits(total.data() + off, m, limbs.data());
      QCAL_RETURN_IF_ERROR(comm.AllReduceSum(limbs.data(), limbs.size()));
      QCAL_RETURN_IF_ERROR(Annotate(
          HessianAccumulator::CombineDigits(limbs.data(), m, total.data() + off),
          HessianKindName(kAllHessianKinds[ki])));
    }
    QCAL_ASSIGN_OR_RETURN(acc, HessianAccumulator::FromFixed(dim, std::move(total),
                                                             head[3 * ki]));
  }
  return absl::OkStatus();
}

namespace {
Status AgreeOk(runtime::Comm& comm, const Status& local, const std::string& what);
}  // namespace

Status AllReduceDeviceHessians(runtime::Comm& comm, const kernels::DeviceInt64Sum& device_sum,
                               bool download, BlockHessians* h, int64_t* rows) {
  kernels::GpuBackend* gpu = kernels::ActiveGpuBackend();
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

namespace {

// The opened file and its "hidden" tensor. NotFound when absent, FailedPrecondition for another
// calibration key, DataLoss when malformed.
StatusOr<std::pair<std::unique_ptr<SafetensorsFile>, const TensorInfo*>> OpenActivation(
    const std::string& path, const std::string& key, const std::vector<int64_t>& shape) {
  if (FileSize(path) < 0) return absl::NotFoundError(path + ": no cached activations");
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  auto it = file->metadata().find("calibration_key");
  if (it == file->metadata().end() || it->second != key) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cached activations belong to another calibration"));
  }
  QCAL_RETURN_IF_ERROR(VerifyCacheChecksum(path));
  const TensorInfo* t = file->Find("hidden");
  if (t == nullptr || t->dtype != DType::kF32 || t->shape != shape) {
    return absl::DataLossError(absl::StrCat(path, ": missing or misshapen tensor 'hidden'"));
  }
  return std::make_pair(std::move(file), t);
}

// Every rank learns whether every rank succeeded: the failing rank keeps its own error, the
// others get Aborted naming `what`. A collective: every rank must call it at the same point.
Status AgreeOk(runtime::Comm& comm, const Status& local, const std::string& what) {
  int64_t failed = local.ok() ? 0 : 1;
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&failed, 1));
  if (!local.ok()) return local;
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat(what, ": another rank failed (see its error)"));
  }
  return absl::OkStatus();
}

// A safetensors file filled in place by every rank, so that no rank holds what the others
// write: rank 0 creates "<path>.partial" with the header of `layout` (whose tensors are all
// Reserve()d) and the full size; every rank writes its parts of the tensors at their offsets
// (Write); Finish renames the file once every rank has synced, and writes its checksum. The bytes
// equal SafetensorsWriter::Write's for the same tensors. Collective: Begin and Finish on every
// rank at the same point. Used for the activation files (each rank its sequences' rows) and for
// sharded Hessians (each rank its band of each triangle).
class SharedSafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SharedSafetensorsFile>> Begin(runtime::Comm& comm,
                                                                const std::string& path,
                                                                SafetensorsWriter layout) {
    auto f = std::unique_ptr<SharedSafetensorsFile>(new SharedSafetensorsFile());
    f->path_ = path;
    f->partial_ = path + ".partial";
    f->layout_ = std::move(layout);
    Status local = [&]() -> Status {
      QCAL_ASSIGN_OR_RETURN(std::string prefix, f->layout_.Prefix(path));
      f->data_offset_ = static_cast<int64_t>(prefix.size());
      if (comm.rank() != 0) return Status();
      const int fd = ::open(f->partial_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) return Errno(f->partial_, "cannot create");
      const bool ok =
          ::write(fd, prefix.data(), prefix.size()) == static_cast<ssize_t>(prefix.size()) &&
          ::ftruncate(fd, static_cast<off_t>(prefix.size() + f->layout_.data_bytes())) == 0 &&
          ::fsync(fd) == 0;
      ::close(fd);
      return ok ? Status() : Errno(f->partial_, "cannot write the header");
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
    f->fd_ = ::open(f->partial_.c_str(), O_WRONLY | O_CLOEXEC);
    local = f->fd_ >= 0 ? Status() : Errno(f->partial_, "cannot open");
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
    return f;
  }

  ~SharedSafetensorsFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  // `bytes` bytes at byte `offset` of tensor `name`'s data.
  Status Write(const std::string& name, uint64_t offset, const void* data, size_t bytes) {
    QCAL_ASSIGN_OR_RETURN(const uint64_t start, layout_.DataOffset(name));
    const char* p = static_cast<const char*>(data);
    size_t left = bytes;
    off_t off = static_cast<off_t>(data_offset_ + start + offset);
    while (left > 0) {
      const ssize_t n = ::pwrite(fd_, p, left, off);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        return Errno(partial_, absl::StrCat("cannot write tensor ", name).c_str());
      }
      p += n;
      left -= static_cast<size_t>(n);
      off += n;
    }
    return Status();
  }

  Status Finish(runtime::Comm& comm) {
    Status local = ::fsync(fd_) == 0 ? Status() : Errno(partial_, "fsync failed");
    ::close(fd_);
    fd_ = -1;
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path_));
    if (comm.rank() == 0) {
      local = ::rename(partial_.c_str(), path_.c_str()) == 0 ? Status()
                                                             : Errno(path_, "cannot rename into");
      if (local.ok()) local = SyncParentDir(path_);
      if (local.ok()) local = WriteCacheChecksum(path_);
    }
    return AgreeOk(comm, local, path_);
  }

 private:
  SharedSafetensorsFile() = default;
  // The errno of the failed call, with the free space when the disk is full (io::ErrnoError).
  static Status Errno(const std::string& path, const char* what) {
    return io::ErrnoError(errno, path, what);
  }
  std::string path_, partial_;
  SafetensorsWriter layout_;
  int64_t data_offset_ = 0;
  int fd_ = -1;
};

// One boundary's activation file: every rank writes its own sequences' rows.
StatusOr<std::unique_ptr<SharedSafetensorsFile>> BeginActivationFile(
    runtime::Comm& comm, const std::string& path, const std::string& key,
    const std::vector<int64_t>& shape) {
  SafetensorsWriter layout;
  layout.SetMetadata("calibration_key", key);
  const Status reserved = layout.Reserve("hidden", DType::kF32, shape);
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, reserved, path));
  return SharedSafetensorsFile::Begin(comm, path, std::move(layout));
}

// Sequences [first, first + x.size(0)) of an activation file [N, S, hidden].
Status WriteActivationRows(SharedSafetensorsFile& file, int64_t first, const at::Tensor& x) {
  const at::Tensor c = x.detach().to(at::kCPU, at::kFloat).contiguous();
  const uint64_t row_bytes = c.numel() > 0 ? c.numel() / c.size(0) * sizeof(float) : 0;
  return file.Write("hidden", first * row_bytes, c.data_ptr(), c.numel() * sizeof(float));
}

// The layout SaveBlockHessians writes (the same header bytes), for a file that the ranks fill
// with their bands.
SafetensorsWriter HessianFileLayout(const BlockHessians& h, const std::string& key) {
  SafetensorsWriter layout;
  layout.SetMetadata("calibration_key", key);
  layout.SetMetadata("hessian_format", kHessianFormat);
  layout.SetMetadata("hessian_frac_bits", std::to_string(kHessianFracBits));
  for (HessianKind k : kAllHessianKinds) {
    const std::string base = HessianKindName(k);
    const int64_t n = h.at(k).dim();
    // Reserve cannot fail here: fresh names, valid shapes.
    (void)layout.Reserve(base + ".fixed", DType::kI64, {n * (n + 1) / 2, 2});
    (void)layout.Reserve(base + ".dim", DType::kI64, {});
    (void)layout.Reserve(base + ".count", DType::kI64, {});
  }
  return layout;
}

// Writes a block's Hessians whose accumulators are bands (sharded calibration): every rank
// writes its band of each triangle in place, rank 0 the dimensions and counts. The file's bytes
// equal SaveBlockHessians's for the whole sums. Collective.
Status SaveShardedBlockHessians(runtime::Comm& comm, const std::string& path,
                                const BlockHessians& h, const std::string& key) {
  QCAL_ASSIGN_OR_RETURN(auto file,
                        SharedSafetensorsFile::Begin(comm, path, HessianFileLayout(h, key)));
  Status local;
  for (HessianKind k : kAllHessianKinds) {
    if (!local.ok()) break;
    const HessianAccumulator& acc = h.at(k);
    const std::string base = HessianKindName(k);
    local = file->Write(base + ".fixed", acc.packed_begin() * sizeof(Fixed128),
                        acc.packed().data(), acc.packed().size() * sizeof(Fixed128));
    if (local.ok() && comm.rank() == 0) {
      const int64_t n = acc.dim(), count = acc.count();
      local = file->Write(base + ".dim", 0, &n, sizeof(n));
      if (local.ok()) local = file->Write(base + ".count", 0, &count, sizeof(count));
    }
  }
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
  return file->Finish(comm);
}

// Every rank's captured inputs [s_r, seq, n] (fp32, contiguous) concatenated in rank order:
// [Σ s_r, seq, n] on every rank. Collective.
StatusOr<at::Tensor> GatherSequences(runtime::Comm& comm, const at::Tensor& mine) {
  const int64_t seq = mine.size(1), n = mine.size(2);
  auto buffer = std::make_shared<std::vector<char>>();
  QCAL_RETURN_IF_ERROR(runtime::AllGather(comm, mine.data_ptr(), mine.numel() * sizeof(float),
                                          buffer.get()));
  const int64_t row_bytes = seq * n * static_cast<int64_t>(sizeof(float));
  if (buffer->empty() || row_bytes == 0) return at::empty({0, seq, n}, at::kFloat);
  const int64_t rows = static_cast<int64_t>(buffer->size()) / row_bytes;
  return at::from_blob(
      buffer->data(), {rows, seq, n}, [buffer](void*) {}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

StatusOr<at::Tensor> LoadActivation(const std::string& path, const std::string& key,
                                    const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(auto opened, OpenActivation(path, key, shape));
  return at::from_blob(const_cast<uint8_t*>(opened.first->Data(*opened.second)), shape,
                       at::kFloat)
      .clone();
}

Status SaveActivation(const std::string& path, const at::Tensor& hidden, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  const at::Tensor c = hidden.detach().to(at::kFloat).contiguous();
  QCAL_RETURN_IF_ERROR(writer.AddF32("hidden", c.sizes().vec(), c.data_ptr<float>()));
  QCAL_RETURN_IF_ERROR(writer.Write(path));
  return WriteCacheChecksum(path);
}

StatusOr<CalibrationResult> Calibrate(runtime::Comm& comm, model::ModelSource& source,
                                      const at::Tensor& tokens, const std::string& job_dir,
                                      const std::string& key, const CalibrationOptions& options,
                                      const std::function<void(int64_t, int64_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.batch < 1) return absl::InvalidArgumentError("calibration batch must be >= 1");
  if (tokens.dim() != 2) {
    return absl::InvalidArgumentError("calibration tokens must be [sequences, seq_len]");
  }
  CalibrationResult result;
  const LlamaConfig& config = source.config();
  const int64_t blocks = config.num_hidden_layers;
  const int64_t num_seqs = tokens.size(0), seq_len = tokens.size(1);
  const std::vector<int64_t> act_shape = {num_seqs, seq_len, config.hidden_size};
  const bool root = comm.rank() == 0;

  // Rank 0 looks at the caches and tells everybody, so every rank takes the same path.
  int64_t cached[2] = {0, 0};  // hessians, activations
  Status local;
  if (root) {
    local = [&]() -> Status {
      QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/hessians"));
      if (options.activations) QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/activations"));
      bool h_ok = options.hessians;
      for (int64_t l = 0; l < blocks && h_ok; ++l) {
        auto h = LoadBlockHessians(HessianPath(job_dir, l), key);
        h_ok = h.ok();
        if (!h.ok() && !absl::IsNotFound(h.status())) {
          QCAL_LOG_WARN("cached Hessians not reused: {}", std::string(h.status().message()));
        }
      }
      bool a_ok = options.activations;
      for (int64_t l = 0; l <= blocks && a_ok; ++l) {
        auto a = OpenActivation(ActivationPath(job_dir, l), key, act_shape);
        a_ok = a.ok();
        if (!a.ok() && !absl::IsNotFound(a.status())) {
          QCAL_LOG_WARN("cached activations not reused: {}", std::string(a.status().message()));
        }
      }
      cached[0] = h_ok;
      cached[1] = a_ok;
      return absl::OkStatus();
    }();
  }
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, "calibration setup"));
  QCAL_RETURN_IF_ERROR(comm.Broadcast(cached, sizeof(cached), 0));
  const bool walk_hessians = options.hessians && !cached[0];
  const bool walk_activations = options.activations && !cached[1];
  result.from_cache = options.hessians && cached[0];
  result.activations_from_cache = options.activations && cached[1];

  if (walk_hessians || walk_activations) {
    // This rank's canonical chunks: sequences [s0, s1) in chunks of options.batch.
    const int64_t chunks = (num_seqs + options.batch - 1) / options.batch;
    const runtime::Range mine = runtime::SliceForRank(chunks, comm.rank(), comm.size());
    std::vector<std::vector<int64_t>> shapes;
    std::vector<int64_t> first_seq;
    for (int64_t c = mine.begin; c < mine.end; ++c) {
      const int64_t a = c * options.batch, b = std::min(num_seqs, a + options.batch);
      shapes.push_back({b - a, seq_len, config.hidden_size});
      first_seq.push_back(a);
    }
    // The walk's activations: this rank's chunks, spilled to the job directory above the budget.
    local = MakeDirs(job_dir + "/spill");
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, "calibration"));
    auto store_or = model::ActivationStore::Create(
        shapes, options.memory_budget_bytes,
        absl::StrCat(job_dir, "/spill/calibration-rank", comm.rank(), ".f32"));
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, store_or.status(), "calibration"));
    model::ActivationStore& store = **store_or;
    if (store.spilled()) {
      QCAL_LOG_INFO("calibration: {:.2f} GiB of activations on this rank over the {:.2f} GiB "
                    "budget: spilled to the job directory",
                    store.total_bytes() / 1073741824.0,
                    options.memory_budget_bytes / 1073741824.0);
    }
    at::NoGradGuard no_grad;
    local = [&]() -> Status {
      for (int64_t i = 0; i < store.chunks(); ++i) {
        QCAL_ASSIGN_OR_RETURN(at::Tensor x,
                              source.Embed(tokens.narrow(0, first_seq[i], shapes[i][0])));
        QCAL_RETURN_IF_ERROR(store.Put(i, x));
      }
      return Status();
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, "calibration, embedding"), "calibration"));
    if (walk_hessians && options.keep_hessians) result.hessians.assign(blocks, BlockHessians{});
    // Saves boundary l (the inputs of block l; l = blocks: the last block's outputs).
    auto save_boundary = [&](int64_t l) -> Status {
      QCAL_ASSIGN_OR_RETURN(auto file,
                            BeginActivationFile(comm, ActivationPath(job_dir, l), key, act_shape));
      Status rows;
      for (int64_t i = 0; i < store.chunks() && rows.ok(); ++i) {
        auto x = store.Get(i);
        rows = x.ok() ? WriteActivationRows(*file, first_seq[i], *x) : x.status();
      }
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, rows, ActivationPath(job_dir, l)));
      return file->Finish(comm);
    };
    // Sharded Hessians: each rank sums every rank's inputs into its band of each triangle (all
    // ranks step through their chunks together; a rank past its last chunk contributes none).
    const bool sharded = walk_hessians && options.shard_hessians;
    const int64_t steps = runtime::SliceForRank(chunks, 0, comm.size()).size();
    auto walk_block_sharded = [&](int64_t l, const std::string& where,
                                  BlockHessians* h) -> Status {
      std::unique_ptr<model::DecoderBlock> block;
      local = [&]() -> Status {
        QCAL_ASSIGN_OR_RETURN(block, source.LoadBlock(l));
        for (model::LinearKind k : model::kAllLinears) {
          const int64_t n = block->weights().linear(k).in_features();
          const HessianRows band =
              HessianBandForRank(n, comm.rank(), comm.size(), options.hessian_strip_rows);
          QCAL_ASSIGN_OR_RETURN(h->at(HessianKindOf(k)),
                                HessianAccumulator::Band(n, band, options.hessian_strip_rows));
        }
        return Status();
      }();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
      for (int64_t step = 0; step < steps; ++step) {
        std::array<at::Tensor, 4> inputs;
        local = [&]() -> Status {
          if (step >= store.chunks()) {
            for (HessianKind k : kAllHessianKinds) {
              inputs[static_cast<int>(k)] = at::empty({0, seq_len, h->at(k).dim()}, at::kFloat);
            }
            return Status();
          }
          QCAL_ASSIGN_OR_RETURN(at::Tensor x, store.Get(step));
          QCAL_ASSIGN_OR_RETURN(at::Tensor y, ForwardCapturingInputs(*block, x, source.rope(),
                                                                     options.batch, &inputs));
          return store.Put(step, y);
        }();
        QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
        for (HessianKind k : kAllHessianKinds) {
          at::Tensor& mine = inputs[static_cast<int>(k)];
          QCAL_ASSIGN_OR_RETURN(at::Tensor all, GatherSequences(comm, mine));
          mine = at::Tensor();
          local = all.size(0) > 0 ? h->at(k).Add(all) : Status();
          const std::string input = absl::StrCat(where, ", ", HessianKindName(k), " input");
          QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, input), input));
        }
      }
      return Status();
    };
    // GPU ranks reduce the sums on their devices when all of them can (every rank has a GPU
    // backend and a device reduction); otherwise every rank downloads and reduces on the host.
    bool reduce_on_device = false;
    if (walk_hessians && !sharded && comm.size() > 1) {
      int64_t can = options.device_sum && kernels::ActiveGpuBackend() != nullptr ? 1 : 0;
      QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&can, 1));
      reduce_on_device = can == comm.size();
    }
    for (int64_t l = 0; l < blocks; ++l) {
      const std::string where = absl::StrCat("calibration, block ", l);
      if (walk_activations) QCAL_RETURN_IF_ERROR(Annotate(save_boundary(l), where));
      BlockHessians h;
      if (sharded) {
        QCAL_RETURN_IF_ERROR(walk_block_sharded(l, where, &h));
        QCAL_RETURN_IF_ERROR(
            Annotate(SaveShardedBlockHessians(comm, HessianPath(job_dir, l), h, key), where));
        result.tokens = h.at(HessianKind::kQkv).count();
        h = BlockHessians{};  // the bands are in the file
        if (options.keep_hessians) {
          StatusOr<BlockHessians> whole = LoadBlockHessians(HessianPath(job_dir, l), key);
          QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(whole.status(), where), where));
          result.hessians[l] = std::move(*whole);
        }
        if (progress) progress(l + 1, blocks);
        continue;
      }
      local = [&]() -> Status {
        QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::DecoderBlock> block, source.LoadBlock(l));
        if (walk_hessians && options.hessian_strip_rows != kHessianStripRows) {
          for (model::LinearKind k : model::kAllLinears) {
            const int64_t n = block->weights().linear(k).in_features();
            h.at(HessianKindOf(k)) = HessianAccumulator(n, options.hessian_strip_rows);
          }
        }
        if (store.chunks() == 0 && walk_hessians) {
          // A rank without sequences still reduces: its accumulators get the block's sizes.
          const at::Tensor none = at::empty({0, seq_len, config.hidden_size}, at::kFloat);
          QCAL_RETURN_IF_ERROR(
              ForwardCollectingHessians(*block, none, source.rope(), options.batch, &h).status());
        }
        // On a GPU the sums stay on the device for the whole block (flushed once below).
        for (int64_t i = 0; i < store.chunks(); ++i) {
          QCAL_ASSIGN_OR_RETURN(at::Tensor x, store.Get(i));
          QCAL_ASSIGN_OR_RETURN(at::Tensor y,
                                ForwardCollectingHessians(*block, x, source.rope(), options.batch,
                                                          walk_hessians ? &h : nullptr,
                                                          /*flush_device=*/false));
          QCAL_RETURN_IF_ERROR(store.Put(i, y));
        }
        return reduce_on_device ? Status() : FlushDeviceHessians(&h);
      }();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
      if (walk_hessians) {
        if (reduce_on_device) {
          QCAL_RETURN_IF_ERROR(Annotate(
              AllReduceDeviceHessians(comm, options.device_sum, root || options.keep_hessians,
                                      &h, &result.tokens),
              where));
        } else {
          QCAL_RETURN_IF_ERROR(Annotate(AllReduceHessians(comm, &h), where));
          result.tokens = h.at(HessianKind::kQkv).count();
        }
        if (root) local = Annotate(SaveBlockHessians(HessianPath(job_dir, l), h, key), where);
        QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, where));
        if (options.keep_hessians) result.hessians[l] = std::move(h);
      }
      if (progress) progress(l + 1, blocks);
    }
    if (walk_activations) {
      QCAL_RETURN_IF_ERROR(Annotate(save_boundary(blocks), "calibration, final activations"));
    }
  }
  if (result.from_cache && options.keep_hessians) {
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_ASSIGN_OR_RETURN(BlockHessians h, LoadBlockHessians(HessianPath(job_dir, l), key));
      result.hessians.push_back(std::move(h));
    }
  }
  if (result.tokens == 0 && !result.hessians.empty()) {
    result.tokens = result.hessians[0].at(HessianKind::kQkv).count();
  }
  if (result.tokens == 0) result.tokens = tokens.numel();
  QCAL_RETURN_IF_ERROR(comm.Barrier());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace qcal::calib
