// The decode-only kernel, for plans whose items are all decode-path items (the builder's choice,
// kernel_selection.h): it computes what decode_path.cuh states, with its traffic (each KV byte
// once per GQA group), running the decode path with no prefill path. It still computes any plan
// exactly (prefill-path items in 16-row slices), so a graph captured with it replays any plan.
// Head sizes <= 128 (beyond, the o accumulators alone would need 128 registers).
//
// A decode step's math is a short dependent chain per warp (latency-bound), hidden behind the
// copies by the bytes the other CTAs and stages of an SM keep in flight; the floor is the copy
// floor (KV bytes / bandwidth). Shapes (measured in docs/perf/cuda.md):
//   16-bit caches: 2 stages of one 64-key tile (32 KB at D = 128), registers <= 168, 74 KB of
//     shared memory, 3 CTAs an SM: more independent CTAs, not deeper pipelines, hide the math
//     (bench/kv_access_probe.cu: 3 CTAs of 2 stages keep most of their copy rate, 2 of 3 do not);
//   fp8 at D = 128 and 64: steps of two / four tiles (32 KB, as a 16-bit d 128 tile), 3 stages
//     (about 100 KB), 2 CTAs an SM (registers <= 255): 128 KB in flight per SM while the CTAs
//     compute (at D = 128, 3 CTAs of 2 stages: 96 KB, 10% slower);
//   other fp8 head sizes: 3 stages of one tile, 3 CTAs.
// fp8 at D = 64 also runs items over kv-head pairs (kItemPairedHeads) on the D = 128 path: one
// head's 64-byte rows in an NHD page stream at about 70% of the copy rate, a pair's 128-byte rows
// near the full rate (bench/kv_access_probe; the planner pairs large decode batches).
#pragma once

#include "backends/cuda/attention/decode_path.cuh"
#include "backends/cuda/attention/kernel_selection.h"

#include <algorithm>

namespace pagedattn::cuda {

template <int D, typename T, bool kFp8>
struct DecodeKernelTraits {
  using Tr = AttentionTraits<D, T, kFp8>;
  static constexpr bool kExists = decode_kernel_head_size(D);
  static constexpr int kStages = kFp8 ? 3 : 2;
  static constexpr int kOwnSmemBytes =
      kDecodeRows * Tr::kRowStride * 2 + kStages * Tr::kDecodeStepBytes + Tr::kDecodeConvertedBytes;
  static_assert(Tr::kMergeBytes <= kOwnSmemBytes - kDecodeRows * Tr::kRowStride * 2);
  // Items over kv-head pairs run the D x 2 path (paired_decode_head_size).
  static constexpr bool kPairs = paired_decode_head_size(D, kFp8);
  static constexpr int smem_bytes() {
    if constexpr (kPairs) {
      return std::max(kOwnSmemBytes, DecodeKernelTraits<2 * D, T, kFp8>::kOwnSmemBytes);
    } else {
      return kOwnSmemBytes;
    }
  }
  static constexpr int kSmemBytes = smem_bytes();
  static constexpr int kMinCtasPerSm = Tr::kDecodeStepTiles > 1 ? 2 : 3;
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
      if constexpr (DecodeKernelTraits<D, T, kFp8>::kPairs) {
        if (slice.flags & kItemPairedHeads) {
          run_decode_item<2 * D, T, kFp8, DecodeKernelTraits<2 * D, T, kFp8>::kStages, true>(
              p, make_item_context(p, slice), smem);
          __syncthreads();
          continue;
        }
      }
      run_decode_item<D, T, kFp8, kStages>(p, make_item_context(p, slice), smem);
      __syncthreads();  // shared memory is reused by the next slice
    }
  }
}

}  // namespace pagedattn::cuda
