// written_rows_amax (kv_amax.h): amax(|key|), amax(|value|) over the rows a cache write stores.
//
// The max is taken over the bit patterns of |x| as unsigned 32-bit integers: for non-negative
// floats that order is the numeric order, and the NaN patterns (exponent all ones, mantissa != 0)
// sort above +inf, so a NaN anywhere wins and reaches the caller (std::max / fmaxf would drop it).
// Host path: one pass over the written rows (OpenMP over tokens when large), each element read
// once through load_f32 (exact for f16 / bf16). Device path: src/backends/cuda/ops/kv_amax.cu.
#include "ops/kv_amax.h"

#include <cstdint>
#include <cstring>

#include "core/device_memory.h"
#include "ops/cuda_ops.h"
#include "ops/ops_checks.h"
#include "pagedattn/error.h"

namespace pagedattn::detail {
namespace {

uint32_t abs_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits & 0x7fffffffu;
}

float float_of_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// x (N, H, D):(s0, s1, s2); rows t < num_rows with slots[t * slot_stride] >= 0.
uint32_t host_rows_amax_bits(const TensorView& x, const int64_t* slots, int64_t slot_stride,
                             int64_t num_rows) {
  const int64_t heads = x.size(1), dim = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const DType dtype = x.dtype();
  const void* data = x.data();
  uint32_t amax = 0;
#pragma omp parallel for schedule(static) reduction(max : amax) if (num_rows * heads * dim >= (int64_t{1} << 16))
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slots[t * slot_stride] < 0) continue;  // -1: padding, not written
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t e = 0; e < dim; ++e) {
        const uint32_t bits = abs_bits(load_f32(data, dtype, t * s0 + h * s1 + e * s2));
        amax = bits > amax ? bits : amax;
      }
    }
  }
  return amax;
}

}  // namespace

KVAmax written_rows_amax(const TensorView& key, const TensorView& value,
                         const TensorView& slot_mapping, const TensorView& device_result) {
  constexpr std::string_view op = "calculate_kv_scales";
  ops_detail::check_rank(op, key, "key", 3, "(num_tokens, num_kv_heads, head_size)");
  ops_detail::check_rank(op, value, "value", 3, "(num_tokens, num_kv_heads, head_size_v)");
  ops_detail::check_activation_dtype(op, key, "key");
  ops_detail::check_activation_dtype(op, value, "value");
  PAGEDATTN_CHECK(value.dtype() == key.dtype() && value.size(0) == key.size(0), "value", op, ": value is ",
                  value.describe(), ", expected ", dtype_name(key.dtype()), " with key's ", key.size(0), " rows");
  const int64_t num_rows = ops_detail::check_slot_mapping(op, slot_mapping, key.size(0), "key/value hold");
  ops_detail::check_same_device(op, value, "value", key.device(), key.device_index());
  ops_detail::check_same_device(op, slot_mapping, "slot_mapping", key.device(), key.device_index());
  if (key.device() == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    PAGEDATTN_CHECK(device_result.defined() && device_result.dtype() == DType::i32 &&
                        device_result.numel() == 2 && device_result.device() == Device::cuda,
                    "device_result", "written_rows_amax: device_result is ",
                    device_result.describe(), ", expected int32 (2,) on cuda");
    cuda_written_rows_amax(key, value, slot_mapping, device_result);
    uint32_t bits[2] = {0, 0};
    memcpy_d2h(bits, device_result.data(), sizeof bits);  // waits for the kernel
    return KVAmax{float_of_bits(bits[0]), float_of_bits(bits[1])};
#else
    (void)device_result;
    throw Error("key", "written_rows_amax: key is on cuda but pagedattn was built without CUDA");
#endif
  }
  if (num_rows == 0) return KVAmax{};
  const auto* slots = slot_mapping.data_as<const int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  return KVAmax{float_of_bits(host_rows_amax_bits(key, slots, slot_stride, num_rows)),
                float_of_bits(host_rows_amax_bits(value, slots, slot_stride, num_rows))};
}

}  // namespace pagedattn::detail
