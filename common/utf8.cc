#include "common/utf8.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qcal {

size_t FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    int len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (int k = 1; k < len; ++k) {
      const uint8_t cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string DescribeInvalidUtf8(std::string_view s) {
  const size_t at = FirstInvalidUtf8(s);
  if (at == std::string_view::npos) return "";
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < at; ++i) {
    if (s[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return absl::StrFormat("line %d, byte %d (0x%02x)", line, at - line_start + 1,
                         static_cast<unsigned>(static_cast<uint8_t>(s[at])));
}

}  // namespace qcal
