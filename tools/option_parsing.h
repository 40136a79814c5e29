// Flag values -> library enums, with errors that name the flag (UsageError).
#pragma once

#include <string>
#include <string_view>

#include "pagedattn/attention_type.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cli {

Device parse_device_flag(const std::string& value, std::string_view flag);
// float32/f32/fp32, float16/f16/half, bfloat16/bf16 only.
DType parse_activation_dtype_flag(const std::string& value, std::string_view flag);
AttentionType parse_attn_type_flag(const std::string& value, std::string_view flag);
void check_kv_cache_dtype_flag(const std::string& value, std::string_view flag);

}  // namespace pagedattn::cli
