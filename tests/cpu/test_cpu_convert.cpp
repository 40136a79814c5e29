// The CPU backend's scalar conversions (src/backends/cpu/cpu_convert.h) are bit-exact with the
// core conversions of include/pagedattn/dtype.h: every 8- and 16-bit input, and f32 inputs that
// cover every rounding case (ties, subnormals, overflow, saturation, NaN, infinities).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../../src/backends/cpu/cpu_convert.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cpu {
namespace {

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4);
  std::memcpy(&ub, &b, 4);
  return ua == ub;  // distinguishes -0 from +0
}

// f32 inputs: every exponent with edge mantissas (ties of every target format), random
// values, and the specials.
std::vector<float> probe_floats() {
  std::vector<float> values;
  for (uint32_t exp = 0; exp < 256; ++exp) {
    for (uint32_t mant : {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFu, 0x1000u, 0x1001u, 0x7FFFFu,
                          0x80000u, 0x80001u, 0x100000u, 0x17FFFFu, 0x180000u, 0x3FFFFFu,
                          0x400000u, 0x7FFFFFu, 0x0FFFFFu}) {
      for (uint32_t sign : {0u, 0x80000000u}) {
        const uint32_t bits = sign | (exp << 23) | mant;
        float f;
        std::memcpy(&f, &bits, 4);
        values.push_back(f);
      }
    }
  }
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = any_bits(rng);
    float f;
    std::memcpy(&f, &bits, 4);
    values.push_back(f);
  }
  std::uniform_real_distribution<float> moderate(-600.f, 600.f);
  for (int i = 0; i < 100000; ++i) values.push_back(moderate(rng));
  for (float f : {448.f, 464.f, 480.f, 500.f, 57344.f, 65504.f, 65519.f, 65520.f, 1e-9f, -1e-9f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    values.push_back(f);
  }
  return values;
}

TEST(CpuConvert, SixteenBitFormatsToF32AreExactForEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    ASSERT_TRUE(same_float(bf16_to_f32(h), bf16_bits_to_f32(h))) << "bf16 bits " << bits;
    ASSERT_TRUE(same_float(f16_to_f32(h), f16_bits_to_f32(h))) << "f16 bits " << bits;
  }
}

TEST(CpuConvert, Fp8FormatsToF32AreExactForEveryBitPattern) {
  for (uint32_t bits = 0; bits < 256; ++bits) {
    const auto b = static_cast<uint8_t>(bits);
    ASSERT_TRUE(same_float(fp8_e4m3_to_f32(b), fp8_e4m3_bits_to_f32(b))) << "e4m3 bits " << bits;
    ASSERT_TRUE(same_float(fp8_e5m2_to_f32(b), fp8_e5m2_bits_to_f32(b))) << "e5m2 bits " << bits;
  }
}

TEST(CpuConvert, F32ToNarrowFormatsMatchTheCoreRounding) {
  for (float f : probe_floats()) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(f32_to_fp8_e4m3(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), f32_to_bf16_bits(f)) << "bf16 of " << f;
    ASSERT_EQ(f32_to_f16(f), f32_to_f16_bits(f)) << "f16 of " << f;
    ASSERT_EQ(f32_to_fp8_e4m3(f), f32_to_fp8_e4m3_bits(f)) << "e4m3 of " << f;
  }
}

}  // namespace
}  // namespace pagedattn::cpu
