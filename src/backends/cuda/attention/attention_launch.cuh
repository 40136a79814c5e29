// Definitions of the per-head-size launch helpers; each paged_attention_d<D>.cu instantiates
// them for one head size (so the six head sizes compile in parallel): the paged attention kernel
// and, for head sizes <= 128, the decode-only kernel.
//
// Kernel variants (attention_kernel_choice.h): a launch runs the variant that
// attention_kernel_choice() and the device select for its (D, cache, head sizes); the builder's
// occupancy figure (attention_kernel_info) is that of the same selection.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backends/cuda/attention/attention_kernel_choice.h"
#include "backends/cuda/attention/kernel_launch.h"
#include "backends/cuda/attention/paged_attention_kernel.cuh"
#include "backends/cuda/attention/paged_attention_ws.cuh"
#include "backends/cuda/attention/paged_decode_kernel.cuh"
#include "backends/cuda/common/device_runtime.h"

namespace pagedattn::cuda {

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per device
// (`configured_devices`: one bit per device, owned by the caller's instantiation).
inline void raise_smem_limit_once(std::atomic<uint64_t>& configured_devices, const void* kernel, int bytes,
                                  const char* what) {
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured_devices.load() & bit) != 0) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  check_launch(what);
  configured_devices.fetch_or(bit);
}

// Raises the kernel's dynamic shared-memory limit on the current device (once per device).
template <int D, typename T, bool kFp8, int kVariant>
void configure_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices, reinterpret_cast<const void*>(paged_attention_kernel<D, T, kFp8, kVariant>),
                        KernelVariantTraits<D, T, kFp8, kVariant>::kSmemBytes,
                        "cudaFuncSetAttribute(paged_attention_kernel)");
}

// Whether the warp-specialized kernel's 32-bit byte strides hold this launch's K/V (always for
// the caches and current rows of real models: a block of 16 tokens x 8 heads x 128 is 32 KB).
inline bool ws_strides_fit(const AttentionKernelParams& p) {
  const int64_t limit = int64_t{1} << 32;
  const int64_t rows = p.paged ? std::max(1, p.block_size) : 1;
  return p.k_block_stride * 2 < limit && p.v_block_stride * 2 < limit && rows * p.k_token_stride * 2 < limit &&
         rows * p.v_token_stride * 2 < limit;
}

// The variant for head size D and this cache under the current choice; `equal_dims`: the layer's
// head_size == head_size_v == D (the wgmma path has no narrow-row copies); `ws_fits`: the launch's
// strides suit the warp-specialized kernel (ws_strides_fit; true when the builder asks).
template <int D, bool kFp8>
int select_kernel_variant(bool equal_dims, bool ws_fits = true) {
  const AttentionKernelChoice choice = attention_kernel_choice();
  if constexpr (WsTraits<D>::kSupported && !kFp8) {
    const bool want_ws = choice == AttentionKernelChoice::ws || choice == AttentionKernelChoice::automatic;
    if (want_ws && equal_dims && ws_fits && wgmma_kernels_available()) return kVariantWs;
  }
  if constexpr (WgmmaPrefillTraits<D>::kSupported && !kFp8) {
    if (choice != AttentionKernelChoice::mma && equal_dims && wgmma_kernels_available()) return kVariantWgmma;
  }
  return kVariantMma;
}

// Calls f.template operator()<kVariant>() for the runtime variant (only the variants of the paged
// attention kernel that exist for (D, kFp8) are instantiated; kVariantWs is the caller's).
template <int D, bool kFp8, class F>
void with_kernel_variant(int variant, F&& f) {
  if constexpr (WgmmaPrefillTraits<D>::kSupported && !kFp8) {
    if (variant == kVariantWgmma) return f.template operator()<kVariantWgmma>();
  }
  return f.template operator()<kVariantMma>();
}

// The decode-only kernel (paged_decode_kernel.cuh): shared-memory limit raised once per device.
template <int D, typename T, bool kFp8>
void configure_decode_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices, reinterpret_cast<const void*>(paged_decode_kernel<D, T, kFp8>),
                        DecodeKernelTraits<D, T, kFp8>::kSmemBytes, "cudaFuncSetAttribute(paged_decode_kernel)");
}

// The warp-specialized kernel (paged_attention_ws.cuh): shared-memory limit raised once per device.
template <int D, typename T>
void configure_ws_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices, reinterpret_cast<const void*>(paged_attention_ws_kernel<D, T>),
                        WsTraits<D>::kSmemBytes, "cudaFuncSetAttribute(paged_attention_ws_kernel)");
}

template <int D, typename T, bool kFp8>
AttentionKernelInfo attention_kernel_info_for() {
  AttentionKernelInfo info;
  if constexpr (DecodeKernelTraits<D, T, kFp8>::kExists) {
    configure_decode_kernel<D, T, kFp8>();
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.decode_ctas_per_sm, paged_decode_kernel<D, T, kFp8>,
                                                  kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kSmemBytes);
    check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_decode_kernel)");
  }
  const int variant = select_kernel_variant<D, kFp8>(true);
  if constexpr (WsTraits<D>::kSupported && !kFp8) {
    if (variant == kVariantWs) {
      configure_ws_kernel<D, T>();
      info.smem_bytes = WsTraits<D>::kSmemBytes;
      info.rows_prefill = WsTraits<D>::kRows;
      info.warp_specialized = true;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_attention_ws_kernel<D, T>,
                                                    WsTraits<D>::kThreads, WsTraits<D>::kSmemBytes);
      check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_attention_ws_kernel)");
      return info;
    }
  }
  with_kernel_variant<D, kFp8>(variant, [&]<int kVariant>() {
    using V = KernelVariantTraits<D, T, kFp8, kVariant>;
    configure_kernel<D, T, kFp8, kVariant>();
    info.smem_bytes = V::kSmemBytes;
    info.rows_prefill = AttentionTraits<D, T, kFp8>::kPrefillRows;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_attention_kernel<D, T, kFp8, kVariant>,
                                                  kThreadsPerCta, V::kSmemBytes);
    check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_attention_kernel)");
  });
  return info;
}

template <int D>
AttentionKernelInfo attention_kernel_info_d(DType activation, bool fp8_kv) {
  if (activation == DType::bf16) {
    return fp8_kv ? attention_kernel_info_for<D, __nv_bfloat16, true>()
                  : attention_kernel_info_for<D, __nv_bfloat16, false>();
  }
  return fp8_kv ? attention_kernel_info_for<D, __half, true>()
                : attention_kernel_info_for<D, __half, false>();
}

template <int D, typename T, bool kFp8>
void launch_for(const AttentionKernelParams& params, int grid, bool decode_kernel, cudaStream_t stream) {
  if constexpr (DecodeKernelTraits<D, T, kFp8>::kExists) {
    if (decode_kernel) {
      configure_decode_kernel<D, T, kFp8>();
      paged_decode_kernel<D, T, kFp8>
          <<<grid, kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kSmemBytes, stream>>>(params);
      check_launch("paged_decode_kernel");
      return;
    }
  }
  const bool equal_dims = params.head_size_qk == D && params.head_size_v == D;
  const int variant = select_kernel_variant<D, kFp8>(equal_dims, ws_strides_fit(params));
  if constexpr (WsTraits<D>::kSupported && !kFp8) {
    if (variant == kVariantWs) {
      configure_ws_kernel<D, T>();
      paged_attention_ws_kernel<D, T><<<grid, WsTraits<D>::kThreads, WsTraits<D>::kSmemBytes, stream>>>(params);
      check_launch("paged_attention_ws_kernel");
      return;
    }
  }
  with_kernel_variant<D, kFp8>(variant, [&]<int kVariant>() {
    configure_kernel<D, T, kFp8, kVariant>();
    paged_attention_kernel<D, T, kFp8, kVariant>
        <<<grid, kThreadsPerCta, KernelVariantTraits<D, T, kFp8, kVariant>::kSmemBytes, stream>>>(params);
    check_launch("paged_attention_kernel");
  });
}

template <int D>
void launch_paged_attention_d(const AttentionKernelParams& params, DType activation, bool fp8_kv,
                              int grid, bool decode_kernel, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (activation == DType::bf16) {
    fp8_kv ? launch_for<D, __nv_bfloat16, true>(params, grid, decode_kernel, s)
           : launch_for<D, __nv_bfloat16, false>(params, grid, decode_kernel, s);
  } else {
    fp8_kv ? launch_for<D, __half, true>(params, grid, decode_kernel, s)
           : launch_for<D, __half, false>(params, grid, decode_kernel, s);
  }
}

}  // namespace pagedattn::cuda
