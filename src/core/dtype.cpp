// Element types, devices and the exact scalar conversions every backend reproduces.
//
// All conversions work on bit patterns with integer arithmetic, so they are exact and do not
// depend on the host FPU's rounding mode or flush-to-zero setting.
//   f32 -> f16 / bf16: round to nearest, ties to even; overflow -> inf; NaN -> quiet NaN (the
//                      top payload bits kept, the quiet bit set).
//   f32 -> fp8 (OCP E4M3FN / E5M2): round to nearest, ties to even; every |x| >= max finite
//                      (including +-inf) SATURATES to +-max (e4m3: 448, e5m2: 57344); NaN -> NaN.
//                      E4M3FN has no inf. E5M2 has inf, but we saturate inf to max as well: this is
//                      what vLLM's saturating fp8 conversion does (it clamps to [-max, max] before
//                      converting), and a KV cache must never hold inf.
#include "pagedattn/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedattn/error.h"

namespace pagedattn {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::fp8_e4m3: return 1;
    case DType::fp8_e5m2: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  throw Error("dtype", detail::concat("dtype: unknown DType value ", static_cast<int>(dtype)));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::fp8_e5m2: return "fp8_e5m2";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "unknown";
}

std::string_view device_name(Device device) {
  switch (device) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
  }
  return "unknown";
}

bool is_floating(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::f16:
    case DType::bf16:
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: return true;
    case DType::i32:
    case DType::i64:
    case DType::u8: return false;
  }
  return false;
}

bool is_fp8(DType dtype) { return dtype == DType::fp8_e4m3 || dtype == DType::fp8_e5m2; }

DType parse_dtype(std::string_view name, std::string_view argument) {
  if (name == "float32" || name == "f32" || name == "fp32") return DType::f32;
  if (name == "float16" || name == "f16" || name == "fp16" || name == "half") return DType::f16;
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  if (name == "fp8_e4m3") return DType::fp8_e4m3;
  if (name == "fp8_e5m2") return DType::fp8_e5m2;
  if (name == "int32" || name == "i32") return DType::i32;
  if (name == "int64" || name == "i64") return DType::i64;
  if (name == "uint8" || name == "u8") return DType::u8;
  throw Error(std::string(argument),
              detail::concat(argument, " = '", name,
                             "' is not a dtype: expected one of float32 (f32, fp32), float16 (f16, "
                             "fp16, half), bfloat16 (bf16), fp8_e4m3, fp8_e5m2, int32, int64, uint8"));
}

Device parse_device(std::string_view name, std::string_view argument) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda") return Device::cuda;
  throw Error(std::string(argument),
              detail::concat(argument, " = '", name, "' is not a device: expected cpu or cuda"));
}

// ---- f16 ---------------------------------------------------------------------------------------

uint16_t f32_to_f16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, keep the top 9 payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // 65520 = 65504 + half an ulp; the tie rounds to the even neighbour 65536 = inf.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const uint32_t exp = abs >> 23;
  const uint32_t mant = abs & 0x7fffffu;
  if (exp >= 113) {  // f16 normal: exponent 2^-14 and up
    uint32_t h = ((exp - 112) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
    return static_cast<uint16_t>(sign | h);
  }
  // f16 subnormal (or zero): value / 2^-24 rounded to an integer in [0, 1024].
  // value = full * 2^(exp - 150), so value / 2^-24 = full >> (126 - exp).
  if (exp < 102) return sign;  // below 2^-25 (half the smallest subnormal): rounds to 0
  const uint32_t full = mant | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14 .. 24
  uint32_t h = full >> shift;
  const uint32_t rem = full & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;  // 1024 = the smallest normal, correct
  return static_cast<uint16_t>(sign | h);
}

float f16_bits_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) {
    if (mant == 0) return std::bit_cast<float>(sign | 0x7f800000u);
    return std::bit_cast<float>(sign | 0x7fc00000u | (mant << 13));  // quiet NaN
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float magnitude = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

// ---- bf16 --------------------------------------------------------------------------------------

uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // qNaN
  // Round to nearest even; overflow carries into the exponent and reaches inf as IEEE does.
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float bf16_bits_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;  // quiet NaN
  return std::bit_cast<float>(u);
}

// ---- fp8 (OCP 8-bit floating point) ------------------------------------------------------------

namespace {

// An OCP fp8 format: `kMantBits` mantissa bits, exponent bias `kBias`, the largest finite
// magnitude's bit pattern and the canonical NaN pattern (without sign).
struct Fp8Format {
  int mant_bits;
  int bias;
  uint8_t max_pattern;  // e4m3: 0x7E = 448, e5m2: 0x7B = 57344
  uint8_t nan_pattern;  // e4m3: 0x7F, e5m2: 0x7F
  uint32_t max_f32_bits;
};

constexpr Fp8Format kE4M3{3, 7, 0x7e, 0x7f, 0x43e00000u /* 448.0f */};
constexpr Fp8Format kE5M2{2, 15, 0x7b, 0x7f, 0x47600000u /* 57344.0f */};

uint8_t f32_to_fp8_bits(float x, const Fp8Format& f) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | f.nan_pattern);
  // Saturation: every magnitude >= max (inf included) becomes max. Below max, rounding to
  // nearest can reach max at most, never beyond it (max is representable).
  if (abs >= f.max_f32_bits) return static_cast<uint8_t>(sign | f.max_pattern);
  const int exp = static_cast<int>(abs >> 23) - 127;  // unbiased f32 exponent
  const uint32_t mant = abs & 0x7fffffu;
  const int min_normal_exp = 1 - f.bias;
  const uint32_t drop = static_cast<uint32_t>(23 - f.mant_bits);  // mantissa bits dropped
  if ((abs >> 23) != 0 && exp >= min_normal_exp) {  // fp8 normal
    uint32_t r = (static_cast<uint32_t>(exp + f.bias) << f.mant_bits) | (mant >> drop);
    const uint32_t rem = mant & ((1u << drop) - 1u);
    const uint32_t half = 1u << (drop - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint8_t>(sign | r);
  }
  // fp8 subnormal or zero: value / 2^(min_normal_exp - mant_bits) rounded to an integer.
  // value = full * 2^(exp - 23); f32 subnormals (< 2^-126) are far below half an fp8 ulp.
  if ((abs >> 23) == 0) return sign;
  const uint32_t full = mant | 0x800000u;
  const int shift = 23 + min_normal_exp - f.mant_bits - exp;  // >= 24 - mant_bits + 1
  if (shift > 24) return sign;  // below half the smallest subnormal
  uint32_t r = full >> shift;
  const uint32_t rem = full & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;  // may become the smallest normal: correct
  return static_cast<uint8_t>(sign | r);
}

float fp8_bits_to_f32(uint8_t bits, const Fp8Format& f, bool has_inf) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exp_field = static_cast<uint32_t>((bits & 0x7fu) >> f.mant_bits);
  const uint32_t mant = bits & ((1u << f.mant_bits) - 1u);
  const uint32_t exp_all_ones = (0x7fu >> f.mant_bits);
  if (has_inf) {
    if (exp_field == exp_all_ones) {
      if (mant == 0) return std::bit_cast<float>(sign | 0x7f800000u);
      return std::bit_cast<float>(sign | 0x7fc00000u);
    }
  } else if ((bits & 0x7fu) == 0x7fu) {
    return std::bit_cast<float>(sign | 0x7fc00000u);
  }
  if (exp_field == 0) {  // subnormal: mant * 2^(1 - bias - mant_bits), exact in f32
    const float magnitude =
        static_cast<float>(mant) * std::bit_cast<float>(
                                       static_cast<uint32_t>(127 + 1 - f.bias - f.mant_bits) << 23);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t f32_exp = exp_field - static_cast<uint32_t>(f.bias) + 127u;
  return std::bit_cast<float>(sign | (f32_exp << 23) | (mant << (23 - f.mant_bits)));
}

}  // namespace

uint8_t f32_to_fp8_e4m3_bits(float x) { return f32_to_fp8_bits(x, kE4M3); }
float fp8_e4m3_bits_to_f32(uint8_t bits) { return fp8_bits_to_f32(bits, kE4M3, false); }
uint8_t f32_to_fp8_e5m2_bits(float x) { return f32_to_fp8_bits(x, kE5M2); }
float fp8_e5m2_bits_to_f32(uint8_t bits) { return fp8_bits_to_f32(bits, kE5M2, true); }
float fp8_max_finite(DType fp8_dtype) {
  PAGEDATTN_CHECK(is_fp8(fp8_dtype), "dtype", "fp8_max_finite: ", dtype_name(fp8_dtype),
                  " is not an fp8 format (expected fp8_e4m3 or fp8_e5m2)");
  return std::bit_cast<float>((fp8_dtype == DType::fp8_e4m3 ? kE4M3 : kE5M2).max_f32_bits);
}

// ---- element access ----------------------------------------------------------------------------

namespace {

template <typename T>
T read_as(const void* data, int64_t index) {
  T v;
  std::memcpy(&v, static_cast<const char*>(data) + index * static_cast<int64_t>(sizeof(T)),
              sizeof(T));
  return v;
}

template <typename T>
void write_as(void* data, int64_t index, T v) {
  std::memcpy(static_cast<char*>(data) + index * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

// static_cast of a float to an integer type is undefined when the value does not fit: such a
// store is an error instead.
template <typename Int>
Int float_to_int_checked(double value, DType dtype) {
  constexpr double lo = static_cast<double>(std::numeric_limits<Int>::min());
  // max + 1 is a power of two, exact in double; values in [max, max + 1) truncate to max.
  constexpr double hi = static_cast<double>(std::numeric_limits<Int>::max() / 2 + 1) * 2.0;
  PAGEDATTN_CHECK(value > lo - 1.0 && value < hi, "value", "store_f32: value = ", value,
                  " does not fit dtype ", dtype_name(dtype));
  return static_cast<Int>(value);
}

}  // namespace

float load_f32(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32: return read_as<float>(data, index);
    case DType::f16: return f16_bits_to_f32(read_as<uint16_t>(data, index));
    case DType::bf16: return bf16_bits_to_f32(read_as<uint16_t>(data, index));
    case DType::fp8_e4m3: return fp8_e4m3_bits_to_f32(read_as<uint8_t>(data, index));
    case DType::fp8_e5m2: return fp8_e5m2_bits_to_f32(read_as<uint8_t>(data, index));
    case DType::i32: return static_cast<float>(read_as<int32_t>(data, index));
    case DType::i64: return static_cast<float>(read_as<int64_t>(data, index));
    case DType::u8: return static_cast<float>(read_as<uint8_t>(data, index));
  }
  throw Error("dtype", detail::concat("load_f32: unknown dtype ", static_cast<int>(dtype)));
}

double load_f64(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::i32: return static_cast<double>(read_as<int32_t>(data, index));
    case DType::i64: return static_cast<double>(read_as<int64_t>(data, index));
    case DType::u8: return static_cast<double>(read_as<uint8_t>(data, index));
    default: return static_cast<double>(load_f32(data, dtype, index));
  }
}

void store_f32(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::f32: write_as<float>(data, index, value); return;
    case DType::f16: write_as<uint16_t>(data, index, f32_to_f16_bits(value)); return;
    case DType::bf16: write_as<uint16_t>(data, index, f32_to_bf16_bits(value)); return;
    case DType::fp8_e4m3: write_as<uint8_t>(data, index, f32_to_fp8_e4m3_bits(value)); return;
    case DType::fp8_e5m2: write_as<uint8_t>(data, index, f32_to_fp8_e5m2_bits(value)); return;
    case DType::i32: write_as<int32_t>(data, index, float_to_int_checked<int32_t>(value, dtype)); return;
    case DType::i64: write_as<int64_t>(data, index, float_to_int_checked<int64_t>(value, dtype)); return;
    case DType::u8: write_as<uint8_t>(data, index, float_to_int_checked<uint8_t>(value, dtype)); return;
  }
  throw Error("dtype", detail::concat("store_f32: unknown dtype ", static_cast<int>(dtype)));
}

// ---- KV-cache dtype strings --------------------------------------------------------------------

bool is_quantized_kv_cache(std::string_view kv_cache_dtype) { return kv_cache_dtype != "auto"; }

namespace {
bool kv_cache_dtype_known(std::string_view s) {
  return s == "auto" || s == "fp8" || s == "fp8_e4m3" || s == "fp8_e5m2" || s == "bfloat16" ||
         s == "float16" || s == "float32";
}
}  // namespace

void validate_kv_cache_dtype(std::string_view kv_cache_dtype) {
  PAGEDATTN_CHECK(kv_cache_dtype_known(kv_cache_dtype), "kv_cache_dtype", "kv_cache_dtype = '",
                  kv_cache_dtype,
                  "' is not supported: expected one of auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, "
                  "float16, float32");
}

DType kv_cache_storage_dtype(std::string_view kv_cache_dtype, DType model_dtype) {
  validate_kv_cache_dtype(kv_cache_dtype);
  if (kv_cache_dtype == "auto") {
    PAGEDATTN_CHECK(is_floating(model_dtype) && !is_fp8(model_dtype), "model_dtype",
                    "model_dtype = ", dtype_name(model_dtype),
                    " cannot be the KV-cache dtype with kv_cache_dtype = 'auto': expected "
                    "float32, float16 or bfloat16");
    return model_dtype;
  }
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") return DType::fp8_e4m3;
  if (kv_cache_dtype == "fp8_e5m2") return DType::fp8_e5m2;
  if (kv_cache_dtype == "bfloat16") return DType::bf16;
  if (kv_cache_dtype == "float16") return DType::f16;
  return DType::f32;
}

}  // namespace pagedattn
