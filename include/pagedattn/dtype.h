// Element types, devices and exact scalar conversions.
//
// Conversions are bit-exact: f32 -> f16 / bf16 round to nearest, ties to even (NaN stays NaN,
// overflow goes to inf as IEEE does); f32 -> fp8 (OCP 8-bit formats) rounds to nearest even and
// SATURATES to the largest finite value (e4m3: +-448, e5m2: +-57344), NaN stays NaN (e4m3 has no
// inf: inf saturates too). These are the conversions every backend must reproduce.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pagedattn {

enum class DType : uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2, i32, i64, u8 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType dtype);             // bytes per element
std::string_view dtype_name(DType dtype);   // "float32", "float16", "bfloat16", "fp8_e4m3", ...
std::string_view device_name(Device device);  // "cpu", "cuda"
bool is_floating(DType dtype);
bool is_fp8(DType dtype);
// Parses "float32"/"f32"/"fp32", "float16"/"f16"/"half", "bfloat16"/"bf16", "fp8_e4m3",
// "fp8_e5m2", "int32", "int64", "uint8". Throws Error naming `argument` otherwise.
DType parse_dtype(std::string_view name, std::string_view argument = "dtype");
Device parse_device(std::string_view name, std::string_view argument = "device");

// ---- scalar conversions (bit patterns) -------------------------------------------------------
uint16_t f32_to_f16_bits(float x);
float f16_bits_to_f32(uint16_t bits);
uint16_t f32_to_bf16_bits(float x);
float bf16_bits_to_f32(uint16_t bits);
uint8_t f32_to_fp8_e4m3_bits(float x);  // saturating
float fp8_e4m3_bits_to_f32(uint8_t bits);
uint8_t f32_to_fp8_e5m2_bits(float x);  // saturating
float fp8_e5m2_bits_to_f32(uint8_t bits);
// The largest finite value of an fp8 format: 448 (fp8_e4m3), 57344 (fp8_e5m2); Error naming
// "dtype" for any other dtype.
float fp8_max_finite(DType fp8_dtype);

// Reads element `index` (in elements) of a buffer of `dtype` as float / writes it from float
// (rounding as above). Integer dtypes convert as static_cast.
float load_f32(const void* data, DType dtype, int64_t index);
void store_f32(void* data, DType dtype, int64_t index, float value);
double load_f64(const void* data, DType dtype, int64_t index);

// ---- KV-cache dtype strings (vLLM's cache_dtype) ---------------------------------------------
// Accepted: "auto", "fp8" (= fp8_e4m3), "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32".
// is_quantized_kv_cache(s) == (s != "auto"), exactly as vLLM.
bool is_quantized_kv_cache(std::string_view kv_cache_dtype);
// Throws Error naming "kv_cache_dtype" for any other string.
void validate_kv_cache_dtype(std::string_view kv_cache_dtype);
// Storage dtype of the cache: "auto" -> model_dtype, "fp8" -> fp8_e4m3, ...
DType kv_cache_storage_dtype(std::string_view kv_cache_dtype, DType model_dtype);

}  // namespace pagedattn
