// Scalar element conversions of the CPU backend, bit-exact with the core conversions in
// include/pagedattn/dtype.h (round to nearest even; fp8 saturates to the finite max; NaN stays
// NaN). Header-only with internal linkage so that each ISA translation unit gets its own copy
// (see cpu_kernels.h); tests/cpu checks them exhaustively against the core functions.
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedattn::cpu {
namespace {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline float bf16_to_f32(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even; NaN -> quiet NaN with the sign kept; overflow rounds to inf.
inline uint16_t f32_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal or zero: mant * 2^-24 (exact in f32).
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return bits_float(sign | float_bits(magnitude));
}

// Round to nearest even; overflow -> inf; NaN -> quiet NaN.
inline uint16_t f32_to_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  const uint32_t exp = abs >> 23;
  if (exp >= 113) {  // f16 normal
    const uint32_t rebased = abs - (112u << 23);
    const uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  // f16 subnormal or zero: round |x| / 2^-24 to an integer (ties to even).
  if (exp < 101) return sign;  // below half the smallest subnormal (2^-25): rounds to 0
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;  // 24-bit significand
  const uint32_t shift = 126u - exp;                    // 2^-24 units: value = mant >> shift
  const uint32_t integer = mant >> shift;
  const uint32_t remainder = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  uint32_t result = integer;
  if (remainder > half || (remainder == half && (integer & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

// OCP E4M3FN: bias 7, no inf, NaN = S.1111.111, max 448.
inline float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return bits_float(sign | 0x7FC00000u);
  if (exp != 0) return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
  const float magnitude = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
  return bits_float(sign | float_bits(magnitude));
}

// OCP E5M2: the upper byte of an IEEE f16.
inline float fp8_e5m2_to_f32(uint8_t b) { return f16_to_f32(static_cast<uint16_t>(b) << 8); }

// Round to nearest even, saturating to +-448; NaN -> 0x7F | sign.
inline uint8_t f32_to_fp8_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);
  if (abs >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448 (and inf)
  const uint32_t exp = abs >> 23;
  if (exp >= 121) {  // e4m3 normal: 2^-6 and up
    const uint32_t rebased = abs - (120u << 23);
    const uint32_t rounded = rebased + 0x7FFFFu + ((rebased >> 20) & 1u);
    const uint32_t out = rounded >> 20;
    return static_cast<uint8_t>(sign | (out > 0x7Eu ? 0x7Eu : out));
  }
  // Subnormal or zero: |x| / 2^-9 rounded to an integer in [0, 8] (8 = the smallest normal).
  if (exp < 112) return sign;  // below 2^-10 (half of 2^-9): rounds to 0
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 141u - exp;  // |x| / 2^-9 = mant * 2^(exp - 150 + 9)
  const uint32_t integer = mant >> shift;
  const uint32_t remainder = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  uint32_t result = integer;
  if (remainder > half || (remainder == half && (integer & 1u))) ++result;
  return static_cast<uint8_t>(sign | result);
}

}  // namespace
}  // namespace pagedattn::cpu
