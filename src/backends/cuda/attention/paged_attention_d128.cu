// Paged attention kernels for head size 128 (f16 / bf16 activations, 16-bit or fp8 KV). One file
// per head size so that the instantiations compile in parallel.
#include "backends/cuda/attention/attention_launch.cuh"

namespace pagedattn::cuda {
template AttentionKernelInfo attention_kernel_info_d<128>(DType, bool, AttentionKernel);
template void launch_paged_attention_d<128>(const AttentionKernelParams&, DType, bool, AttentionKernel, int,
                                             void*);
}  // namespace pagedattn::cuda
