// Definitions of the per-head-size launch helpers; each paged_attention_d<D>.cu instantiates
// them for one head size (so the six head sizes compile in parallel): the paged attention kernel
// in its variants, the decode-only kernel (head sizes <= 128) and the warp-specialized kernel
// (head sizes 64, 128 and 256). A launch runs the kernel its plan names (kernel_selection.h); the
// builder's occupancy figure (attention_kernel_info) is that kernel's.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backends/cuda/attention/kernel_launch.h"
#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/paged_attention_kernel.cuh"
#include "backends/cuda/attention/paged_attention_ws.cuh"
#include "backends/cuda/attention/paged_decode_kernel.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "pagedattn/error.h"

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

// The paged attention kernel in variant kVariant: shared-memory limit raised once per device.
template <int D, typename T, bool kFp8, int kVariant>
void configure_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices, reinterpret_cast<const void*>(paged_attention_kernel<D, T, kFp8, kVariant>),
                        KernelVariantTraits<D, T, kFp8, kVariant>::kSmemBytes,
                        "cudaFuncSetAttribute(paged_attention_kernel)");
}

// The decode-only kernel (paged_decode_kernel.cuh): shared-memory limit raised once per device.
template <int D, typename T, bool kFp8>
void configure_decode_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices, reinterpret_cast<const void*>(paged_decode_kernel<D, T, kFp8>),
                        DecodeKernelTraits<D, T, kFp8>::kSmemBytes, "cudaFuncSetAttribute(paged_decode_kernel)");
}

// The warp-specialized kernel (paged_attention_ws.cuh): shared-memory limit raised once per device.
template <int D, typename T, bool kFp8, bool kE5m2>
void configure_ws_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  raise_smem_limit_once(configured_devices,
                        reinterpret_cast<const void*>(paged_attention_ws_kernel<D, T, kFp8, kE5m2>),
                        WsTraits<D, kFp8>::kSmemBytes, "cudaFuncSetAttribute(paged_attention_ws_kernel)");
}

// A plan names a kernel this build has no instance of for the layer (its builder was made for
// another head size or cache dtype).
[[noreturn]] inline void throw_kernel_not_compiled(AttentionKernel kernel, int head_size, bool fp8_kv) {
  throw Error("metadata", detail::concat("CUDA: the plan runs the ", attention_kernel_name(kernel),
                                         " attention kernel, which has no instance for head size ", head_size,
                                         fp8_kv ? " with an fp8 cache" : " with a 16-bit cache",
                                         ": build the plan with the layer's KV cache spec"));
}

template <int D, typename T, bool kFp8, int kVariant>
AttentionKernelInfo paged_attention_kernel_info() {
  using V = KernelVariantTraits<D, T, kFp8, kVariant>;
  AttentionKernelInfo info;
  configure_kernel<D, T, kFp8, kVariant>();
  info.smem_bytes = V::kSmemBytes;
  info.rows_prefill = AttentionTraits<D, T, kFp8>::kPrefillRows;
  info.decode_step_tiles = AttentionTraits<D, T, kFp8>::kDecodeStepTiles;
  if constexpr (V::kPairs) info.paired_decode_step_tiles = AttentionTraits<2 * D, T, kFp8>::kDecodeStepTiles;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_attention_kernel<D, T, kFp8, kVariant>,
                                                kThreadsPerCta, V::kSmemBytes);
  check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_attention_kernel)");
  return info;
}

template <int D, typename T, bool kFp8>
AttentionKernelInfo attention_kernel_info_for(AttentionKernel kernel) {
  AttentionKernelInfo info;
  switch (kernel) {
    case AttentionKernel::decode:
      if constexpr (DecodeKernelTraits<D, T, kFp8>::kExists) {
        configure_decode_kernel<D, T, kFp8>();
        info.smem_bytes = DecodeKernelTraits<D, T, kFp8>::kSmemBytes;
        info.rows_prefill = AttentionTraits<D, T, kFp8>::kPrefillRows;
        info.decode_step_tiles = AttentionTraits<D, T, kFp8>::kDecodeStepTiles;
        if constexpr (DecodeKernelTraits<D, T, kFp8>::kPairs) {
          info.paired_decode_step_tiles = AttentionTraits<2 * D, T, kFp8>::kDecodeStepTiles;
        }
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_decode_kernel<D, T, kFp8>,
                                                      kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kSmemBytes);
        check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_decode_kernel)");
        return info;
      }
      break;
    case AttentionKernel::ws:
      if constexpr (WsTraits<D, kFp8>::kSupported) {
        // (the e4m3 and e5m2 instances share their traits: the e4m3 one stands for both)
        using W = WsTraits<D, kFp8>;
        configure_ws_kernel<D, T, kFp8, false>();
        info.smem_bytes = W::kSmemBytes;
        info.rows_prefill = W::kRows;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_attention_ws_kernel<D, T, kFp8, false>,
                                                      W::kThreads, W::kSmemBytes);
        check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_attention_ws_kernel)");
        return info;
      }
      break;
    case AttentionKernel::wgmma:
      if constexpr (WgmmaPrefillTraits<D>::kSupported && !kFp8) return paged_attention_kernel_info<D, T, kFp8, kVariantWgmma>();
      break;
    case AttentionKernel::mma:
      return paged_attention_kernel_info<D, T, kFp8, kVariantMma>();
  }
  throw_kernel_not_compiled(kernel, D, kFp8);
}

template <int D>
AttentionKernelInfo attention_kernel_info_d(DType activation, bool fp8_kv, AttentionKernel kernel) {
  if (activation == DType::bf16) {
    return fp8_kv ? attention_kernel_info_for<D, __nv_bfloat16, true>(kernel)
                  : attention_kernel_info_for<D, __nv_bfloat16, false>(kernel);
  }
  return fp8_kv ? attention_kernel_info_for<D, __half, true>(kernel)
                : attention_kernel_info_for<D, __half, false>(kernel);
}

template <int D, typename T, bool kFp8, int kVariant>
void launch_paged_attention_kernel(const AttentionKernelParams& params, int grid, cudaStream_t stream) {
  configure_kernel<D, T, kFp8, kVariant>();
  paged_attention_kernel<D, T, kFp8, kVariant>
      <<<grid, kThreadsPerCta, KernelVariantTraits<D, T, kFp8, kVariant>::kSmemBytes, stream>>>(params);
  check_launch("paged_attention_kernel");
}

template <int D, typename T, bool kFp8>
void launch_for(const AttentionKernelParams& params, AttentionKernel kernel, int grid, cudaStream_t stream) {
  switch (kernel) {
    case AttentionKernel::decode:
      if constexpr (DecodeKernelTraits<D, T, kFp8>::kExists) {
        configure_decode_kernel<D, T, kFp8>();
        paged_decode_kernel<D, T, kFp8>
            <<<grid, kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kSmemBytes, stream>>>(params);
        check_launch("paged_decode_kernel");
        return;
      }
      break;
    case AttentionKernel::ws:
      // (fp8: the instance of the cache's format, e4m3 or e5m2)
      if constexpr (WsTraits<D, kFp8>::kSupported) {
        using W = WsTraits<D, kFp8>;
        const auto launch = [&]<bool kE5m2>() {
          configure_ws_kernel<D, T, kFp8, kE5m2>();
          paged_attention_ws_kernel<D, T, kFp8, kE5m2><<<grid, W::kThreads, W::kSmemBytes, stream>>>(params);
          check_launch("paged_attention_ws_kernel");
        };
        if constexpr (kFp8) {
          if (params.fp8_format == 2) return launch.template operator()<true>();
        }
        return launch.template operator()<false>();
      }
      break;
    case AttentionKernel::wgmma:
      if constexpr (WgmmaPrefillTraits<D>::kSupported && !kFp8) {
        return launch_paged_attention_kernel<D, T, kFp8, kVariantWgmma>(params, grid, stream);
      }
      break;
    case AttentionKernel::mma:
      return launch_paged_attention_kernel<D, T, kFp8, kVariantMma>(params, grid, stream);
  }
  throw_kernel_not_compiled(kernel, D, kFp8);
}

template <int D>
void launch_paged_attention_d(const AttentionKernelParams& params, DType activation, bool fp8_kv,
                              AttentionKernel kernel, int grid, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (activation == DType::bf16) {
    fp8_kv ? launch_for<D, __nv_bfloat16, true>(params, kernel, grid, s)
           : launch_for<D, __nv_bfloat16, false>(params, kernel, grid, s);
  } else {
    fp8_kv ? launch_for<D, __half, true>(params, kernel, grid, s)
           : launch_for<D, __half, false>(params, kernel, grid, s);
  }
}

}  // namespace pagedattn::cuda
