#include "common/io_util.h"

#include <errno.h>
#include <sys/statvfs.h>

#include <cstdlib>

#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qcal::io {
namespace {

using json = nlohmann::json;

// SAX consumer that only remembers the parser's message; it never throws.
class JsonErrorCollector {
 public:
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) { return true; }
  bool key(json::string_t&) { return true; }
  bool end_object() { return true; }
  bool start_array(std::size_t) { return true; }
  bool end_array() { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) {
    message = error.what();
    return false;
  }
  std::string message;
};

}  // namespace

std::string Printable(absl::string_view text, size_t max_len) {
  std::string out;
  for (char c : text.substr(0, max_len)) {
    const unsigned char u = static_cast<unsigned char>(c);
    out.push_back(u >= 0x20 && u < 0x7f ? c : '?');
  }
  if (text.size() > max_len) out += "...";
  return out;
}

std::string ErrnoText(int error) {
  char buffer[256];
  // GNU strerror_r (glibc with _GNU_SOURCE, which both g++ and clang++ define for C++).
  return std::string(strerror_r(error, buffer, sizeof(buffer)));
}

Status ErrnoError(int error, absl::string_view path, absl::string_view what) {
  if (error == ENOSPC || error == EDQUOT) {
    // Name the room left, and make it FailedPrecondition: retrying elsewhere cannot help until
    // someone frees space (then resubmitting resumes from the journal).
    const std::string p(path);
    std::string dir = p.substr(0, p.rfind('/') == std::string::npos ? 0 : p.rfind('/'));
    if (dir.empty()) dir = p.rfind('/') == 0 ? "/" : ".";
    struct statvfs vfs;
    std::string room;
    if (::statvfs(dir.c_str(), &vfs) == 0) {
      const double free_mib = static_cast<double>(vfs.f_bavail) * vfs.f_frsize / (1 << 20);
      const double total_mib = static_cast<double>(vfs.f_blocks) * vfs.f_frsize / (1 << 20);
      room = absl::StrFormat(" (%.1f MiB free of %.1f MiB on the filesystem of %s)", free_mib,
                             total_mib, dir);
    }
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": ", what, ": ", ErrnoText(error), room, "; ", kOutOfSpaceAdvice));
  }
  return Status(absl::ErrnoToStatusCode(error),
                absl::StrCat(path, ": ", what, ": ", ErrnoText(error)));
}

std::string JsonParseErrorMessage(std::string_view text) {
  JsonErrorCollector collector;
  json::sax_parse(text.data(), text.data() + text.size(), &collector);
  std::string message = collector.message;
  if (!message.empty() && message[0] == '[') {
    const size_t close = message.find("] ");
    if (close != std::string::npos) message.erase(0, close + 2);
  }
  if (message.empty()) message = "parse error";
  return Printable(message, 300);
}

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  const std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

std::string FindProgram(const std::string& name, const std::string& build_subdir) {
  auto executable = [](const std::string& p) { return ::access(p.c_str(), X_OK) == 0; };
  const std::string dir = ExecutableDir();
  for (const std::string& candidate : {dir + "/" + name, dir + "/../" + build_subdir + "/" + name}) {
    if (executable(candidate)) return candidate;
  }
  if (const char* path = std::getenv("PATH")) {
    const std::string p = path;
    size_t start = 0;
    while (start <= p.size()) {
      const size_t end = p.find(':', start);
      const std::string d =
          p.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (!d.empty() && executable(d + "/" + name)) return d + "/" + name;
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  return name;
}

}  // namespace qcal::io
