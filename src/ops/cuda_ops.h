// Internal CUDA entry points of the standalone ops (src/ops/ops.cpp validates every argument on
// the host, then calls these when the tensors live on Device::cuda). Implemented by the CUDA
// backend in src/backends/cuda/. Only compiled into the library when PAGEDATTN_HAS_CUDA.
//
// Preconditions (already checked by the caller, do not re-check):
//   cuda_reshape_and_cache_flash:
//     key (N, Hkv, D), value (N, Hkv, Dv): f32/f16/bf16, any strides, on one CUDA device;
//     key_cache (num_blocks, block_size, Hkv, D), value_cache (num_blocks, block_size, Hkv, Dv):
//       dtype == cache_dtype, any strides;
//     slot_mapping: i64 1-D of length N' <= N (tokens [0, N') are written). Slot contents were
//       NOT read on the host (that would need a sync): the kernel skips slot -1 AND any slot
//       outside [0, num_blocks * block_size) (never writes out of bounds);
//     scales: k_scale/v_scale > 0 finite; k_scale_per_head / v_scale_per_head, when defined,
//       f32 (Hkv,) on the same device and replace the per-tensor scales.
//     fp8 caches: stored = saturate(x / scale) (round to nearest even, saturate to the finite max).
//   cuda_merge_attn_states:
//     output, prefix_output, suffix_output: (T, H, D), one dtype in f32/f16/bf16, any strides;
//     prefix_lse, suffix_lse: f32 (H, T); output_lse: f32 (H, T) or undefined;
//     prefill_tokens_with_context: -1 (all tokens merged) or in [0, T]: tokens >= it copy the
//       suffix output and the suffix LSE. Semantics as ops.h merge_attn_states, exactly:
//       an LSE of +inf is read as -inf (FA2 writes +inf for empty rows); m = max(lp, ls);
//       m == -inf -> output = prefix_output, output_lse = -inf; else
//       wp = e^{lp-m}, ws = e^{ls-m}, out = (wp*p + ws*s)/(wp+ws), lse = log(wp+ws) + m,
//       computed in f32 and rounded once to the output dtype.
//   cuda_written_rows_amax (the Attention layer's calculate_kv_scales, ops/kv_amax.h):
//     key (N, Hkv, D), value (N, Hkv, Dv): f32/f16/bf16, any strides; slot_mapping: i64 1-D of
//     length N' <= N; result: i32 (2,) on the same device. Sets result[0] / result[1] to the
//     largest bit pattern of |key[t]| / |value[t]| (as f32) over the rows t < N' whose slot is
//     >= 0 (0 when none): the bit order of non-negative floats is their numeric order, with NaN
//     above +inf. result is cleared on the stream first.
// All enqueue on the current stream and do not synchronize.
#pragma once

#include <cstdint>

#include "pagedattn/backend.h"
#include "pagedattn/dtype.h"
#include "pagedattn/tensor.h"

namespace pagedattn::detail {

void cuda_reshape_and_cache_flash(const TensorView& key, const TensorView& value,
                                  const TensorView& key_cache, const TensorView& value_cache,
                                  const TensorView& slot_mapping, DType cache_dtype,
                                  const LayerScales& scales);

void cuda_written_rows_amax(const TensorView& key, const TensorView& value,
                            const TensorView& slot_mapping, const TensorView& result);

void cuda_merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                            const TensorView& prefix_lse, const TensorView& suffix_output,
                            const TensorView& suffix_lse, const TensorView& output_lse,
                            int64_t prefill_tokens_with_context);

// MLA ops (mla.h; host checks in src/ops/mla_ops.cpp, kernels in src/backends/cuda/):
//   cuda_concat_and_cache_mla: kv_c (N, L), k_pe (N, R) (any token stride, last dim contiguous),
//     f32/f16/bf16; kv_cache (num_blocks, block_size, L + R) of cache_dtype, any strides with the
//     last dim contiguous; slot_mapping i64 (N' <= N); slots -1 or outside the cache skipped.
//     fp8: stored = saturate(x / scale).
//   cuda_gather_and_maybe_dequant_cache: as mla.h; block ids outside [0, num_blocks) skipped
//     (those dst rows untouched); dst (rows, L + R) any row stride, last dim contiguous.
void cuda_concat_and_cache_mla(const TensorView& kv_c, const TensorView& k_pe,
                               const TensorView& kv_cache, const TensorView& slot_mapping,
                               DType cache_dtype, float scale);
void cuda_gather_and_maybe_dequant_cache(const TensorView& src_cache, const TensorView& dst,
                                         const TensorView& block_table,
                                         const TensorView& cu_seq_lens, int batch_size,
                                         DType cache_dtype, float scale,
                                         const TensorView& seq_starts);

}  // namespace pagedattn::detail
