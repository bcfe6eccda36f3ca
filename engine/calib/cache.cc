#include "engine/calib/cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/io_util.h"
#include "common/log.h"
#include "engine/calib/reduce.h"
#include "engine/model/tensor_io.h"

namespace qcal::calib {
namespace {

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// The cache format written by SaveBlockHessians (files without it hold fp64 sums: stale).
constexpr char kHessianFormat[] = "3";

// "experts.<e>.gate_up" / "experts.<e>.down": a routed expert's sums, dimension and count.
std::string ExpertTensorBase(int64_t expert, ExpertInput input) {
  return absl::StrCat("experts.", expert, ".", ExpertInputName(input));
}

// The errno of the failed call, with the free space when the disk is full (io::ErrnoError).
Status Errno(const std::string& path, const char* what) { return io::ErrnoError(errno, path, what); }

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

}  // namespace

std::string CalibrationKey(const std::string& inputs_key, const LlamaConfig& config,
                           const CalibrationSpec& spec, int64_t seq_len) {
  std::string canon = absl::StrCat("inputs=", inputs_key, "|", LlamaConfigToJson(config).dump());
  for (const std::string& f : spec.files) absl::StrAppend(&canon, "|data:", f);
  absl::StrAppend(&canon, "|n=", spec.num_sequences, "|len=", seq_len, "|seed=", spec.seed);
  // fp32 is what every key meant before the precision was a recipe key: its caches stay valid.
  if (spec.precision != "fp32") absl::StrAppend(&canon, "|precision=", spec.precision);
  // The MoE settings change a MoE model's expert Hessians; dense keys stay as they were.
  if (config.is_moe()) {
    absl::StrAppend(&canon, "|moe_route_all=", spec.moe_route_all ? 1 : 0,
                    "|moe_min_tokens=", spec.moe_min_tokens);
  }
  return Fnv1aHex(canon);
}

std::string HessianPath(const std::string& hessian_dir, int64_t block) {
  return absl::StrCat(hessian_dir, "/block_", block, ".safetensors");
}

std::string ActivationPath(const std::string& activation_dir, int64_t boundary) {
  return absl::StrCat(activation_dir, "/block_", boundary, ".safetensors");
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
  // A MoE block's experts (a dense block's file has none of these tensors).
  std::vector<int64_t> routed, route_all;
  for (const ExpertHessians& e : h.experts) {
    routed.push_back(e.routed_tokens);
    route_all.push_back(e.route_all ? 1 : 0);
  }
  if (!h.experts.empty()) {
    const int64_t n = static_cast<int64_t>(h.experts.size());
    QCAL_RETURN_IF_ERROR(writer.Add("experts.routed_tokens", DType::kI64, {n}, routed.data(),
                                    routed.size() * sizeof(int64_t)));
    QCAL_RETURN_IF_ERROR(writer.Add("experts.route_all", DType::kI64, {n}, route_all.data(),
                                    route_all.size() * sizeof(int64_t)));
  }
  for (size_t e = 0; e < h.experts.size(); ++e) {
    for (ExpertInput i : kExpertInputs) {
      const HessianAccumulator& acc = h.experts[e].at(i);
      const std::string base = ExpertTensorBase(static_cast<int64_t>(e), i);
      const std::vector<Fixed128>* packed = &acc.packed();
      QCAL_RETURN_IF_ERROR(writer.AddStreamed(
          base + ".fixed", DType::kI64, {static_cast<int64_t>(packed->size()), 2},
          [packed](const SafetensorsWriter::ByteSink& sink) {
            return sink(packed->data(), packed->size() * sizeof(Fixed128));
          }));
      const int64_t n = acc.dim(), count = acc.count();
      QCAL_RETURN_IF_ERROR(writer.Add(base + ".dim", DType::kI64, {}, &n, sizeof(n)));
      QCAL_RETURN_IF_ERROR(writer.Add(base + ".count", DType::kI64, {}, &count, sizeof(count)));
    }
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
  MappedHessianFile(std::unique_ptr<SafetensorsFile> file, std::array<Kind, 4> kinds,
                    std::vector<std::array<Kind, 2>> experts)
      : file_(std::move(file)), kinds_(kinds), experts_(std::move(experts)) {}
  int64_t dim(HessianKind k) const override { return kinds_[static_cast<int>(k)].n; }
  int64_t count(HessianKind k) const override { return kinds_[static_cast<int>(k)].count; }
  at::Tensor Mean(HessianKind k) const override { return MeanOf(kinds_[static_cast<int>(k)]); }
  at::Tensor ExpertMean(int64_t expert, ExpertInput input) const override {
    if (expert < 0 || expert >= static_cast<int64_t>(experts_.size())) return at::Tensor();
    return MeanOf(experts_[expert][static_cast<int>(input)]);
  }

 private:
  at::Tensor MeanOf(const Kind& kind) const {
    if (kind.count == 0) return at::zeros({kind.n, kind.n}, at::kDouble);
    at::Tensor mean = SymmetricSumFromPacked(file_->Data(*kind.fixed), kind.n)
                          .div_(static_cast<double>(kind.count));
    file_->ReleasePages(*kind.fixed);
    return mean;
  }
  std::unique_ptr<SafetensorsFile> file_;
  std::array<Kind, 4> kinds_;
  std::vector<std::array<Kind, 2>> experts_;
};

// One stored sum's tensors "<base>.fixed/.dim/.count", checked. DataLoss naming `path` when
// missing or malformed.
StatusOr<MappedHessianFile::Kind> FindStoredSum(const SafetensorsFile& file,
                                                const std::string& path, const std::string& base) {
  const TensorInfo* fixed = file.Find(base + ".fixed");
  const TensorInfo* dim = file.Find(base + ".dim");
  const TensorInfo* count = file.Find(base + ".count");
  if (!fixed || !dim || !count || fixed->dtype != DType::kI64 || fixed->shape.size() != 2 ||
      fixed->shape[1] != 2 || dim->dtype != DType::kI64 || dim->numel() != 1 ||
      count->dtype != DType::kI64 || count->numel() != 1) {
    return absl::DataLossError(absl::StrCat(path, ": missing or malformed '", base, "'"));
  }
  int64_t n;
  std::memcpy(&n, file.Data(*dim), sizeof(n));
  if (n < 0 || n > (int64_t{1} << 20) || fixed->shape[0] != n * (n + 1) / 2) {
    return absl::DataLossError(absl::StrCat(path, ": '", base, ".fixed' has ", fixed->shape[0],
                                            " values, expected ", n * (n + 1) / 2));
  }
  int64_t c;
  std::memcpy(&c, file.Data(*count), sizeof(c));
  if (c < 0) return absl::DataLossError(absl::StrCat(path, ": '", base, ".count' is ", c));
  return MappedHessianFile::Kind{n, c, fixed};
}

// The accumulator of a stored sum, read into memory.
StatusOr<HessianAccumulator> ReadStoredSum(SafetensorsFile& file, const std::string& path,
                                           const MappedHessianFile::Kind& kind) {
  std::vector<Fixed128> packed(kind.fixed->shape[0]);
  std::memcpy(packed.data(), file.Data(*kind.fixed), packed.size() * sizeof(Fixed128));
  file.ReleasePages(*kind.fixed);
  auto acc = HessianAccumulator::FromFixed(kind.n, std::move(packed), kind.count);
  if (!acc.ok()) return Annotate(acc.status(), path);
  return acc;
}

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
    QCAL_ASSIGN_OR_RETURN(kinds[static_cast<int>(k)],
                          FindStoredSum(*file, path, HessianKindName(k)));
    if (!mapped) {
      QCAL_ASSIGN_OR_RETURN(h.at(k), ReadStoredSum(*file, path, kinds[static_cast<int>(k)]));
    }
  }
  // A MoE block's experts.
  std::vector<std::array<MappedHessianFile::Kind, 2>> experts;
  if (const TensorInfo* routed = file->Find("experts.routed_tokens")) {
    const TensorInfo* route_all = file->Find("experts.route_all");
    if (routed->dtype != DType::kI64 || routed->shape.size() != 1 || route_all == nullptr ||
        route_all->dtype != DType::kI64 || route_all->shape != routed->shape ||
        routed->shape[0] < 1 || routed->shape[0] > (int64_t{1} << 16)) {
      return absl::DataLossError(
          absl::StrCat(path, ": malformed 'experts.routed_tokens' or 'experts.route_all'"));
    }
    const int64_t n = routed->shape[0];
    std::vector<int64_t> tokens(n), flags(n);
    std::memcpy(tokens.data(), file->Data(*routed), n * sizeof(int64_t));
    std::memcpy(flags.data(), file->Data(*route_all), n * sizeof(int64_t));
    h.experts.resize(n);
    experts.resize(n);
    for (int64_t e = 0; e < n; ++e) {
      if (tokens[e] < 0 || (flags[e] != 0 && flags[e] != 1)) {
        return absl::DataLossError(
            absl::StrCat(path, ": expert ", e, " has routed tokens ", tokens[e],
                         " and route-all flag ", flags[e]));
      }
      h.experts[e].routed_tokens = tokens[e];
      h.experts[e].route_all = flags[e] != 0;
      for (ExpertInput i : kExpertInputs) {
        QCAL_ASSIGN_OR_RETURN(experts[e][static_cast<int>(i)],
                              FindStoredSum(*file, path, ExpertTensorBase(e, i)));
        if (!mapped) {
          QCAL_ASSIGN_OR_RETURN(h.experts[e].at(i),
                                ReadStoredSum(*file, path, experts[e][static_cast<int>(i)]));
        }
      }
    }
  }
  if (mapped) {
    h.stored = std::make_shared<MappedHessianFile>(std::move(file), kinds, std::move(experts));
  }
  return h;
}

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

Status CheckActivationCache(const std::string& path, const std::string& key,
                            const std::vector<int64_t>& shape) {
  return OpenActivation(path, key, shape).status();
}

StatusOr<std::unique_ptr<SharedSafetensorsFile>> SharedSafetensorsFile::Begin(
    comm::Comm& comm, const std::string& path, SafetensorsWriter layout) {
  auto f = std::unique_ptr<SharedSafetensorsFile>(new SharedSafetensorsFile());
  f->path_ = path;
  f->partial_ = path + ".partial";
  f->layout_ = std::move(layout);
  Status local = [&]() -> Status {
    QCAL_ASSIGN_OR_RETURN(std::string prefix, f->layout_.Prefix(path));
    f->data_offset_ = static_cast<int64_t>(prefix.size());
    if (comm.rank() != 0) return Status();
    QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(f->partial_, O_WRONLY | O_CREAT | O_TRUNC,
                                                     0644, "cannot create"));
    const bool ok =
        ::write(fd, prefix.data(), prefix.size()) == static_cast<ssize_t>(prefix.size()) &&
        ::ftruncate(fd, static_cast<off_t>(prefix.size() + f->layout_.data_bytes())) == 0 &&
        ::fsync(fd) == 0;
    ::close(fd);
    return ok ? Status() : Errno(f->partial_, "cannot write the header");
  }();
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
  StatusOr<int> opened = OpenNoFollow(f->partial_, O_WRONLY, 0, "cannot open");
  local = opened.status();
  if (opened.ok()) f->fd_ = *opened;
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
  return f;
}

SharedSafetensorsFile::~SharedSafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SharedSafetensorsFile::Write(const std::string& name, uint64_t offset, const void* data,
                                    size_t bytes) {
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

Status SharedSafetensorsFile::Finish(comm::Comm& comm) {
  Status local = ::fsync(fd_) == 0 ? Status() : Errno(partial_, "fsync failed");
  ::close(fd_);
  fd_ = -1;
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path_));
  if (comm.rank() == 0) {
    local = RenameNoFollow(partial_, path_);
    if (local.ok()) local = SyncParentDir(path_);
    if (local.ok()) local = WriteCacheChecksum(path_);
  }
  return AgreeOk(comm, local, path_);
}

StatusOr<std::unique_ptr<SharedSafetensorsFile>> BeginActivationFile(
    comm::Comm& comm, const std::string& path, const std::string& key,
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

namespace {

// The layout SaveBlockHessians writes (the same header bytes) for sums of these dimensions (a
// MoE block's experts after the dense kinds), for a file that the ranks fill in place.
SafetensorsWriter HessianFileLayout(const std::array<int64_t, 4>& dense,
                                    const std::vector<std::array<int64_t, 2>>& experts,
                                    const std::string& key) {
  SafetensorsWriter layout;
  layout.SetMetadata("calibration_key", key);
  layout.SetMetadata("hessian_format", kHessianFormat);
  layout.SetMetadata("hessian_frac_bits", std::to_string(kHessianFracBits));
  // Reserve cannot fail here: fresh names, valid shapes.
  auto sum = [&layout](const std::string& base, int64_t n) {
    (void)layout.Reserve(base + ".fixed", DType::kI64, {n * (n + 1) / 2, 2});
    (void)layout.Reserve(base + ".dim", DType::kI64, {});
    (void)layout.Reserve(base + ".count", DType::kI64, {});
  };
  for (HessianKind k : kAllHessianKinds) sum(HessianKindName(k), dense[static_cast<int>(k)]);
  if (!experts.empty()) {
    const int64_t n = static_cast<int64_t>(experts.size());
    (void)layout.Reserve("experts.routed_tokens", DType::kI64, {n});
    (void)layout.Reserve("experts.route_all", DType::kI64, {n});
  }
  for (size_t e = 0; e < experts.size(); ++e) {
    for (ExpertInput i : kExpertInputs) {
      sum(ExpertTensorBase(static_cast<int64_t>(e), i), experts[e][static_cast<int>(i)]);
    }
  }
  return layout;
}

// One stored sum's values, dimension and count written in place: a band's values at its
// offset in the packed triangle.
Status WriteStoredSum(SharedSafetensorsFile& file, const std::string& base,
                      const HessianAccumulator& acc, bool header) {
  QCAL_RETURN_IF_ERROR(file.Write(base + ".fixed", acc.packed_begin() * sizeof(Fixed128),
                                  acc.packed().data(), acc.packed().size() * sizeof(Fixed128)));
  if (!header) return Status();
  const int64_t n = acc.dim(), count = acc.count();
  QCAL_RETURN_IF_ERROR(file.Write(base + ".dim", 0, &n, sizeof(n)));
  return file.Write(base + ".count", 0, &count, sizeof(count));
}

}  // namespace

Status SaveShardedBlockHessians(comm::Comm& comm, const std::string& path,
                                const BlockHessians& h, const std::string& key) {
  // Which rank holds each expert's sums, and their dimensions: every rank must lay the file out
  // alike. Per expert: [gate_up dim, down dim, ranks holding it].
  const int64_t experts = static_cast<int64_t>(h.experts.size());
  int64_t counts[2] = {experts, experts * experts};
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(counts, 2));
  if (comm.size() * counts[1] != counts[0] * counts[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ranks hold different numbers of experts (this rank: ", experts, ")"));
  }
  std::vector<int64_t> held(3 * experts, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const ExpertHessians& eh = h.experts[e];
    if (eh.at(ExpertInput::kGateUp).dim() == 0) continue;
    held[3 * e] = eh.at(ExpertInput::kGateUp).dim();
    held[3 * e + 1] = eh.at(ExpertInput::kDown).dim();
    held[3 * e + 2] = 1;
  }
  QCAL_RETURN_IF_ERROR(comm.AllReduceSum(held.data(), held.size()));
  std::vector<std::array<int64_t, 2>> expert_dims(experts);
  for (int64_t e = 0; e < experts; ++e) {
    if (held[3 * e + 2] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": expert ", e, "'s sums are held by ",
                                                     held[3 * e + 2], " ranks, not one"));
    }
    expert_dims[e] = {held[3 * e], held[3 * e + 1]};
  }
  std::array<int64_t, 4> dense;
  for (HessianKind k : kAllHessianKinds) dense[static_cast<int>(k)] = h.at(k).dim();
  QCAL_ASSIGN_OR_RETURN(auto file, SharedSafetensorsFile::Begin(
                                       comm, path, HessianFileLayout(dense, expert_dims, key)));
  Status local;
  for (HessianKind k : kAllHessianKinds) {
    const HessianAccumulator& acc = h.at(k);
    // A band on every rank; whole sums (the same on every rank after a reduction) from rank 0.
    if (!local.ok() || (!acc.is_band() && comm.rank() != 0)) continue;
    local = WriteStoredSum(*file, HessianKindName(k), acc, comm.rank() == 0);
  }
  if (local.ok() && comm.rank() == 0 && experts > 0) {
    std::vector<int64_t> routed, route_all;
    for (const ExpertHessians& e : h.experts) {
      routed.push_back(e.routed_tokens);
      route_all.push_back(e.route_all ? 1 : 0);
    }
    local = file->Write("experts.routed_tokens", 0, routed.data(), routed.size() * 8);
    if (local.ok()) {
      local = file->Write("experts.route_all", 0, route_all.data(), route_all.size() * 8);
    }
  }
  for (int64_t e = 0; e < experts && local.ok(); ++e) {
    if (h.experts[e].at(ExpertInput::kGateUp).dim() == 0) continue;  // another rank's
    for (ExpertInput i : kExpertInputs) {
      if (local.ok()) {
        local = WriteStoredSum(*file, ExpertTensorBase(e, i), h.experts[e].at(i), true);
      }
    }
  }
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, path));
  return file->Finish(comm);
}

}  // namespace qcal::calib
