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

// A path flag where qcal writes, made canonical as it is parsed (CanonicalPath in
// common/safe_fs.h: below it nothing is written through a link); unchanged when it cannot be
// resolved (the command's own checks then name the problem). For CLI11's Option::transform.
std::string CanonicalFlagPath(std::string path);

// "8G", "512M", "64K", "1024" (bytes) -> bytes. InvalidArgument naming `flag` otherwise.
StatusOr<int64_t> ParseBytes(const std::string& text, const std::string& flag);

}  // namespace qcal
