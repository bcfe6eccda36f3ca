// Small helpers shared by the parsers and file code in common/ (not a public API).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "common/status.h"

namespace qcal::io {

// Debian's abseil is built with its own absl::string_view (not std::string_view), and the two do
// not convert implicitly; public qcal headers use std::string_view.
inline absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// `text` with control and non-ASCII bytes replaced by '?', cut to max_len (for error messages).
std::string Printable(absl::string_view text, size_t max_len = 120);

// strerror for `error`, thread-safe.
std::string ErrnoText(int error);

// "<path>: <what>: <strerror>" with the code abseil maps errno to (ENOENT -> NotFound, ...).
// A full disk or quota (ENOSPC, EDQUOT) is FailedPrecondition, with the space free on that
// filesystem and kOutOfSpaceAdvice: every file a job writes fails with this one message.
Status ErrnoError(int error, absl::string_view path, absl::string_view what);

// What to do about a full disk; ends every out-of-space error (IsOutOfSpace finds it).
inline constexpr char kOutOfSpaceAdvice[] =
    "free space on that filesystem and run the job again: its finished blocks and calibration "
    "products are kept in the job and output directories and are resumed (deleting them loses "
    "that work)";
// Whether `status` is an out-of-space error (ErrnoError's, passed on as text by any process).
inline bool IsOutOfSpace(const Status& status) {
  return !status.ok() && status.message().find(kOutOfSpaceAdvice) != absl::string_view::npos;
}

// The reason nlohmann's parser rejects `text` (its non-throwing parse only says "discarded"),
// without the "[json.exception.parse_error.N] " prefix, printable and at most 300 characters.
std::string JsonParseErrorMessage(std::string_view text);

// The directory of the running executable (/proc/self/exe), "." when unknown.
std::string ExecutableDir();
// The program `name` beside the running executable, in the build tree's sibling folder
// `build_subdir` (../<build_subdir>/<name>), or on PATH; `name` alone when none is found.
std::string FindProgram(const std::string& name, const std::string& build_subdir);

// Closes a file descriptor when it goes out of scope.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace qcal::io
