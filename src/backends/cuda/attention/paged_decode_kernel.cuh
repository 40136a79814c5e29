// The decode-only kernel, for plans whose items are all decode-path items (the builder's choice,
// kernel_selection.h): it computes what decode_path.cuh states, with its traffic (each KV byte
// once per GQA group), running the decode path with a 2-stage pipeline and no prefill
// path, so the registers (<= 168) and the shared memory (D = 128: 74 KB) let 3 CTAs share an SM
// instead of 2. It still computes any plan exactly (prefill-path items in 16-row slices), so a
// graph captured with it replays any plan.
// A decode item's math is latency-bound (one 16-row MMA chain per warp per tile), so it is the
// number of independent CTAs per SM, not the pipeline depth, that hides it behind the copies
// (bench/kv_access_probe.cu measured both: 3 CTAs of 2 stages keep most of their copy rate under a
// decode tile's worth of math, 2 CTAs of 3 stages lose several times more; docs/perf/cuda.md).
// Head sizes <= 128 (beyond, the o accumulators alone would need 128 registers).
#pragma once

#include "backends/cuda/attention/decode_path.cuh"
#include "backends/cuda/attention/kernel_selection.h"

namespace pagedattn::cuda {

template <int D, typename T, bool kFp8>
struct DecodeKernelTraits {
  using Tr = AttentionTraits<D, T, kFp8>;
  static constexpr bool kExists = decode_kernel_head_size(D);
  static constexpr int kStages = 2;
  static constexpr int kSmemBytes =
      kDecodeRows * Tr::kRowStride * 2 + kStages * Tr::kStageBytes + Tr::kDecodeConvertedBytes;
  static_assert(Tr::kMergeBytes <= kSmemBytes - kDecodeRows * Tr::kRowStride * 2);
  static constexpr int kMinCtasPerSm = 3;
};

template <int D, typename T, bool kFp8>
__global__ void __launch_bounds__(kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kMinCtasPerSm)
    paged_decode_kernel(const AttentionKernelParams p) {
  static_assert(DecodeKernelTraits<D, T, kFp8>::kExists);
  extern __shared__ __align__(128) char smem[];
  constexpr int kStages = DecodeKernelTraits<D, T, kFp8>::kStages;
  const int num_items = p.header->num_work_items;
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const WorkItem item = p.items[i];
    // 16-row slices: a decode-path item is one slice (itself); a prefill-path item (only when a
    // graph captured with a decode-only plan replays another plan) is several, each over the
    // item's keys: exact, not fast.
    for (int r0 = 0; r0 < item.num_rows; r0 += kDecodeRows) {
      WorkItem slice = item;
      slice.row_start += r0;
      slice.num_rows = min(kDecodeRows, item.num_rows - r0);
      if (slice.partial_row >= 0) slice.partial_row += r0;
      run_decode_item<D, T, kFp8, kStages>(p, make_item_context(p, slice), smem);
      __syncthreads();  // shared memory is reused by the next slice
    }
  }
}

}  // namespace pagedattn::cuda
