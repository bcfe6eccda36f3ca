// Reading calibration and evaluation text.
#pragma once

#include <string>

#include "common/status.h"

namespace qcal {

// Converts "\r\n" and lone "\r" to "\n" — what Python's text mode (universal newlines) does, and
// therefore what the reference perplexities and the usual evaluation scripts see.
std::string NormalizeNewlines(std::string text);

// Reads a UTF-8 text file with newlines normalised. Errors name the path.
StatusOr<std::string> ReadTextFile(const std::string& path);

}  // namespace qcal
