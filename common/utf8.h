// UTF-8 validation, for every place that takes text from a user and hands it to something that
// requires UTF-8 (JSON, protobuf strings, tokenizers).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace qcal {

// The byte offset of the first byte that does not start a well-formed UTF-8 sequence (overlongs,
// surrogates and codepoints above U+10FFFF are malformed); npos when `s` is well-formed.
size_t FirstInvalidUtf8(std::string_view s);

inline bool IsValidUtf8(std::string_view s) {
  return FirstInvalidUtf8(s) == std::string_view::npos;
}

// InvalidArgument-ready description of where `s` stops being UTF-8: "line 3, byte 17 (0xff)";
// empty when it is well-formed.
std::string DescribeInvalidUtf8(std::string_view s);

}  // namespace qcal
