// KV-cache specs (vLLM kv_cache_interface): page size of one block and the most memory one
// request can need, per kind of attention.
#include <algorithm>
#include <sstream>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/mla.h"

namespace pagedattn {

namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_common(int block_size, int num_kv_heads, int head_size, DType dtype, int head_size_v) {
  PAGEDATTN_CHECK(block_size > 0, "block_size", "block_size = ", block_size, " must be > 0");
  PAGEDATTN_CHECK(num_kv_heads > 0, "num_kv_heads", "num_kv_heads = ", num_kv_heads,
                  " must be > 0");
  PAGEDATTN_CHECK(head_size > 0, "head_size", "head_size = ", head_size, " must be > 0");
  PAGEDATTN_CHECK(head_size_v >= 0, "head_size_v", "head_size_v = ", head_size_v,
                  " must be >= 0 (0 = same as head_size)");
  PAGEDATTN_CHECK(is_floating(dtype), "dtype", "dtype = ", dtype_name(dtype),
                  " is not a KV-cache dtype: expected float32, float16, bfloat16, fp8_e4m3 or "
                  "fp8_e5m2");
}

KVCacheSpec make(KVCacheSpecKind kind, int block_size, int num_kv_heads, int head_size,
                 DType dtype, int head_size_v) {
  check_common(block_size, num_kv_heads, head_size, dtype, head_size_v);
  KVCacheSpec spec;
  spec.kind = kind;
  spec.block_size = block_size;
  spec.num_kv_heads = num_kv_heads;
  spec.head_size = head_size;
  spec.head_size_v = head_size_v;
  spec.dtype = dtype;
  return spec;
}

}  // namespace

std::string_view kv_cache_spec_kind_name(KVCacheSpecKind kind) {
  switch (kind) {
    case KVCacheSpecKind::full_attention: return "full_attention";
    case KVCacheSpecKind::sliding_window: return "sliding_window";
    case KVCacheSpecKind::chunked_local_attention: return "chunked_local_attention";
    case KVCacheSpecKind::cross_attention: return "cross_attention";
    case KVCacheSpecKind::mla: return "mla";
  }
  return "unknown";
}

KVCacheSpec KVCacheSpec::full_attention(int block_size, int num_kv_heads, int head_size,
                                        DType dtype, int head_size_v) {
  return make(KVCacheSpecKind::full_attention, block_size, num_kv_heads, head_size, dtype,
              head_size_v);
}

KVCacheSpec KVCacheSpec::sliding_window_attention(int block_size, int num_kv_heads, int head_size,
                                                  DType dtype, int sliding_window,
                                                  int head_size_v) {
  PAGEDATTN_CHECK(sliding_window > 0, "sliding_window", "sliding_window = ", sliding_window,
                  " must be > 0");
  KVCacheSpec spec = make(KVCacheSpecKind::sliding_window, block_size, num_kv_heads, head_size,
                          dtype, head_size_v);
  spec.sliding_window = sliding_window;
  return spec;
}

KVCacheSpec KVCacheSpec::chunked_local_attention(int block_size, int num_kv_heads, int head_size,
                                                 DType dtype, int attention_chunk_size,
                                                 int head_size_v) {
  PAGEDATTN_CHECK(attention_chunk_size > 0, "attention_chunk_size",
                  "attention_chunk_size = ", attention_chunk_size, " must be > 0");
  KVCacheSpec spec = make(KVCacheSpecKind::chunked_local_attention, block_size, num_kv_heads,
                          head_size, dtype, head_size_v);
  spec.attention_chunk_size = attention_chunk_size;
  return spec;
}

KVCacheSpec KVCacheSpec::cross_attention(int block_size, int num_kv_heads, int head_size,
                                         DType dtype, int head_size_v) {
  return make(KVCacheSpecKind::cross_attention, block_size, num_kv_heads, head_size, dtype,
              head_size_v);
}

KVCacheSpec KVCacheSpec::mla(int block_size, int latent_head_size, DType dtype) {
  // One latent vector (kv_lora_rank + qk_rope_head_dim) per token, one "KV head".
  return make(KVCacheSpecKind::mla, block_size, 1, latent_head_size, dtype, 0);
}

int64_t KVCacheSpec::page_size_bytes() const {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  if (kind == KVCacheSpecKind::mla) return int64_t{block_size} * head_size * elem;
  const int64_t last_dim = std::max(head_size, value_head_size());
  return 2 * int64_t{block_size} * num_kv_heads * last_dim * elem;
}

int64_t KVCacheSpec::max_num_blocks_per_request(int64_t max_model_len,
                                                int64_t max_num_batched_tokens,
                                                int64_t max_encoder_len) const {
  PAGEDATTN_CHECK(block_size > 0, "block_size", "block_size = ", block_size, " must be > 0");
  switch (kind) {
    case KVCacheSpecKind::full_attention:
    case KVCacheSpecKind::mla:
      PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", "max_model_len = ", max_model_len,
                      " must be > 0");
      return cdiv(max_model_len, block_size);
    case KVCacheSpecKind::sliding_window: {
      PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", "max_model_len = ", max_model_len,
                      " must be > 0");
      PAGEDATTN_CHECK(max_num_batched_tokens > 0, "max_num_batched_tokens",
                      "max_num_batched_tokens = ", max_num_batched_tokens, " must be > 0");
      const int64_t num_tokens =
          std::min<int64_t>(sliding_window - 1 + max_num_batched_tokens, max_model_len);
      // +1: the window need not start at a block boundary (as vLLM's SlidingWindowSpec).
      return cdiv(num_tokens, block_size) + 1;
    }
    case KVCacheSpecKind::chunked_local_attention: {
      PAGEDATTN_CHECK(max_model_len > 0, "max_model_len", "max_model_len = ", max_model_len,
                      " must be > 0");
      PAGEDATTN_CHECK(max_num_batched_tokens > 0, "max_num_batched_tokens",
                      "max_num_batched_tokens = ", max_num_batched_tokens, " must be > 0");
      const int64_t num_tokens =
          std::min<int64_t>(attention_chunk_size + max_num_batched_tokens, max_model_len);
      return cdiv(num_tokens, block_size);
    }
    case KVCacheSpecKind::cross_attention:
      PAGEDATTN_CHECK(max_encoder_len >= 0, "max_encoder_len", "max_encoder_len = ",
                      max_encoder_len, " must be >= 0");
      return cdiv(max_encoder_len, block_size);
  }
  throw Error("kind", detail::concat("kind = ", static_cast<int>(kind), " is not a spec kind"));
}

int64_t KVCacheSpec::max_memory_usage_bytes(int64_t max_model_len, int64_t max_num_batched_tokens,
                                            int64_t max_encoder_len) const {
  return max_num_blocks_per_request(max_model_len, max_num_batched_tokens, max_encoder_len) *
         page_size_bytes();
}

std::string KVCacheSpec::describe() const {
  std::ostringstream os;
  os << kv_cache_spec_kind_name(kind) << "(block_size=" << block_size;
  if (kind == KVCacheSpecKind::mla) {
    os << ", latent_head_size=" << head_size;
  } else {
    os << ", num_kv_heads=" << num_kv_heads << ", head_size=" << head_size;
    if (head_size_v > 0 && head_size_v != head_size) os << ", head_size_v=" << head_size_v;
  }
  os << ", dtype=" << dtype_name(dtype);
  if (kind == KVCacheSpecKind::sliding_window) os << ", sliding_window=" << sliding_window;
  if (kind == KVCacheSpecKind::chunked_local_attention) {
    os << ", attention_chunk_size=" << attention_chunk_size;
  }
  os << ", page_size_bytes=" << page_size_bytes() << ")";
  return os.str();
}

KVCacheSpec mla_attention_spec(int block_size, const MLADimensions& dims, DType activation_dtype,
                               std::string_view kv_cache_dtype) {
  // vLLM MLAAttentionSpec: one latent row (kv_lora_rank + qk_rope_head_dim) per token.
  PAGEDATTN_CHECK(dims.kv_lora_rank > 0, "mla_dimensions.kv_lora_rank",
                  "mla_attention_spec: mla_dimensions.kv_lora_rank = ", dims.kv_lora_rank, " must be > 0");
  PAGEDATTN_CHECK(dims.qk_rope_head_dim > 0, "mla_dimensions.qk_rope_head_dim",
                  "mla_attention_spec: mla_dimensions.qk_rope_head_dim = ", dims.qk_rope_head_dim,
                  " must be > 0");
  PAGEDATTN_CHECK(activation_dtype == DType::f32 || activation_dtype == DType::f16 ||
                      activation_dtype == DType::bf16,
                  "activation_dtype", "mla_attention_spec: activation_dtype = ",
                  dtype_name(activation_dtype), " must be float32, float16 or bfloat16");
  return KVCacheSpec::mla(block_size, dims.latent_head_size(),
                          kv_cache_storage_dtype(kv_cache_dtype, activation_dtype));
}

}  // namespace pagedattn
