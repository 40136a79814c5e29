// uniform_float (uniform_float.h) gives the standard distribution's values, draw for draw, so the
// harnesses that fill tensors through it keep the inputs (and so the seeds' outcomes) they had.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "conformance/uniform_float.h"

namespace pagedattn::conformance {
namespace {

TEST(UniformFloat, MatchesTheStandardDistributionDrawForDraw) {
  const float ranges[][2] = {{-1.f, 1.f}, {-2.f, 2.f}, {0.f, 1.f}, {-0.5f, 3.f}, {1e-3f, 1e3f}};
  for (uint64_t seed : {0ull, 1ull, 201ull, 0x9E3779B97F4A7C15ull}) {
    for (const auto& r : ranges) {
      std::mt19937_64 a(seed), b(seed);
      std::uniform_real_distribution<float> dist(r[0], r[1]);
      for (int i = 0; i < 20000; ++i) {
        const float want = dist(a), got = uniform_float(b, r[0], r[1]);
        ASSERT_EQ(want, got) << "seed " << seed << " range [" << r[0] << ", " << r[1]
                             << ") draw " << i;
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn::conformance
