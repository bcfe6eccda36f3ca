// Seed mixing for every derived random stream (transforms, splits, shuffles, test inputs):
// SplitMix64's finaliser (Steele, Lea, Flood 2014), a bijection on 64 bits whose outputs for
// neighbouring inputs are unrelated. One definition, so a seed derived in one place is the seed
// derived everywhere.
#pragma once

#include <cstdint>

namespace qcal {

constexpr uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The seed of stream `stream` (a constant naming its purpose), item `index`, under `seed`.
constexpr uint64_t DeriveSeed(uint64_t seed, uint64_t stream, uint64_t index = 0) {
  return SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ index);
}

}  // namespace qcal
