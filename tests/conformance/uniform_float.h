// uniform_float(rng, lo, hi): std::uniform_real_distribution<float>(lo, hi)(rng) for
// std::mt19937_64, value for value, without the standard library's per-call cost. libstdc++'s
// generate_canonical<float, 24> takes one 64-bit draw and divides it by 2^64, but computes
// log2(2^64) with a long double std::log on every call; unoptimised (the ASan build is -O1) that
// logl was ~20% of the batch-invariance tests' time, spent filling caches. The harnesses fill
// tensors through this; tests/conformance/uniform_float_test.cpp checks it against the standard
// distribution draw for draw.
#pragma once

#include <cmath>
#include <random>

namespace pagedattn::conformance {

inline float uniform_float(std::mt19937_64& rng, float lo, float hi) {
  static_assert(std::mt19937_64::min() == 0 && std::mt19937_64::max() == ~0ull);
  float u = static_cast<float>(rng()) / 18446744073709551616.f;  // 2^64
  if (u >= 1.f) u = std::nextafter(1.f, 0.f);
  return u * (hi - lo) + lo;
}

}  // namespace pagedattn::conformance
