// The paged attention kernel of the CUDA backend: one launch serves a whole batch that mixes
// decodes, prefill chunks (causal with context), non-causal rows (encoder types, cross
// attention), over a paged cache (NHD or HND, 16-bit or fp8) or over the current K/V rows. Each
// work item computes what paged_attention_common.cuh states.
//
// Schedule: a CTA of 4 warps runs the plan's items in a persistent loop (grid <= resident CTAs;
// graph capturable: the counts are read from device memory). Two code paths share the launch:
//   decode path  (<= 16 rows): decode_path.cuh;
//   prefill path (64 / 128 rows): kVariantMma the mma.sync path (prefill_mma.cuh, every head size
//                and cache), kVariantWgmma the Hopper wgmma path (paged_prefill_wgmma.cuh;
//                16-bit caches, D = 64 / 128 / 256, sm_90a).
// Which kernel runs a plan (this one in either variant, the decode-only kernel of
// paged_decode_kernel.cuh, or the warp-specialized one of paged_attention_ws.cuh) is the builder's
// choice, stored in the plan (kernel_selection.h); each computes every plan.
// Shared memory: the larger of the two paths' (the decode path's stages, the prefill path's Q
// rows and stages), 1024-byte aligned for the wgmma path's 128-byte swizzle.
// Memory traffic: each item's, as its path states (each KV byte of its range once per GQA group
// for decode items, once per item for prefill items); Q and O once; the plan and its counts once
// per item.
#pragma once

#include "backends/cuda/attention/decode_path.cuh"
#include "backends/cuda/attention/paged_prefill_wgmma.cuh"
#include "backends/cuda/attention/prefill_mma.cuh"

namespace pagedattn::cuda {

// The prefill path compiled into the kernel (its template argument kVariant): AttentionKernel::mma
// runs kVariantMma, AttentionKernel::wgmma kVariantWgmma (kernel_selection.h).
enum KernelVariant : int {
  kVariantMma = 0,
  kVariantWgmma = 1,
};

// Resources of a kernel variant.
template <int D, typename T, bool kFp8, int kVariant>
struct KernelVariantTraits {
  using Tr = AttentionTraits<D, T, kFp8>;
  using W = WgmmaPrefillTraits<D>;
  static constexpr bool kWgmma = kVariant == kVariantWgmma;
  static constexpr bool kValid = kVariant == kVariantMma || (kWgmma && W::kSupported && !kFp8);
  static_assert(kValid, "no such kernel variant for this head size / cache");
  static constexpr int kPrefillSmem = kWgmma ? W::kSmemBytes : Tr::kPrefillSmem;
  // Items over kv-head pairs run the D x 2 decode path (paired_decode_head_size).
  static constexpr bool kPairs = paired_decode_head_size(D, kFp8);
  static constexpr int decode_smem() {
    if constexpr (kPairs) {
      return AttentionTraits<2 * D, T, kFp8>::kDecodeSmem > Tr::kDecodeSmem ? AttentionTraits<2 * D, T, kFp8>::kDecodeSmem
                                                                            : Tr::kDecodeSmem;
    } else {
      return Tr::kDecodeSmem;
    }
  }
  static constexpr int kDecodeSmem = decode_smem();
  static constexpr int kSmemBytes = kPrefillSmem > kDecodeSmem ? kPrefillSmem : kDecodeSmem;
  static constexpr int kMinCtasPerSm = Tr::kMinCtasPerSm;
};

template <int D, typename T, bool kFp8, int kVariant>
__global__ void __launch_bounds__(kThreadsPerCta, KernelVariantTraits<D, T, kFp8, kVariant>::kMinCtasPerSm)
    paged_attention_kernel(const AttentionKernelParams p) {
  using V = KernelVariantTraits<D, T, kFp8, kVariant>;
  extern __shared__ __align__(1024) char smem[];  // 1024: the wgmma path's 128-byte swizzle
  const int num_items = p.header->num_work_items;
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const ItemContext ctx = make_item_context(p, p.items[i]);
    if (V::kPairs && (ctx.item.flags & kItemPairedHeads)) {
      if constexpr (V::kPairs) run_decode_item<2 * D, T, kFp8, AttentionTraits<2 * D, T, kFp8>::kDecodeStages, true>(p, ctx, smem);
    } else if (ctx.item.flags & kItemDecodePath) {
      run_decode_item<D, T, kFp8>(p, ctx, smem);
    } else if constexpr (V::kWgmma) {
      run_prefill_item_wgmma<D, T>(p, ctx, smem);
    } else {
      run_prefill_item<D, T, kFp8>(p, ctx, smem);
    }
    __syncthreads();  // shared memory is reused by the next item
  }
}

}  // namespace pagedattn::cuda
