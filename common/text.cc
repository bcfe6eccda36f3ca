#include "common/text.h"

#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/utf8.h"

namespace qcal {

std::string NormalizeNewlines(std::string text) {
  size_t out = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\r') {
      text[out++] = '\n';
      if (i + 1 < text.size() && text[i + 1] == '\n') ++i;
    } else {
      text[out++] = text[i];
    }
  }
  text.resize(out);
  return text;
}

StatusOr<std::string> ReadTextFile(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return NormalizeNewlines(std::move(text));
}

Status CheckLooksLikeText(const std::string& path, std::string_view text) {
  size_t bad = 0;
  size_t i = 0;
  while (i < text.size()) {
    const size_t at = FirstInvalidUtf8(text.substr(i));
    const size_t end = at == std::string_view::npos ? text.size() : i + at;
    for (size_t k = i; k < end; ++k) {
      const unsigned char c = static_cast<unsigned char>(text[k]);
      if ((c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\f') || c == 0x7f) ++bad;
    }
    if (end == text.size()) break;
    ++bad;  // the malformed byte; the scan resumes after it
    i = end + 1;
  }
  if (bad * 100 > text.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: does not look like text: %.1f%% of its %d bytes are control characters or malformed "
        "UTF-8 (calibration data must be UTF-8 text)",
        path, 100.0 * static_cast<double>(bad) / static_cast<double>(text.size()), text.size()));
  }
  return absl::OkStatus();
}

}  // namespace qcal
