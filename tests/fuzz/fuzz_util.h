// Helpers shared by the libFuzzer targets.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace qcal::fuzz {

// A broken invariant is as bad as a crash: abort so the fuzzer records the input.
inline void Check(bool condition) {
  if (!condition) std::abort();
}

// Writes the fuzz input to this process's scratch file (for loaders that read paths), in
// memory-backed /dev/shm when present, and returns its path. `name` tells targets apart.
inline std::string WriteInput(const char* name, const uint8_t* data, size_t size) {
  static const std::string path = [name] {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/qcal-" + name + "-fuzz-" + std::to_string(::getpid());
  }();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace qcal::fuzz
