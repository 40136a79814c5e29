// The amax of the keys and values a cache write stores: what the Attention layer's
// calculate_kv_scales option measures on its first batch (layer.h). Internal (not installed).
#pragma once

#include "pagedattn/dtype.h"
#include "pagedattn/tensor.h"

namespace pagedattn::detail {

// max |x| over key rows and over value rows (each over every head and element).
struct KVAmax {
  float key = 0.f;
  float value = 0.f;
};

// amax(|key[t]|) and amax(|value[t]|) over the rows t < slot_mapping.size(0) whose
// slot_mapping[t] >= 0: exactly the rows reshape_and_cache writes (slot -1 = padding, skipped).
// No row written -> 0. A NaN among them gives NaN, else an infinity gives +inf (the max is taken
// over the bit patterns of |x|, where NaN > inf > every finite value), so the caller can reject
// a non-finite batch.
//
// Inputs, checked here with the cache ops' checks (ops_checks.h; an Error naming the argument,
// before anything is read): key (N, Hkv, D) and value (N, Hkv, Dv) f32/f16/bf16, any strides, on
// one device; slot_mapping i64 (N' <= N) on that device. Host tensors: read on the host. CUDA tensors: a kernel over the device tensors writes the two
// maxima into `device_result` (i32 (2,) on that device, overwritten), then ONE synchronous copy
// brings them to the host (the layer's scales are host floats; vLLM's calc_kv_scales syncs too,
// through .item()). Only the first batch of a layer with calculate_kv_scales pays it.
KVAmax written_rows_amax(const TensorView& key, const TensorView& value,
                         const TensorView& slot_mapping, const TensorView& device_result);

}  // namespace pagedattn::detail
