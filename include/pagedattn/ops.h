// Standalone ops (vLLM _custom_ops), dispatched on the tensors' device.
#pragma once

#include <string_view>

#include "pagedattn/backend.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// Writes key (N, Hkv, D) and value (N, Hkv, Dv) into key_cache / value_cache
// (num_blocks, block_size, Hkv, D[v]) — any strides, e.g. the halves of split_kv_cache — at
// slot_mapping (i64, length N' <= N: tokens [0, N') are written; slot -1 skipped).
// kv_cache_dtype "fp8"/"fp8_e4m3"/"fp8_e5m2": stored = saturate(x / scale) (per-head scales
// from `scales` when defined). Every argument is checked before any byte is written; a bad one
// throws Error naming it and the cache is untouched.
void reshape_and_cache_flash(const TensorView& key, const TensorView& value,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                             const LayerScales& scales = {});
// Same, on the standard 5-D cache (kv_cache.h).
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& kv_cache,
                       const TensorView& slot_mapping, std::string_view kv_cache_dtype,
                       float k_scale = 1.f, float v_scale = 1.f);

// Merges two partial attention results by their LSEs (natural log, (H, T) f32):
//   out = (e^{lp - m} * prefix_output + e^{ls - m} * suffix_output) / (e^{lp - m} + e^{ls - m})
// +inf LSE counts as -inf; both -inf -> prefix_output copied (LSE -inf). Tokens t >=
// prefill_tokens_with_context (when >= 0) copy the suffix (and its LSE). output / prefix /
// suffix: (T, H, D); output_lse optional.
void merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                       const TensorView& prefix_lse, const TensorView& suffix_output,
                       const TensorView& suffix_lse, const TensorView& output_lse = {},
                       int64_t prefill_tokens_with_context = -1);

}  // namespace pagedattn
