// reshape_and_cache_flash / reshape_and_cache: write new keys and values into the paged cache.
//
// What it computes: for every token t < N' (N' = slot_mapping length) whose slot s != -1,
//   key_cache[s / block_size, s % block_size, h, :]   = convert(key[t, h, :] / k_scale[h])
//   value_cache[s / block_size, s % block_size, h, :] = convert(value[t, h, :] / v_scale[h])
// where the division by the scale happens only for fp8 caches (vLLM: kAuto copies, kFp8*
// quantizes) and convert is the core store_f32 conversion of the cache dtype (round to nearest
// even; fp8 saturates to the finite max). Non-fp8 caches of another dtype than the activations
// (e.g. kv_cache_dtype "float32" with bf16 activations) are plain conversions.
//
// Host path: one pass over the tokens (OpenMP over tokens when the copy is large), each row read
// once through load_f32 and written once through store_f32: memory traffic = N'*Hkv*(D+Dv)
// elements read + the same written; no reuse, so the floor is the copy bandwidth.
// Precision: one rounding, at the store (the f32 division is exact enough: x / scale in f32 then
// one rounding to the cache dtype, as vLLM's scaled_convert).
//
// Device path: shapes/dtypes/scale values are checked on the host; slot contents live on the
// device and are not read (no host sync in `run`): the CUDA kernel skips slot -1 AND every slot
// outside [0, num_blocks * block_size), so a bad slot never writes out of bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "ops/cuda_ops.h"
#include "ops/ops_checks.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace {

using ops_detail::check_activation_dtype;
using ops_detail::check_rank;
using ops_detail::check_same_device;
using ops_detail::check_slot_mapping;

// Reads a scalar scale (per-tensor) and checks it is > 0 and finite.
void check_scale_value(std::string_view op, std::string_view argument, float scale) {
  PAGEDATTN_CHECK(std::isfinite(scale) && scale > 0.f, std::string(argument), op, ": ", argument,
                  " = ", scale, " must be a finite value > 0");
}

// Per-head scale tensor: f32 (Hkv,) on `device`; on the host every entry is > 0 and finite.
void check_per_head_scale(std::string_view op, std::string_view argument, const TensorView& scale,
                          int64_t num_kv_heads, Device device, int device_index) {
  if (!scale.defined()) return;
  const std::string arg(argument);
  PAGEDATTN_CHECK(scale.dtype() == DType::f32, arg, op, ": ", argument, " is ",
                  dtype_name(scale.dtype()), ", expected float32 (num_kv_heads,)");
  PAGEDATTN_CHECK(scale.ndim() == 1 && scale.size(0) == num_kv_heads, arg, op, ": ", argument,
                  " has shape ", scale.shape().str(), ", expected (", num_kv_heads,
                  ") = (num_kv_heads,)");
  PAGEDATTN_CHECK(scale.device() == device && scale.device_index() == device_index, arg, op, ": ",
                  argument, " is on ", scale.describe(), ", expected the device of key (",
                  device_name(device), ":", device_index, ")");
  PAGEDATTN_CHECK(scale.data() != nullptr || num_kv_heads == 0, arg, op, ": ", argument,
                  " has no data");
  if (device != Device::cpu) return;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const float s = load_f32(scale.data(), DType::f32, h * scale.stride(0));
    PAGEDATTN_CHECK(std::isfinite(s) && s > 0.f, arg, op, ": ", argument, "[", h, "] = ", s,
                    " must be a finite value > 0");
  }
}

struct CacheWriteArgs {
  int64_t num_tokens = 0;     // N' = slot_mapping length
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t head_size_v = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  DType cache_dtype = DType::bf16;
};

// Validates every argument of reshape_and_cache_flash; throws before anything is written.
CacheWriteArgs validate_cache_write(std::string_view op, const TensorView& key,
                                    const TensorView& value, const TensorView& key_cache,
                                    const TensorView& value_cache, const TensorView& slot_mapping,
                                    std::string_view kv_cache_dtype, const LayerScales& scales) {
  validate_kv_cache_dtype(kv_cache_dtype);

  check_rank(op, key, "key", 3, "(num_tokens, num_kv_heads, head_size)");
  check_rank(op, value, "value", 3, "(num_tokens, num_kv_heads, head_size_v)");
  check_activation_dtype(op, key, "key");
  PAGEDATTN_CHECK(value.dtype() == key.dtype(), "value", op, ": value is ",
                  dtype_name(value.dtype()), ", expected the dtype of key (",
                  dtype_name(key.dtype()), ")");
  const int64_t n = key.size(0);
  const int64_t hkv = key.size(1);
  const int64_t d = key.size(2);
  const int64_t dv = value.size(2);
  PAGEDATTN_CHECK(value.size(0) == n && value.size(1) == hkv, "value", op, ": value has shape ",
                  value.shape().str(), ", expected (", n, ", ", hkv,
                  ", head_size_v) to match key ", key.shape().str());
  PAGEDATTN_CHECK(hkv > 0 && d > 0 && dv > 0, "key", op, ": key ", key.shape().str(),
                  " / value ", value.shape().str(), " must have num_kv_heads > 0 and head sizes > 0");

  check_rank(op, key_cache, "key_cache", 4, "(num_blocks, block_size, num_kv_heads, head_size)");
  check_rank(op, value_cache, "value_cache", 4,
             "(num_blocks, block_size, num_kv_heads, head_size_v)");
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  PAGEDATTN_CHECK(block_size > 0, "key_cache", op, ": key_cache has shape ",
                  key_cache.shape().str(), ": block_size (dim 1) must be > 0");
  PAGEDATTN_CHECK(key_cache.size(2) == hkv && key_cache.size(3) == d, "key_cache", op,
                  ": key_cache has shape ", key_cache.shape().str(), ", expected (", num_blocks,
                  ", ", block_size, ", ", hkv, ", ", d,
                  ") = (num_blocks, block_size, num_kv_heads of key, head_size of key)");
  PAGEDATTN_CHECK(value_cache.size(0) == num_blocks && value_cache.size(1) == block_size &&
                      value_cache.size(2) == hkv && value_cache.size(3) == dv,
                  "value_cache", op, ": value_cache has shape ", value_cache.shape().str(),
                  ", expected (", num_blocks, ", ", block_size, ", ", hkv, ", ", dv,
                  ") = (num_blocks and block_size of key_cache, num_kv_heads, head_size_v of value)");
  const DType cache_dtype = kv_cache_storage_dtype(kv_cache_dtype, key.dtype());
  PAGEDATTN_CHECK(key_cache.dtype() == cache_dtype, "key_cache", op, ": key_cache is ",
                  dtype_name(key_cache.dtype()), ", expected ", dtype_name(cache_dtype),
                  " for kv_cache_dtype \"", kv_cache_dtype, "\" and ", dtype_name(key.dtype()),
                  " keys");
  PAGEDATTN_CHECK(value_cache.dtype() == cache_dtype, "value_cache", op, ": value_cache is ",
                  dtype_name(value_cache.dtype()), ", expected ", dtype_name(cache_dtype),
                  " for kv_cache_dtype \"", kv_cache_dtype, "\" and ", dtype_name(key.dtype()),
                  " keys");

  const int64_t num_tokens = check_slot_mapping(op, slot_mapping, n, "key/value hold");

  const Device device = key.device();
  const int device_index = key.device_index();
  check_same_device(op, value, "value", device, device_index);
  check_same_device(op, key_cache, "key_cache", device, device_index);
  check_same_device(op, value_cache, "value_cache", device, device_index);
  check_same_device(op, slot_mapping, "slot_mapping", device, device_index);

  check_scale_value(op, "k_scale", scales.k_scale);
  check_scale_value(op, "v_scale", scales.v_scale);
  check_per_head_scale(op, "k_scale_per_head", scales.k_scale_per_head, hkv, device, device_index);
  check_per_head_scale(op, "v_scale_per_head", scales.v_scale_per_head, hkv, device, device_index);

  const bool any_write = num_tokens > 0;
  PAGEDATTN_CHECK(!any_write || (key.data() && value.data() && slot_mapping.data()), "key", op,
                  ": key, value and slot_mapping must have data");
  PAGEDATTN_CHECK(!any_write || num_blocks == 0 || (key_cache.data() && value_cache.data()),
                  "key_cache", op, ": key_cache and value_cache must have data");

  if (device == Device::cpu) {
    const int64_t num_slots = num_blocks * block_size;
    const auto* slots = slot_mapping.data_as<const int64_t>();
    const int64_t slot_stride = slot_mapping.stride(0);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t * slot_stride];
      PAGEDATTN_CHECK(slot == -1 || (slot >= 0 && slot < num_slots), "slot_mapping", op,
                      ": slot_mapping[", t, "] = ", slot,
                      " is out of range: expected -1 or a slot in [0, ", num_slots, ")");
    }
  }
  return CacheWriteArgs{num_tokens, hkv, d, dv, num_blocks, block_size, cache_dtype};
}

// Host write: one row (head_size elements) per (token, head, k|v).
void write_cache_host(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                      const TensorView& value_cache, const TensorView& slot_mapping,
                      const LayerScales& scales, const CacheWriteArgs& a) {
  const bool quantize = is_fp8(a.cache_dtype);
  const DType src_dtype = key.dtype();
  const auto* slots = slot_mapping.data_as<const int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const auto per_head = [](const TensorView& t, int64_t h, float fallback) {
    return t.defined() ? load_f32(t.data(), DType::f32, h * t.stride(0)) : fallback;
  };
  // key (N, Hkv, D):(ks0, ks1, ks2); key_cache (num_blocks, block_size, Hkv, D):(cs0..cs3)
  struct Rows {
    const char* src;
    char* dst;
    int64_t s0, s1, s2, d0, d1, d2, d3;
    // A row is one memcpy: the same dtype (no conversion, no scale) and unit inner strides.
    bool copy;
  };
  const size_t elem = dtype_size(src_dtype);
  const auto rows_of = [&](const TensorView& src, const TensorView& dst) {
    return Rows{static_cast<const char*>(src.data()), static_cast<char*>(dst.data()),
                src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1),
                dst.stride(2), dst.stride(3),
                !quantize && a.cache_dtype == src_dtype && src.stride(2) == 1 && dst.stride(3) == 1};
  };
  const Rows key_rows = rows_of(key, key_cache), value_rows = rows_of(value, value_cache);
  const auto write_rows = [&](const Rows& r, int64_t head_dim, int64_t t, int64_t block,
                              int64_t offset, const TensorView& head_scale, float tensor_scale) {
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t src_base = t * r.s0 + h * r.s1;
      const int64_t dst_base = block * r.d0 + offset * r.d1 + h * r.d2;
      if (r.copy) {
        std::memcpy(r.dst + dst_base * static_cast<int64_t>(elem),
                    r.src + src_base * static_cast<int64_t>(elem), static_cast<size_t>(head_dim) * elem);
        continue;
      }
      const float scale = quantize ? per_head(head_scale, h, tensor_scale) : 1.f;
      for (int64_t i = 0; i < head_dim; ++i) {
        float x = load_f32(r.src, src_dtype, src_base + i * r.s2);
        if (quantize) x = x / scale;  // as vLLM's scaled_convert: divide, then one rounding
        store_f32(r.dst, a.cache_dtype, dst_base + i * r.d3, x);
      }
    }
  };
  const int64_t row_work = a.num_kv_heads * (a.head_size + a.head_size_v);
#pragma omp parallel for schedule(static) if (a.num_tokens * row_work >= (int64_t{1} << 16))
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < 0) continue;  // -1: padding / nothing to write
    const int64_t block = slot / a.block_size;
    const int64_t offset = slot % a.block_size;
    write_rows(key_rows, a.head_size, t, block, offset, scales.k_scale_per_head, scales.k_scale);
    write_rows(value_rows, a.head_size_v, t, block, offset, scales.v_scale_per_head,
               scales.v_scale);
  }
}

void reshape_and_cache_impl(std::string_view op, const TensorView& key, const TensorView& value,
                            const TensorView& key_cache, const TensorView& value_cache,
                            const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                            const LayerScales& scales) {
  const CacheWriteArgs args = validate_cache_write(op, key, value, key_cache, value_cache,
                                                   slot_mapping, kv_cache_dtype, scales);
  if (key.device() == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    detail::cuda_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                         args.cache_dtype, scales);
    return;
#else
    throw Error("key", detail::concat(op, ": key is on cuda but pagedattn was built without CUDA"));
#endif
  }
  if (args.num_tokens == 0) return;
  write_cache_host(key, value, key_cache, value_cache, slot_mapping, scales, args);
}

}  // namespace

void reshape_and_cache_flash(const TensorView& key, const TensorView& value,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                             const LayerScales& scales) {
  reshape_and_cache_impl("reshape_and_cache_flash", key, value, key_cache, value_cache,
                         slot_mapping, kv_cache_dtype, scales);
}

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& kv_cache,
                       const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                       float k_scale, float v_scale) {
  constexpr std::string_view op = "reshape_and_cache";
  check_rank(op, key, "key", 3, "(num_tokens, num_kv_heads, head_size)");
  check_rank(op, value, "value", 3, "(num_tokens, num_kv_heads, head_size_v)");
  check_rank(op, kv_cache, "kv_cache", 5,
             "(2, num_blocks, block_size, num_kv_heads, max(head_size, head_size_v))");
  const int64_t d = key.size(2);
  const int64_t dv = value.size(2);
  PAGEDATTN_CHECK(d > 0, "key", op, ": key has shape ", key.shape().str(),
                  ": head_size (dim 2) must be > 0");
  PAGEDATTN_CHECK(dv > 0, "value", op, ": value has shape ", value.shape().str(),
                  ": head_size_v (dim 2) must be > 0");
  PAGEDATTN_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) >= std::max(d, dv),
                  "kv_cache", op, ": kv_cache has shape ", kv_cache.shape().str(),
                  ", expected (2, num_blocks, block_size, num_kv_heads, ", std::max(d, dv),
                  ") for head_size ", d, " and head_size_v ", dv);
  const KVCacheViews halves =
      split_kv_cache(kv_cache, static_cast<int>(d), static_cast<int>(dv));
  LayerScales scales;
  scales.k_scale = k_scale;
  scales.v_scale = v_scale;
  reshape_and_cache_impl(op, key, value, halves.key_cache, halves.value_cache, slot_mapping,
                         kv_cache_dtype, scales);
}

}  // namespace pagedattn
