#include "common/cli.h"

#include "common/safe_fs.h"

#include <cstdio>
#include <limits>

#include "absl/strings/str_cat.h"

namespace qcal {
namespace {

std::string& ProgramName() {
  static std::string* name = new std::string("qcal");
  return *name;
}

}  // namespace

void SetProgramName(const std::string& name) { ProgramName() = name; }

int Fail(const std::string& message) {
  std::fprintf(stderr, "%s: error: %s\n", ProgramName().c_str(), message.c_str());
  return 1;
}

std::string CanonicalFlagPath(std::string path) {
  if (path.empty()) return path;
  StatusOr<std::string> canonical = CanonicalPath(path);
  return canonical.ok() ? *canonical : path;
}

int Fail(const Status& status) { return Fail(std::string(status.message())); }

int FailRpc(const Status& status) {
  return Fail(absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
}

StatusOr<int64_t> ParseBytes(const std::string& text, const std::string& flag) {
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " '", text, "' is not a size (bytes, or a number with K, M, G or T)"));
  };
  if (text.empty()) return bad();
  size_t i = 0;
  int64_t value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) return bad();
    value = value * 10 + (text[i++] - '0');
  }
  if (i == 0) return bad();
  int shift = 0;
  if (i < text.size()) {
    switch (text[i] == 'b' || text[i] == 'B' ? 0 : text[i]) {
      case 'k': case 'K': shift = 10; break;
      case 'm': case 'M': shift = 20; break;
      case 'g': case 'G': shift = 30; break;
      case 't': case 'T': shift = 40; break;
      default: return bad();
    }
    ++i;
    if (i < text.size() && (text[i] == 'b' || text[i] == 'B' || text[i] == 'i')) ++i;
    if (i < text.size() && (text[i] == 'b' || text[i] == 'B')) ++i;
    if (i != text.size()) return bad();
  }
  if (shift > 0 && value > (std::numeric_limits<int64_t>::max() >> shift)) return bad();
  return value << shift;
}

}  // namespace qcal
