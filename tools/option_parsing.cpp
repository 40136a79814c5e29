#include "option_parsing.h"

#include "cli_common.h"
#include "pagedattn/error.h"

namespace pagedattn::cli {

Device parse_device_flag(const std::string& value, std::string_view flag) {
  if (value == "cpu") return Device::cpu;
  if (value == "cuda") return Device::cuda;
  throw UsageError(std::string(flag) + ": '" + value + "' is not a device: expected cpu or cuda");
}

DType parse_activation_dtype_flag(const std::string& value, std::string_view flag) {
  DType d;
  try {
    d = parse_dtype(value, flag);
  } catch (const Error&) {
    d = DType::i32;  // reported below
  }
  if (d != DType::f32 && d != DType::f16 && d != DType::bf16) {
    throw UsageError(std::string(flag) + ": '" + value +
                     "' is not an activation dtype: expected float32, float16 or bfloat16");
  }
  return d;
}

AttentionType parse_attn_type_flag(const std::string& value, std::string_view flag) {
  try {
    return parse_attention_type(value);
  } catch (const Error&) {
    throw UsageError(std::string(flag) + ": '" + value +
                     "' is not an attention type: expected decoder, encoder, encoder_only or encoder_decoder");
  }
}

void check_kv_cache_dtype_flag(const std::string& value, std::string_view flag) {
  try {
    validate_kv_cache_dtype(value);
  } catch (const Error&) {
    throw UsageError(std::string(flag) + ": '" + value +
                     "' is not a KV-cache dtype: expected auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16 or float32");
  }
}

}  // namespace pagedattn::cli
