// Pieces shared by the host (CPU-memory) backends, REFERENCE and CPU: the accepted dtype
// vocabulary and the standard cache write of a step.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn::host {

// f32 / f16 / bf16.
bool is_activation_dtype(DType dtype);
// "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32".
bool is_accepted_kv_cache_dtype(std::string_view kv_cache_dtype);
std::string accepted_kv_cache_dtypes();  // the list above, comma separated
std::vector<std::string> kv_cache_dtype_names();  // the list above

// Layer scales of a host impl: per-head scales f32 (num_kv_heads,) on the host when given;
// per-tensor k/v scales positive and finite when the cache is fp8. `who` + `entry` prefix
// messages ("CPU forward: ...").
void check_layer_scales(const AttentionImplParams& params, DType cache_dtype,
                        const LayerScales& scales, std::string_view who, std::string_view entry);

// do_kv_cache_update of a standard 5-D host cache (kv_cache.h) for a step whose host slot
// mapping is `slots` ((num_slots,) i64): encoder types write nothing; key/value not given means
// every slot must be -1 (cross-attention after the encoder step); slots past key's rows must be
// -1; then reshape_and_cache_flash, which checks every slot before writing a byte.
// `check_cache_and_scales` (the backend's own checks of kv_cache against its plan and of the
// scales) runs once key/value are known to be given, before anything is written. `who` prefixes
// messages ("CPU", "REFERENCE").
void write_step_kv_cache(const AttentionImplParams& params, const LayerScales& scales,
                         const TensorView& key, const TensorView& value,
                         const TensorView& kv_cache, const TensorView& slots, std::string_view who,
                         const std::function<void()>& check_cache_and_scales);

}  // namespace pagedattn::host
