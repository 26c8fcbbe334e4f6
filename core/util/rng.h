// The project's portable pseudo-random numbers. std:: distributions differ across standard
// libraries, so every draw that must repeat across builds and hosts (anchor sampling, feature
// noise seeds, epoch shuffles) goes through these integer-only generators.
#pragma once
#include <cstdint>

namespace dflash {

// One splitmix64 step: advances `state` by the 64-bit golden-ratio increment and returns the
// mixed value (the reference generator: state 0 gives 0xE220A8397B1DCDAF first).
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A splitmix64 generator with bounded and [0, 1) draws.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() { return splitmix64(state); }
  // Uniform in [0, n), n > 0: rejects the top (2^64 - 1) mod n values, so no modulo bias.
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t r;
    do r = next();
    while (r >= limit);
    return r % n;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
};

}  // namespace dflash
