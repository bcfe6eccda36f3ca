// FNV-1a 64-bit hashing (and ContentHash, below) for cache keys and file checksums (not cryptographic: it detects
// truncated or changed files and mismatched settings, not tampering). The offset basis below is
// 1469598103934665603, not the standard 14695981039346656037 (a digit short since the first
// commit); the function is as good a checksum either way, and every journal, index, cache key
// and pinned hash written so far depends on this value, so it stays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstring>
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

// A fast 64-bit content hash for large inputs (a 70B model's 140 GB of shards), fed in pieces:
// four independent multiply-rotate lanes over 32-byte stripes, then a mix of the lanes, the
// length and the tail (the structure of xxHash64; not bit-compatible with it, and not
// cryptographic). FNV-1a above does a byte a step; this does eight per lane, so hashing a shard
// is bound by the disk, not the hash. Little-endian hosts (every platform qcal builds on).
class ContentHash {
 public:
  void Update(const void* data, size_t size);
  uint64_t Finish() const;

 private:
  static constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                            kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                            kP5 = 0x27D4EB2F165667C5ull;
  static uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t Round(uint64_t acc, uint64_t in) { return Rotl(acc + in * kP2, 31) * kP1; }
  static uint64_t Load64(const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  void Stripe(const unsigned char* p) {
    for (int i = 0; i < 4; ++i) lanes_[i] = Round(lanes_[i], Load64(p + 8 * i));
  }

  uint64_t lanes_[4] = {kP1 + kP2, kP2, 0, 0ull - kP1};
  unsigned char buffer_[32] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

inline void ContentHash::Update(const void* data, size_t size) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += size;
  if (buffered_ > 0) {
    const size_t take = std::min(size, 32 - buffered_);
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    size -= take;
    if (buffered_ < 32) return;
    Stripe(buffer_);
    buffered_ = 0;
  }
  for (; size >= 32; p += 32, size -= 32) Stripe(p);
  std::memcpy(buffer_, p, size);
  buffered_ = size;
}

inline uint64_t ContentHash::Finish() const {
  uint64_t h = Rotl(lanes_[0], 1) + Rotl(lanes_[1], 7) + Rotl(lanes_[2], 12) + Rotl(lanes_[3], 18);
  for (uint64_t lane : lanes_) h = (h ^ Round(0, lane)) * kP1 + kP4;
  h += total_;
  size_t i = 0;
  for (; i + 8 <= buffered_; i += 8) h = Rotl(h ^ Round(0, Load64(buffer_ + i)), 27) * kP1 + kP4;
  for (; i < buffered_; ++i) h = Rotl(h ^ (buffer_[i] * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

}  // namespace qcal
