// FNV-1a 64-bit hashing for cache keys and file checksums (not cryptographic: it detects
// truncated or changed files and mismatched settings, not tampering).
#pragma once

#include <cstddef>
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

// FNV-1a over bytes fed in pieces (a file checksummed as it is written).
class Fnv1a {
 public:
  void Update(const void* data, size_t size) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  uint64_t value() const { return h_; }
  std::string Hex() const { return Hex64(h_); }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// Hex64(Fnv1a64(bytes)).
inline std::string Fnv1aHex(std::string_view bytes) { return Hex64(Fnv1a64(bytes)); }

}  // namespace qcal
