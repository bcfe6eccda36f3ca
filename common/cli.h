// What every qcal program's command line shares: errors on stderr with exit code 1 (under the
// program's name), byte sizes from flags.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace qcal {

// The name error messages start with ("qcal", "qcal-coordinator", ...); set once in main().
void SetProgramName(const std::string& name);

// Prints "<program>: error: <message>" to stderr; returns 1 (the exit code).
int Fail(const std::string& message);
int Fail(const Status& status);
// For errors a remote service returned: "<program>: error: <CODE>: <message>"
// (UNAUTHENTICATED, NOT_FOUND, ... tell the user which side to fix).
int FailRpc(const Status& status);

// The most compute threads a flag (--threads) or a job spec may ask for per process.
inline constexpr int kMaxThreads = 1024;

// "8G", "512M", "64K", "1024" (bytes) -> bytes. InvalidArgument naming `flag` otherwise.
StatusOr<int64_t> ParseBytes(const std::string& text, const std::string& flag);

}  // namespace qcal
