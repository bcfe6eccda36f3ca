// FNV-1a 64-bit hashing for cache keys and file checksums (not cryptographic: it detects
// truncated or changed files and mismatched settings, not tampering).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace qcal {

inline uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// 16 lower-case hex digits.
inline std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Hex64(Fnv1a64(bytes)).
inline std::string Fnv1aHex(std::string_view bytes) { return Hex64(Fnv1a64(bytes)); }

}  // namespace qcal
