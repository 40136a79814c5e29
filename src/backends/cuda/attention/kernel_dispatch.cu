// Head-size dispatch of the attention kernel launches (the instantiations live in
// paged_attention_d<D>.cu).
#include <cuda_runtime.h>

#include "backends/cuda/attention/kernel_launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

template <int D>
AttentionKernelInfo attention_kernel_info_d(DType activation, bool fp8_kv, AttentionKernel kernel);
template <int D>
void launch_paged_attention_d(const AttentionKernelParams& params, DType activation, bool fp8_kv,
                              AttentionKernel kernel, int grid, void* stream);

bool attention_head_size_supported(int head_size) {
  for (int h : kSupportedHeadSizes) {
    if (h == head_size) return true;
  }
  return false;
}

AttentionKernelInfo attention_kernel_info(int head_size, DType activation, bool fp8_kv, AttentionKernel kernel) {
  switch (head_size) {
    case 64: return attention_kernel_info_d<64>(activation, fp8_kv, kernel);
    case 80: return attention_kernel_info_d<80>(activation, fp8_kv, kernel);
    case 96: return attention_kernel_info_d<96>(activation, fp8_kv, kernel);
    case 128: return attention_kernel_info_d<128>(activation, fp8_kv, kernel);
    case 192: return attention_kernel_info_d<192>(activation, fp8_kv, kernel);
    case 256: return attention_kernel_info_d<256>(activation, fp8_kv, kernel);
    default:
      throw Error("head_size", detail::concat("CUDA: head_size = ", head_size,
                                              " has no kernel: expected 64, 80, 96, 128, 192 or 256"));
  }
}

void launch_paged_attention(const AttentionKernelParams& params, int head_size, DType activation, bool fp8_kv,
                            AttentionKernel kernel, int grid, void* stream) {
  if (grid <= 0) return;
  switch (head_size) {
    case 64: return launch_paged_attention_d<64>(params, activation, fp8_kv, kernel, grid, stream);
    case 80: return launch_paged_attention_d<80>(params, activation, fp8_kv, kernel, grid, stream);
    case 96: return launch_paged_attention_d<96>(params, activation, fp8_kv, kernel, grid, stream);
    case 128: return launch_paged_attention_d<128>(params, activation, fp8_kv, kernel, grid, stream);
    case 192: return launch_paged_attention_d<192>(params, activation, fp8_kv, kernel, grid, stream);
    case 256: return launch_paged_attention_d<256>(params, activation, fp8_kv, kernel, grid, stream);
    default:
      throw Error("head_size", detail::concat("CUDA: head_size = ", head_size,
                                              " has no kernel: expected 64, 80, 96, 128, 192 or 256"));
  }
}

}  // namespace pagedattn::cuda
