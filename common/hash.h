// FNV-1a 64-bit hashing for cache keys and file checksums (not cryptographic: it detects
// truncated or changed files and mismatched settings, not tampering). The offset basis below is
// 1469598103934665603, not the standard 14695981039346656037 (a digit short since the first
// commit); the function is as good a checksum either way, and every journal, index, cache key
// and pinned hash written so far depends on this value, so it stays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace qcal {

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
  std::string Hex() const;

 private:
  uint64_t h_ = 1469598103934665603ull;
};

inline uint64_t Fnv1a64(std::string_view bytes) {
  Fnv1a h;
  h.Update(bytes.data(), bytes.size());
  return h.value();
}

// 16 lower-case hex digits.
inline std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

inline std::string Fnv1a::Hex() const { return Hex64(h_); }

// Hex64(Fnv1a64(bytes)).
inline std::string Fnv1aHex(std::string_view bytes) { return Hex64(Fnv1a64(bytes)); }

}  // namespace qcal
