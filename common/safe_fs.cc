#include "common/safe_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/io_util.h"

namespace qcal {
namespace {

using io::ErrnoError;
using io::ScopedFd;

Status LinkRefusal(const std::string& path, const std::string& component) {
  std::string target;
  char buf[PATH_MAX];
  const ssize_t n = ::readlink(component.c_str(), buf, sizeof(buf) - 1);
  if (n > 0) target = absl::StrCat(" (to ", io::Printable(absl::string_view(buf, n), 200), ")");
  const std::string where = component == path ? "" : absl::StrCat(": ", component);
  return absl::FailedPreconditionError(absl::StrCat(path, where, " is a symbolic link", target,
                                                    "; ", kLinkRefusal));
}

// The path's components; `absolute` says whether it starts at "/".
std::vector<std::string> Components(const std::string& path, bool* absolute) {
  *absolute = !path.empty() && path[0] == '/';
  std::vector<std::string> parts;
  size_t pos = 0;
  while (pos < path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string::npos) slash = path.size();
    std::string part = path.substr(pos, slash - pos);
    if (!part.empty() && part != ".") parts.push_back(std::move(part));
    pos = slash + 1;
  }
  return parts;
}

std::string Prefix(bool absolute, const std::vector<std::string>& parts, size_t count) {
  std::string out = absolute ? "/" : "";
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) out += "/";
    out += parts[i];
  }
  return out.empty() ? "." : out;
}

// Opens the directory made of the first `count` components, each below the previous one with
// O_NOFOLLOW, creating missing ones when `create`.
StatusOr<int> WalkDirs(const std::string& path, bool absolute,
                       const std::vector<std::string>& parts, size_t count, bool create,
                       mode_t mode) {
  int fd = ::open(absolute ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, absolute ? "/" : ".", "cannot open directory");
  for (size_t i = 0; i < count; ++i) {
    const std::string& c = parts[i];
    int next = ::openat(fd, c.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0 && errno == ENOENT && create) {
      if (::mkdirat(fd, c.c_str(), mode) != 0 && errno != EEXIST) {
        const int error = errno;
        ::close(fd);
        return ErrnoError(error, path,
                          absl::StrCat("cannot create directory ", Prefix(absolute, parts, i + 1)));
      }
      TraceWrite(Prefix(absolute, parts, i + 1));
      next = ::openat(fd, c.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (next < 0) {
      const int error = errno;
      struct stat st;
      const bool link =
          ::fstatat(fd, c.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
      ::close(fd);
      const std::string prefix = Prefix(absolute, parts, i + 1);
      if (link) return LinkRefusal(path, prefix);
      if (error == ENOTDIR) {
        return absl::FailedPreconditionError(
            absl::StrCat(prefix, ": exists and is not a directory (for ", path, ")"));
      }
      return ErrnoError(error, path, absl::StrCat("cannot open directory ", prefix));
    }
    ::close(fd);
    fd = next;
  }
  return fd;
}

bool Writes(int flags) {
  return (flags & O_CREAT) != 0 || (flags & O_ACCMODE) == O_WRONLY ||
         (flags & O_ACCMODE) == O_RDWR || (flags & O_TRUNC) != 0;
}

}  // namespace

void TraceWrite(const std::string& path) {
  static const char* trace = std::getenv("QCAL_TRACE_WRITES");
  if (trace == nullptr || *trace == '\0') return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  // The trace file is the test's own, outside any job directory.
  const int fd = ::open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  const std::string line = path + "\n";
  (void)!::write(fd, line.data(), line.size());
  ::close(fd);
}

StatusOr<std::string> CanonicalPath(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return absl::InvalidArgumentError("empty path");
  std::string absolute = path;
  if (path[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) {
      return ErrnoError(errno, path, "cannot resolve against the working directory");
    }
    absolute = absl::StrCat(cwd, "/", path);
  }
  bool is_absolute = true;
  const std::vector<std::string> parts = Components(absolute, &is_absolute);
  for (size_t n = parts.size() + 1; n-- > 0;) {
    const std::string prefix = Prefix(true, parts, n);
    char resolved[PATH_MAX];
    if (::realpath(prefix.c_str(), resolved) == nullptr) {
      if (errno == ENOENT || errno == ENOTDIR) continue;
      return ErrnoError(errno, prefix, "cannot resolve");
    }
    fs::path out(resolved);
    for (size_t i = n; i < parts.size(); ++i) out /= parts[i];
    std::string s = out.lexically_normal().string();
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    return s;
  }
  return absl::InternalError(absl::StrCat(path, ": cannot resolve '/'"));
}

StatusOr<int> OpenNoFollow(const std::string& path, int flags, mode_t mode, const char* what) {
  bool absolute = false;
  const std::vector<std::string> parts = Components(path, &absolute);
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' names no file"));
  }
  QCAL_ASSIGN_OR_RETURN(int dir, WalkDirs(path, absolute, parts, parts.size() - 1, false, 0));
  ScopedFd dir_fd(dir);
  const bool writes = Writes(flags);
  // O_NONBLOCK: a FIFO planted where a file is expected must not hang the opener; cleared below.
  const int fd = ::openat(dir, parts.back().c_str(),
                          flags | O_NOFOLLOW | O_CLOEXEC | (writes ? O_NONBLOCK : 0), mode);
  if (fd < 0) {
    const int error = errno;
    struct stat st;
    if (::fstatat(dir, parts.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      if (S_ISLNK(st.st_mode)) return LinkRefusal(path, path);
      if (writes && !S_ISREG(st.st_mode)) {  // a FIFO without a reader fails with ENXIO
        return absl::FailedPreconditionError(absl::StrCat(
            path, ": ", what, ": not a regular file; qcal writes only regular files in a job's "
            "directories"));
      }
    }
    return ErrnoError(error, path, what);
  }
  if (writes) {
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": ", what, ": not a regular file; qcal writes only regular files in a job's "
          "directories"));
    }
    if ((flags & O_NONBLOCK) == 0) (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    TraceWrite(path);
  }
  return fd;
}

StatusOr<ParentDir> OpenParentNoFollow(const std::string& path) {
  bool absolute = false;
  const std::vector<std::string> parts = Components(path, &absolute);
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' names no file"));
  }
  ParentDir out;
  QCAL_ASSIGN_OR_RETURN(out.fd, WalkDirs(path, absolute, parts, parts.size() - 1, false, 0));
  out.name = parts.back();
  return out;
}

Status MakeDirs(const std::string& path, mode_t mode) {
  if (path.empty()) return absl::InvalidArgumentError("MakeDirs: empty path");
  bool absolute = false;
  const std::vector<std::string> parts = Components(path, &absolute);
  QCAL_ASSIGN_OR_RETURN(int fd, WalkDirs(path, absolute, parts, parts.size(), true, mode));
  ::close(fd);
  TraceWrite(path);
  return absl::OkStatus();
}

Status RenameNoFollow(const std::string& from, const std::string& to) {
  QCAL_ASSIGN_OR_RETURN(ParentDir src, OpenParentNoFollow(from));
  ScopedFd src_fd(src.fd);
  QCAL_ASSIGN_OR_RETURN(ParentDir dst, OpenParentNoFollow(to));
  ScopedFd dst_fd(dst.fd);
  struct stat st;
  if (::fstatat(dst.fd, dst.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISLNK(st.st_mode)) return LinkRefusal(to, to);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          to, ": exists and is not a regular file; qcal replaces only regular files"));
    }
  }
  if (::renameat(src.fd, src.name.c_str(), dst.fd, dst.name.c_str()) != 0) {
    return ErrnoError(errno, to, absl::StrCat("cannot rename ", from, " over it"));
  }
  TraceWrite(to);
  return absl::OkStatus();
}

Status CheckNoLinks(const std::string& path) {
  bool absolute = false;
  const std::vector<std::string> parts = Components(path, &absolute);
  for (size_t i = 1; i <= parts.size(); ++i) {
    const std::string prefix = Prefix(absolute, parts, i);
    struct stat st;
    if (::lstat(prefix.c_str(), &st) != 0) {
      if (errno == ENOENT) return absl::OkStatus();
      return ErrnoError(errno, prefix, "cannot stat");
    }
    if (S_ISLNK(st.st_mode)) return LinkRefusal(path, prefix);
  }
  return absl::OkStatus();
}

bool PathIsUnder(const std::string& path, const std::string& root) {
  if (root == "/") return !path.empty() && path[0] == '/';
  if (path.size() < root.size() || path.compare(0, root.size(), root) != 0) return false;
  return path.size() == root.size() || path[root.size()] == '/';
}

namespace {

Status NotRegularForCopy(const std::string& path) {
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": not a regular file; qcal copies only regular files"));
}

}  // namespace

StatusOr<std::string> ResolveForCopy(const std::string& path,
                                     const std::vector<std::string>& allowed) {
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) {
    return ErrnoError(errno, path, "cannot resolve for copying");
  }
  const std::string real(resolved);
  bool inside = false;
  for (const std::string& root : allowed) inside |= PathIsUnder(real, root);
  if (!inside) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": resolves to ", io::Printable(real, 200), ", outside the model directory; qcal "
        "copies only files that lie inside it (a link to a file elsewhere is refused)"));
  }
  struct stat st;
  if (::stat(real.c_str(), &st) != 0) return ErrnoError(errno, path, "cannot stat");
  if (!S_ISREG(st.st_mode)) return NotRegularForCopy(path);
  return real;
}

StatusOr<std::string> ReadFileForCopy(const std::string& path,
                                      const std::vector<std::string>& allowed) {
  QCAL_ASSIGN_OR_RETURN(const std::string real, ResolveForCopy(path, allowed));
  // O_NONBLOCK: a FIFO must not hang the copy (it is refused below; no effect on a file).
  QCAL_ASSIGN_OR_RETURN(int fd,
                        OpenNoFollow(real, O_RDONLY | O_NONBLOCK, 0, "cannot open for copying"));
  ScopedFd file(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, path, "cannot stat");
  if (!S_ISREG(st.st_mode)) return NotRegularForCopy(path);  // swapped since the check
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, path, "read failed");
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace qcal
