// Host-side entry points of the CUDA attention kernels (no CUDA types: streams are void*).
// Every function enqueues on `stream` and returns without synchronizing; a launch failure throws
// pagedattn::Error naming the kernel and cudaGetErrorString.
#pragma once

#include <cstdint>

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/attention/kernel_selection.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda {

// Head sizes with a compiled attention kernel.
inline constexpr int kSupportedHeadSizes[] = {64, 80, 96, 128, 192, 256};
bool attention_head_size_supported(int head_size);

struct AttentionKernelInfo {
  int smem_bytes = 0;       // dynamic shared memory per CTA
  int ctas_per_sm = 0;      // resident CTAs per multiprocessor (occupancy)
  int rows_prefill = 0;     // rows of a prefill-path item
  int decode_step_tiles = 1;  // 64-key tiles of a decode-path pipeline step (mma / decode kernels)
  int paired_decode_step_tiles = 0;  // the same for kv-head-pair items (0: the kernel runs none)
};
// Sets `kernel`'s shared-memory attribute on the current device (once) and reports its
// occupancy. activation: f16 or bf16; fp8_kv: the cache holds fp8. Error when the kernel has no
// instance for (head_size, cache) (kernel_selection.h says which exist).
AttentionKernelInfo attention_kernel_info(int head_size, DType activation, bool fp8_kv, AttentionKernel kernel);

// Launches `kernel` (the plan's: kernel_selection.h) with `grid` persistent CTAs; Error when it
// has no instance for (head_size, cache).
void launch_paged_attention(const AttentionKernelParams& params, int head_size, DType activation,
                            bool fp8_kv, AttentionKernel kernel, int grid, void* stream);

// Merges split partials (CombineItem list) into the output; `grid` persistent CTAs.
void launch_combine_splits(const CombineKernelParams& params, DType activation, int grid,
                           void* stream);

}  // namespace pagedattn::cuda
