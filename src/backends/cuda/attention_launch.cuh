// Definitions of the per-head-size launch helpers; each paged_attention_d<D>.cu instantiates
// them for one head size (so the six head sizes compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "backends/cuda/kernel_launch.h"
#include "backends/cuda/paged_attention_kernel.cuh"

namespace pagedattn::cuda {

// Raises the kernel's dynamic shared-memory limit on the current device (once per device).
template <int D, typename T, bool kFp8>
void configure_kernel() {
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured_devices.load() & bit) != 0) return;
  cudaFuncSetAttribute(paged_attention_kernel<D, T, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       AttentionTraits<D, T, kFp8>::kSmemBytes);
  check_launch("cudaFuncSetAttribute(paged_attention_kernel)");
  configured_devices.fetch_or(bit);
}

template <int D, typename T, bool kFp8>
AttentionKernelInfo attention_kernel_info_for() {
  using Tr = AttentionTraits<D, T, kFp8>;
  configure_kernel<D, T, kFp8>();
  AttentionKernelInfo info;
  info.smem_bytes = Tr::kSmemBytes;
  info.rows_prefill = Tr::kPrefillRows;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, paged_attention_kernel<D, T, kFp8>,
                                                kThreadsPerCta, Tr::kSmemBytes);
  check_launch("cudaOccupancyMaxActiveBlocksPerMultiprocessor(paged_attention_kernel)");
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
void launch_for(const AttentionKernelParams& params, int grid, cudaStream_t stream) {
  using Tr = AttentionTraits<D, T, kFp8>;
  configure_kernel<D, T, kFp8>();
  paged_attention_kernel<D, T, kFp8><<<grid, kThreadsPerCta, Tr::kSmemBytes, stream>>>(params);
  check_launch("paged_attention_kernel");
}

template <int D>
void launch_paged_attention_d(const AttentionKernelParams& params, DType activation, bool fp8_kv,
                              int grid, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (activation == DType::bf16) {
    fp8_kv ? launch_for<D, __nv_bfloat16, true>(params, grid, s)
           : launch_for<D, __nv_bfloat16, false>(params, grid, s);
  } else {
    fp8_kv ? launch_for<D, __half, true>(params, grid, s) : launch_for<D, __half, false>(params, grid, s);
  }
}

}  // namespace pagedattn::cuda
