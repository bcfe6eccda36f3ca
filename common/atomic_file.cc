#include "common/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "common/io_util.h"

namespace qcal {
namespace {

using io::ErrnoError;
using io::ErrnoText;
using io::ScopedFd;

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Makes a rename in `dir` durable. Some filesystems refuse fsync on directories (EINVAL); that is
// not an error worth failing a write for.
Status FsyncDir(const std::string& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, dir, "cannot open directory to fsync it");
  if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != EROFS) {
    return ErrnoError(errno, dir, "fsync of directory failed");
  }
  return absl::OkStatus();
}

std::atomic<uint64_t> g_temp_counter{0};

}  // namespace

Status WriteFileAtomic(const std::string& path, std::string_view contents) {
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Open(path));
  QCAL_RETURN_IF_ERROR(writer->Append(contents.data(), contents.size()));
  return writer->Commit();
}

namespace {

// Reads the file at `path` to its end in pieces of up to `piece` bytes, handing each to `sink`;
// `size_hint` first gets the size fstat reports for a regular file (0 otherwise). A directory is
// FailedPrecondition; errors name the path.
Status ReadPieces(const std::string& path, size_t piece,
                  const std::function<void(uint64_t)>& size_hint,
                  const std::function<void(const char*, size_t)>& sink) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, path, "cannot open for reading");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, path, "cannot stat");
  if (S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": is a directory, not a file"));
  }
  size_hint(S_ISREG(st.st_mode) && st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0);
  std::vector<char> buffer(piece);
  uint64_t total = 0;
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      return absl::DataLossError(
          absl::StrCat(path, ": read failed after ", total, " bytes: ", ErrnoText(error)));
    }
    if (n == 0) break;
    sink(buffer.data(), static_cast<size_t>(n));
    total += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::string> ReadFile(const std::string& path) {
  std::string contents;
  QCAL_RETURN_IF_ERROR(ReadPieces(
      path, size_t{1} << 16, [&](uint64_t size) { contents.reserve(size); },
      [&](const char* p, size_t n) { contents.append(p, n); }));
  return contents;
}

StatusOr<std::string> FileFnv1aHex(const std::string& path) {
  Fnv1a sum;
  QCAL_RETURN_IF_ERROR(ReadPieces(
      path, size_t{1} << 20, [](uint64_t) {},
      [&](const char* p, size_t n) { sum.Update(p, n); }));
  return sum.Hex();
}

Status SyncParentDir(const std::string& path) { return FsyncDir(DirName(path)); }

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp_path, int fd)
    : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd) {}

StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("AtomicFileWriter: empty path");
  if (path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory name, not a file"));
  }
  const std::string tmp_path = absl::StrCat(path, ".tmp.", static_cast<int64_t>(::getpid()), ".",
                                            g_temp_counter.fetch_add(1));
  QCAL_ASSIGN_OR_RETURN(const int fd, OpenNoFollow(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_TRUNC,
                                                   0644, "cannot create temporary file"));
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp_path, fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  // Not committed (or the commit failed): leave `path_` alone and drop the partial file.
  if (!tmp_path_.empty()) ::unlink(tmp_path_.c_str());
}

Status AtomicFileWriter::Append(const void* data, size_t size) {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Append after Commit (or after a failed write)"));
  }
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd_);
      fd_ = -1;  // the destructor removes the temporary file
      return ErrnoError(error, tmp_path_, "write failed");
    }
    bytes += n;
    size -= static_cast<size_t>(n);
    bytes_written_ += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

Status AtomicFileWriter::Commit() {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Commit after Commit (or after a failed write)"));
  }
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    return ErrnoError(error, tmp_path_, "fsync failed");
  }
  if (::close(fd) != 0) return ErrnoError(errno, tmp_path_, "close failed");
  QCAL_RETURN_IF_ERROR(RenameNoFollow(tmp_path_, path_));
  tmp_path_.clear();  // committed: nothing for the destructor to remove
  return FsyncDir(DirName(path_));
}

}  // namespace qcal
