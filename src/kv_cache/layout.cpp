// KV-cache layouts (NHD / HND), the standard 5-D cache's stride order, key/value views of a
// cache and allocation of a cache contiguous in its physical order.
//
// Logical shape of a standard cache: (2, num_blocks, block_size, num_kv_heads, head_size).
//   NHD physical order (0, 1, 2, 3, 4): strides (N*B*H*D, B*H*D, H*D, D, 1)
//   HND physical order (0, 1, 3, 2, 4): strides (N*H*B*D, H*B*D, D, B*D, 1)
#include <atomic>
#include <cstdlib>
#include <string>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn {

namespace {

constexpr const char* kLayoutEnv = "PAGEDATTN_KV_CACHE_LAYOUT";

// -1 = no override, otherwise the KVCacheLayout value. Atomic: layers on several threads may read.
std::atomic<int> g_layout_override{-1};

std::optional<KVCacheLayout> try_parse_layout(std::string_view name) {
  if (name == "NHD") return KVCacheLayout::NHD;
  if (name == "HND") return KVCacheLayout::HND;
  return std::nullopt;
}

}  // namespace

std::string_view kv_cache_layout_name(KVCacheLayout layout) {
  switch (layout) {
    case KVCacheLayout::NHD: return "NHD";
    case KVCacheLayout::HND: return "HND";
  }
  return "unknown";
}

KVCacheLayout parse_kv_cache_layout(std::string_view name) {
  const std::optional<KVCacheLayout> layout = try_parse_layout(name);
  PAGEDATTN_CHECK(layout.has_value(), "kv_cache_layout", "kv_cache_layout = '", name,
                  "' is not a KV-cache layout: expected NHD or HND");
  return *layout;
}

KVCacheLayout get_kv_cache_layout() {
  const int override_value = g_layout_override.load(std::memory_order_acquire);
  if (override_value >= 0) return static_cast<KVCacheLayout>(override_value);
  // Read at every call (as vLLM reads its env on first use; re-reading lets tests change it).
  const char* env = std::getenv(kLayoutEnv);
  if (env == nullptr || env[0] == '\0') return KVCacheLayout::NHD;
  const std::optional<KVCacheLayout> layout = try_parse_layout(env);
  PAGEDATTN_CHECK(layout.has_value(), kLayoutEnv, kLayoutEnv, " = '", env,
                  "' is not a KV-cache layout: expected NHD or HND");
  return *layout;
}

void set_kv_cache_layout(std::optional<KVCacheLayout> layout) {
  g_layout_override.store(layout ? static_cast<int>(*layout) : -1, std::memory_order_release);
}

std::vector<int> standard_kv_cache_stride_order(KVCacheLayout layout) {
  if (layout == KVCacheLayout::HND) return {0, 1, 3, 2, 4};
  return {0, 1, 2, 3, 4};
}

KVCacheViews split_kv_cache(const TensorView& kv_cache, int head_size, int head_size_v) {
  check_ndim(kv_cache, "kv_cache", 5);
  PAGEDATTN_CHECK(kv_cache.size(0) == 2, "kv_cache", "kv_cache: dim 0 = ", kv_cache.size(0),
                  " in ", kv_cache.describe(),
                  ": expected 2 (keys, values) in (2, num_blocks, block_size, num_kv_heads, "
                  "head_size)");
  PAGEDATTN_CHECK(head_size > 0, "head_size", "head_size = ", head_size, " must be > 0");
  PAGEDATTN_CHECK(head_size_v >= 0, "head_size_v", "head_size_v = ", head_size_v,
                  " must be >= 0 (0 = same as head_size)");
  const int value_head_size = head_size_v > 0 ? head_size_v : head_size;
  const int64_t last = kv_cache.size(4);
  PAGEDATTN_CHECK(last >= head_size, "head_size", "head_size = ", head_size,
                  " exceeds the cache's last dim ", last, " (", kv_cache.describe(), ")");
  PAGEDATTN_CHECK(last >= value_head_size, "head_size_v", "head_size_v = ", value_head_size,
                  " exceeds the cache's last dim ", last, " (", kv_cache.describe(), ")");
  KVCacheViews views;
  // (num_blocks, block_size, num_kv_heads, head_size[_v]) with the cache's strides.
  views.key_cache = kv_cache.select(0, 0).narrow(3, 0, head_size);
  views.value_cache = kv_cache.select(0, 1).narrow(3, 0, value_head_size);
  return views;
}

Tensor allocate_paged_cache(const Shape& logical_shape, std::span<const int> stride_order,
                            DType dtype, Device device) {
  return Tensor::empty_permuted(logical_shape, stride_order, dtype, device);
}

}  // namespace pagedattn
