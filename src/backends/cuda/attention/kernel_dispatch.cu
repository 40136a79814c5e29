// Head-size dispatch of the attention kernel launches (the instantiations live in
// paged_attention_d<D>.cu) and the kernel-image check.
#include <cuda_runtime.h>

#include "backends/cuda/attention/kernel_launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

template <int D>
AttentionKernelInfo attention_kernel_info_d(DType activation, bool fp8_kv);
template <int D>
void launch_paged_attention_d(const AttentionKernelParams& params, DType activation, bool fp8_kv, int grid,
                              bool decode_kernel, void* stream);

bool attention_head_size_supported(int head_size) {
  for (int h : kSupportedHeadSizes) {
    if (h == head_size) return true;
  }
  return false;
}

AttentionKernelInfo attention_kernel_info(int head_size, DType activation, bool fp8_kv) {
  switch (head_size) {
    case 64: return attention_kernel_info_d<64>(activation, fp8_kv);
    case 80: return attention_kernel_info_d<80>(activation, fp8_kv);
    case 96: return attention_kernel_info_d<96>(activation, fp8_kv);
    case 128: return attention_kernel_info_d<128>(activation, fp8_kv);
    case 192: return attention_kernel_info_d<192>(activation, fp8_kv);
    case 256: return attention_kernel_info_d<256>(activation, fp8_kv);
    default:
      throw Error("head_size", detail::concat("CUDA: head_size = ", head_size,
                                              " has no kernel: expected 64, 80, 96, 128, 192 or 256"));
  }
}

void launch_paged_attention(const AttentionKernelParams& params, int head_size, DType activation, bool fp8_kv,
                            int grid, bool decode_kernel, void* stream) {
  if (grid <= 0) return;
  switch (head_size) {
    case 64: return launch_paged_attention_d<64>(params, activation, fp8_kv, grid, decode_kernel, stream);
    case 80: return launch_paged_attention_d<80>(params, activation, fp8_kv, grid, decode_kernel, stream);
    case 96: return launch_paged_attention_d<96>(params, activation, fp8_kv, grid, decode_kernel, stream);
    case 128: return launch_paged_attention_d<128>(params, activation, fp8_kv, grid, decode_kernel, stream);
    case 192: return launch_paged_attention_d<192>(params, activation, fp8_kv, grid, decode_kernel, stream);
    case 256: return launch_paged_attention_d<256>(params, activation, fp8_kv, grid, decode_kernel, stream);
    default:
      throw Error("head_size", detail::concat("CUDA: head_size = ", head_size,
                                              " has no kernel: expected 64, 80, 96, 128, 192 or 256"));
  }
}

}  // namespace pagedattn::cuda
