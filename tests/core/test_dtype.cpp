// Scalar conversions against independent references: exhaustive over every 16-bit and 8-bit
// pattern, every pair of adjacent f16 values (midpoints, ties to even), and a large sample of
// f32 patterns for bf16 (reference: nearest-even selection in long double).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "pagedattn/dtype.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

bool f16_is_nan(uint16_t b) { return (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0; }
bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

// ---- f16 ---------------------------------------------------------------------------------------

TEST(F16, EveryPatternRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float f = f16_bits_to_f32(b);
    if (f16_is_nan(b)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_TRUE(f16_is_nan(f32_to_f16_bits(f))) << std::hex << i;
      ASSERT_EQ(f32_to_f16_bits(f) & 0x8000u, b & 0x8000u) << "NaN sign kept " << std::hex << i;
    } else {
      ASSERT_EQ(f32_to_f16_bits(f), b) << std::hex << i;
    }
  }
}

// Value of a finite f16 pattern by the IEEE formula (independent of the decoder under test).
double f16_formula(uint16_t b) {
  const int e = (b >> 10) & 0x1f;
  const int m = b & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (b & 0x8000) ? -mag : mag;
}

TEST(F16, DecodeMatchesFormula) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    if ((b & 0x7c00u) == 0x7c00u) continue;
    ASSERT_EQ(static_cast<double>(f16_bits_to_f32(b)), f16_formula(b)) << std::hex << i;
  }
  EXPECT_EQ(f16_bits_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_bits_to_f32(0xfc00), -std::numeric_limits<float>::infinity());
}

// Every pair of adjacent positive f16 values (h, h+1), including the last finite one and the
// virtual next value 65536 (= inf): the midpoint goes to the even pattern, one f32 ulp either side
// goes to the nearer one; both signs.
TEST(F16, MidpointsOfAdjacentValuesRoundToNearestEven) {
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const double lo = f16_formula(static_cast<uint16_t>(h));
    const double hi = h + 1 == 0x7c00u ? 65536.0 : f16_formula(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint exact in f32";
    const uint16_t even = static_cast<uint16_t>((h & 1u) ? h + 1 : h);
    const float below = std::nextafter(mid, 0.0f);
    const float above = std::nextafter(mid, std::numeric_limits<float>::infinity());
    for (const float sign : {1.0f, -1.0f}) {
      const uint16_t s = sign < 0 ? 0x8000 : 0;
      ASSERT_EQ(f32_to_f16_bits(sign * static_cast<float>(lo)), s | h) << std::hex << h;
      ASSERT_EQ(f32_to_f16_bits(sign * mid), s | even) << std::hex << h;
      ASSERT_EQ(f32_to_f16_bits(sign * below), s | h) << std::hex << h;
      ASSERT_EQ(f32_to_f16_bits(sign * above), s | (h + 1)) << std::hex << h;
    }
  }
}

TEST(F16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_f16_bits(inf), 0x7c00);
  EXPECT_EQ(f32_to_f16_bits(-inf), 0xfc00);
  EXPECT_EQ(f32_to_f16_bits(1e30f), 0x7c00);
  EXPECT_EQ(f32_to_f16_bits(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f32_to_f16_bits(0x1p-25f), 0x0000);                        // tie -> even (0)
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(0x1p-25f, 1.0f)), 0x0001);  // above the tie
  EXPECT_EQ(f32_to_f16_bits(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16_bits(0x3p-25f), 0x0002);  // 1.5 * 2^-24: tie between 1 and 2 -> 2
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00);
  EXPECT_TRUE(f16_is_nan(f32_to_f16_bits(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(f16_is_nan(f32_to_f16_bits(std::numeric_limits<float>::signaling_NaN())));
  // A NaN whose payload sits only in the low f32 bits must not become inf.
  EXPECT_TRUE(f16_is_nan(f32_to_f16_bits(std::bit_cast<float>(0x7f800001u))));
}

// ---- bf16 --------------------------------------------------------------------------------------

TEST(BF16, EveryPatternRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float f = bf16_bits_to_f32(b);
    if (bf16_is_nan(b)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_TRUE(bf16_is_nan(f32_to_bf16_bits(f))) << std::hex << i;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(f), i << 16) << std::hex << i;
      ASSERT_EQ(f32_to_bf16_bits(f), b) << std::hex << i;
    }
  }
}

// Reference: the two bf16 candidates around x (truncated toward zero and the next one away from
// zero, which past the largest finite value is the virtual 2^128), the nearer one in long double
// arithmetic, a tie to the even one.
uint16_t bf16_reference(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(u >> 16);  // inf (NaN not asked)
  const uint32_t lo_bits = abs & 0xffff0000u;
  const uint32_t hi_bits = lo_bits + 0x10000u;
  const long double value = std::fabs(static_cast<long double>(x));
  const long double lo = static_cast<long double>(std::bit_cast<float>(lo_bits));
  const long double hi = hi_bits == 0x7f800000u ? std::ldexp(1.0L, 128)
                                                : static_cast<long double>(std::bit_cast<float>(hi_bits));
  const long double dlo = value - lo, dhi = hi - value;
  uint32_t pick;
  if (dlo < dhi) {
    pick = lo_bits;
  } else if (dhi < dlo) {
    pick = hi_bits;
  } else {
    pick = ((lo_bits >> 16) & 1u) ? hi_bits : lo_bits;
  }
  return static_cast<uint16_t>((sign | pick) >> 16);
}

TEST(BF16, RoundingMatchesLongDoubleReference) {
  // Returns false (after reporting) on the first mismatch, so a bug prints one failure.
  auto check = [](uint32_t bits) {
    const float x = std::bit_cast<float>(bits);
    const uint16_t got = f32_to_bf16_bits(x);
    const bool ok = std::isnan(x) ? bf16_is_nan(got) : got == bf16_reference(x);
    if (!ok) ADD_FAILURE() << "f32 bits 0x" << std::hex << bits << " -> bf16 0x" << got;
    return ok;
  };
  // Every upper half with the low halves that decide rounding: exact tie, just below / above.
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      if (!check((hi << 16) | low)) return;
    }
  }
  // A spread over all patterns (odd stride) and random patterns.
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4093) {
    if (!check(static_cast<uint32_t>(bits))) return;
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000; ++i) {
    if (!check(static_cast<uint32_t>(rng()))) return;
  }
}

TEST(BF16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_bf16_bits(inf), 0x7f80);
  EXPECT_EQ(f32_to_bf16_bits(-inf), 0xff80);
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // overflow -> inf
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_TRUE(bf16_is_nan(f32_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));
  EXPECT_TRUE(bf16_is_nan(f32_to_bf16_bits(std::bit_cast<float>(0xff80ffffu))));
}

// ---- fp8 ---------------------------------------------------------------------------------------

struct Fp8Case {
  const char* name;
  int exp_bits, mant_bits, bias;
  bool has_inf;
  double max;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

const Fp8Case kE4M3{"e4m3", 4, 3, 7, false, 448.0, f32_to_fp8_e4m3_bits, fp8_e4m3_bits_to_f32};
const Fp8Case kE5M2{"e5m2", 5, 2, 15, true, 57344.0, f32_to_fp8_e5m2_bits, fp8_e5m2_bits_to_f32};

// OCP formula: NaN -> nan, inf -> inf (as double).
double fp8_formula(const Fp8Case& c, uint8_t b) {
  const int e = (b & 0x7f) >> c.mant_bits;
  const int m = b & ((1 << c.mant_bits) - 1);
  const int e_max = (1 << c.exp_bits) - 1;
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (c.has_inf && e == e_max) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (!c.has_inf && e == e_max && m == (1 << c.mant_bits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(m, 1 - c.bias - c.mant_bits);
  return sign * std::ldexp((1 << c.mant_bits) + m, e - c.bias - c.mant_bits);
}

class Fp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8, DecodeMatchesOcpFormulaForAll256) {
  const Fp8Case& c = GetParam();
  int nans = 0;
  for (int i = 0; i < 256; ++i) {
    const uint8_t b = static_cast<uint8_t>(i);
    const double expected = fp8_formula(c, b);
    const float got = c.decode(b);
    if (std::isnan(expected)) {
      ++nans;
      ASSERT_TRUE(std::isnan(got)) << c.name << " " << i;
    } else {
      ASSERT_EQ(static_cast<double>(got), expected) << c.name << " " << i;
    }
  }
  EXPECT_EQ(nans, c.has_inf ? 6 : 2);
  EXPECT_EQ(static_cast<double>(c.decode(c.has_inf ? 0x7b : 0x7e)), c.max);
}

TEST_P(Fp8, EncodeDecodeRoundTripsEveryNonNanPattern) {
  const Fp8Case& c = GetParam();
  for (int i = 0; i < 256; ++i) {
    const uint8_t b = static_cast<uint8_t>(i);
    const double v = fp8_formula(c, b);
    if (std::isnan(v) || std::isinf(v)) continue;
    ASSERT_EQ(c.encode(c.decode(b)), b) << c.name << " " << i;
  }
  EXPECT_EQ(c.encode(0.0f), 0x00);
  EXPECT_EQ(c.encode(-0.0f), 0x80);
}

TEST_P(Fp8, MidpointsRoundToNearestEven) {
  const Fp8Case& c = GetParam();
  std::vector<std::pair<double, uint8_t>> values;  // non-negative finite, ascending by pattern
  for (int i = 0; i < 128; ++i) {
    const double v = fp8_formula(c, static_cast<uint8_t>(i));
    if (std::isfinite(v)) values.emplace_back(v, static_cast<uint8_t>(i));
  }
  ASSERT_TRUE(std::is_sorted(values.begin(), values.end()));
  for (size_t k = 0; k + 1 < values.size(); ++k) {
    const auto [lo, lo_bits] = values[k];
    const auto [hi, hi_bits] = values[k + 1];
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint8_t even = (lo_bits & 1) ? hi_bits : lo_bits;
    for (const float sign : {1.0f, -1.0f}) {
      const uint8_t s = sign < 0 ? 0x80 : 0;
      ASSERT_EQ(c.encode(sign * mid), s | even) << c.name << " mid " << mid;
      ASSERT_EQ(c.encode(sign * std::nextafter(mid, 0.0f)), s | lo_bits) << c.name << " " << mid;
      ASSERT_EQ(c.encode(sign * std::nextafter(mid, 1e9f)), s | hi_bits) << c.name << " " << mid;
    }
  }
  // Half the smallest subnormal is a tie with 0 -> 0; just above -> the smallest subnormal.
  const float half_min = static_cast<float>(values[1].first / 2);
  EXPECT_EQ(c.encode(half_min), 0x00);
  EXPECT_EQ(c.encode(std::nextafter(half_min, 1.0f)), 0x01);
  EXPECT_EQ(c.encode(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST_P(Fp8, SaturatesBeyondMaxAndInfinity) {
  const Fp8Case& c = GetParam();
  const uint8_t max_bits = c.has_inf ? 0x7b : 0x7e;
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x : {static_cast<float>(c.max), std::nextafter(static_cast<float>(c.max), inf),
                        static_cast<float>(c.max * 1.03), static_cast<float>(c.max * 1.5),
                        static_cast<float>(c.max * 2), 1e20f, std::numeric_limits<float>::max(),
                        inf}) {
    EXPECT_EQ(c.encode(x), max_bits) << c.name << " " << x;
    EXPECT_EQ(c.encode(-x), 0x80 | max_bits) << c.name << " " << -x;
  }
}

// fp8_max_finite is the format's max, the value the encoder saturates to; other dtypes are errors.
TEST_P(Fp8, MaxFiniteIsTheSaturationValue) {
  const Fp8Case& c = GetParam();
  const DType dtype = c.has_inf ? DType::fp8_e5m2 : DType::fp8_e4m3;
  EXPECT_EQ(fp8_max_finite(dtype), static_cast<float>(c.max));
  EXPECT_EQ(c.decode(c.encode(std::numeric_limits<float>::infinity())), fp8_max_finite(dtype));
  EXPECT_THROW((void)fp8_max_finite(DType::bf16), Error);
}

TEST_P(Fp8, NanStaysNan) {
  const Fp8Case& c = GetParam();
  for (const uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu}) {
    const uint8_t e = c.encode(std::bit_cast<float>(bits));
    EXPECT_TRUE(std::isnan(c.decode(e))) << c.name << " " << std::hex << bits;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8, ::testing::Values(kE4M3, kE5M2),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- element access ----------------------------------------------------------------------------

TEST(ElementAccess, StoreThenLoadEveryDtype) {
  alignas(8) unsigned char buffer[64] = {};
  const float values[] = {1.5f, -2.5f, 0.0f, 3.0f};  // exact in every float dtype
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2,
                   DType::i32, DType::i64, DType::u8}) {
    for (int i = 0; i < 4; ++i) {
      const float v = dt == DType::u8 ? std::fabs(std::trunc(values[i])) : values[i];
      store_f32(buffer, dt, i, v);
      const float expected = (dt == DType::i32 || dt == DType::i64 || dt == DType::u8)
                                 ? std::trunc(v) : v;
      EXPECT_EQ(load_f32(buffer, dt, i), expected) << dtype_name(dt) << " " << i;
      EXPECT_EQ(load_f64(buffer, dt, i), static_cast<double>(expected)) << dtype_name(dt);
    }
  }
  store_f32(buffer, DType::bf16, 1, 1.00390625f);  // 1 + 2^-8: tie -> 1.0
  EXPECT_EQ(load_f32(buffer, DType::bf16, 1), 1.0f);
  store_f32(buffer, DType::fp8_e4m3, 2, 1000.0f);
  EXPECT_EQ(load_f32(buffer, DType::fp8_e4m3, 2), 448.0f);
}

TEST(ElementAccess, IntegersLoadExactlyAsDouble) {
  const int64_t big = (int64_t{1} << 53) - 1;
  EXPECT_EQ(load_f64(&big, DType::i64, 0), static_cast<double>(big));
  const int32_t neg = -123456789;
  EXPECT_EQ(load_f64(&neg, DType::i32, 0), -123456789.0);
}

TEST(ElementAccess, IntegerStoreOutOfRangeIsAnError) {
  int32_t out = 7;
  EXPECT_THROW(store_f32(&out, DType::i32, 0, 3e9f), Error);
  EXPECT_THROW(store_f32(&out, DType::i32, 0, std::numeric_limits<float>::quiet_NaN()), Error);
  uint8_t small = 0;
  EXPECT_THROW(store_f32(&small, DType::u8, 0, 256.0f), Error);
  EXPECT_THROW(store_f32(&small, DType::u8, 0, -1.0f), Error);
  EXPECT_EQ(out, 7);
  store_f32(&small, DType::u8, 0, 255.0f);
  EXPECT_EQ(small, 255);
}

// ---- names and KV-cache dtype strings ----------------------------------------------------------

TEST(DTypeNames, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::fp8_e5m2), 1u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2,
                   DType::i32, DType::i64, DType::u8}) {
    EXPECT_EQ(parse_dtype(dtype_name(dt)), dt);
  }
  EXPECT_EQ(parse_dtype("half"), DType::f16);
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_TRUE(is_floating(DType::fp8_e4m3));
  EXPECT_FALSE(is_floating(DType::i32));
  EXPECT_TRUE(is_fp8(DType::fp8_e5m2));
  EXPECT_FALSE(is_fp8(DType::bf16));
  EXPECT_EQ(parse_device("cuda"), Device::cuda);
  EXPECT_EQ(device_name(Device::cpu), "cpu");
  try {
    parse_dtype("float8", "model_dtype");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "model_dtype");
    EXPECT_NE(std::string(e.what()).find("'float8'"), std::string::npos) << e.what();
  }
  try {
    parse_device("tpu");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device");
    EXPECT_NE(std::string(e.what()).find("tpu"), std::string::npos);
  }
}

TEST(KVCacheDType, StringsAsVllm) {
  EXPECT_FALSE(is_quantized_kv_cache("auto"));
  for (const char* s : {"fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"}) {
    EXPECT_TRUE(is_quantized_kv_cache(s)) << s;
    EXPECT_NO_THROW(validate_kv_cache_dtype(s));
  }
  EXPECT_NO_THROW(validate_kv_cache_dtype("auto"));
  EXPECT_EQ(kv_cache_storage_dtype("auto", DType::bf16), DType::bf16);
  EXPECT_EQ(kv_cache_storage_dtype("auto", DType::f16), DType::f16);
  EXPECT_EQ(kv_cache_storage_dtype("fp8", DType::bf16), DType::fp8_e4m3);
  EXPECT_EQ(kv_cache_storage_dtype("fp8_e4m3", DType::bf16), DType::fp8_e4m3);
  EXPECT_EQ(kv_cache_storage_dtype("fp8_e5m2", DType::bf16), DType::fp8_e5m2);
  EXPECT_EQ(kv_cache_storage_dtype("bfloat16", DType::f16), DType::bf16);
  EXPECT_EQ(kv_cache_storage_dtype("float16", DType::bf16), DType::f16);
  EXPECT_EQ(kv_cache_storage_dtype("float32", DType::bf16), DType::f32);
  for (const char* bad : {"fp8_e4m3fn", "int8", "", "AUTO", "bf16"}) {
    try {
      validate_kv_cache_dtype(bad);
      FAIL() << "expected Error for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "kv_cache_dtype");
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos);
    }
    EXPECT_THROW(kv_cache_storage_dtype(bad, DType::bf16), Error);
  }
  EXPECT_THROW(kv_cache_storage_dtype("auto", DType::i32), Error);
}

}  // namespace
}  // namespace pagedattn
