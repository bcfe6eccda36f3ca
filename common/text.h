// Reading calibration and evaluation text.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace qcal {

// Converts "\r\n" and lone "\r" to "\n" — what Python's text mode (universal newlines) does, and
// therefore what the reference perplexities and the usual evaluation scripts see.
std::string NormalizeNewlines(std::string text);

// Reads a UTF-8 text file with newlines normalised. Errors name the path.
StatusOr<std::string> ReadTextFile(const std::string& path);

// InvalidArgument naming `path` when `text` is not text: more than 1% of its bytes are control
// characters (other than tab, newline, carriage return, form feed) or malformed UTF-8 — a binary
// file, random bytes or zeros given as calibration data.
Status CheckLooksLikeText(const std::string& path, std::string_view text);

}  // namespace qcal
