// Which kernel runs a plan of the CUDA attention backend (host side, no CUDA types: included by
// device code, tests and benchmarks too). The builder chooses once, at construction, from the
// layer, the cache, the device and the override (kernel_override.h), and stores the choice in
// every plan (CudaAttentionMetadata::kernel); the launch runs the plan's kernel and chooses
// nothing. Every kernel computes every plan exactly: they differ only in speed and resources.
//   mma     the paged attention kernel (paged_attention_kernel.cuh) with the mma.sync prefill
//           path: every head size, 16-bit and fp8 caches;
//   wgmma   the paged attention kernel with the one-warpgroup Hopper wgmma prefill path
//           (paged_prefill_wgmma.cuh): 16-bit caches, head_size == head_size_v = 64, 128 or 256,
//           sm_90a;
//   ws      the warp-specialized kernel (paged_attention_ws.cuh: a producer warpgroup and two wgmma
//           consumer warpgroups, one code path for every item): head_size == head_size_v = 64, 128
//           or 256 with a 16-bit cache, 128 or 256 with an fp8 cache (e4m3 or e5m2: 8-bit wgmma, ws_fp8.cuh),
//           sm_90a, K/V strides under 4 GiB;
//   decode  the decode-only kernel (paged_decode_kernel.cuh): head sizes <= 128; the planner gives
//           it the batches whose items are all decode-path items (planner.h).
// Choice of the non-decode kernel (select_attention_kernel): ws where it exists, else wgmma where
// it exists, else mma; the override's prefill= narrows it (mma: mma.sync everywhere; wgmma: no
// ws). Why: ws streams decodes at the copy floor and runs prefill and mixed batches fastest at
// the head sizes it has; the one-warpgroup wgmma path beats mma.sync at head size 256 (measured
// in docs/perf/cuda.md).
#pragma once

#include <cstdint>

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/common/kernel_override.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda {

enum class AttentionKernel : int32_t { mma, wgmma, ws, decode };

// "mma", "wgmma", "ws" or "decode".
const char* attention_kernel_name(AttentionKernel kernel);

// Head sizes (D = max(head_size, head_size_v)) each kernel is compiled for.
constexpr bool wgmma_prefill_head_size(int d) { return d == 64 || d == 128 || d == 256; }
constexpr bool ws_kernel_head_size(int d) { return d == 64 || d == 128 || d == 256; }
constexpr bool ws_fp8_head_size(int d) { return d == 128 || d == 256; }  // with an fp8 cache
constexpr bool decode_kernel_head_size(int d) { return d <= 128; }
// Decode items over kv-head pairs (kItemPairedHeads, attention_plan.h): fp8 caches at head size
// 64, whose one-head rows of 64 bytes stream slower than a pair's 128 (docs/perf/cuda.md). Such
// an item runs the d 128 fp8 decode path inside the d 64 kernels.
constexpr bool paired_decode_head_size(int d, bool fp8_kv) { return fp8_kv && d == 64; }

// AttentionKernelParams::fp8_format of a cache dtype: 1 e4m3, 2 e5m2, 0 a 16-bit (or no) cache.
constexpr int fp8_format_of(DType kv_dtype) {
  return kv_dtype == DType::fp8_e4m3 ? 1 : kv_dtype == DType::fp8_e5m2 ? 2 : 0;
}

// The kernel of a layer's plans that are not decode-only. fp8_format: the cache's, as
// AttentionKernelParams::fp8_format (0: 16-bit, 1: e4m3, 2: e5m2); wgmma_image: the device loads
// this build's sm_90a image (wgmma_kernels_available()); ws_strides_ok: the cache's strides suit
// the warp-specialized kernel (ws_strides_fit).
AttentionKernel select_attention_kernel(PrefillKernelChoice choice, int head_size, int head_size_v, int fp8_format,
                                        bool wgmma_image, bool ws_strides_ok);

// The warp-specialized kernel's copies use 32-bit byte strides: true when the K/V block strides
// and a block's rows (rows = block_size when paged, else 1) fit them. Strides in 16-bit elements.
constexpr bool ws_strides_fit(int64_t k_block_stride, int64_t k_token_stride, int64_t v_block_stride,
                              int64_t v_token_stride, int64_t rows) {
  const int64_t limit = int64_t{1} << 32;
  return k_block_stride * 2 < limit && v_block_stride * 2 < limit && rows * k_token_stride * 2 < limit &&
         rows * v_token_stride * 2 < limit;
}
inline bool ws_strides_fit(const AttentionKernelParams& p) {
  return ws_strides_fit(p.k_block_stride, p.k_token_stride, p.v_block_stride, p.v_token_stride,
                        p.paged ? (p.block_size > 1 ? p.block_size : 1) : 1);
}

}  // namespace pagedattn::cuda
