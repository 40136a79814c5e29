// Choice of the CUDA attention kernel of a layer's plans (kernel_selection.h). Pure C++: compiled
// in every build.
#include "backends/cuda/attention/kernel_selection.h"

namespace pagedattn::cuda {

const char* attention_kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::mma: return "mma";
    case AttentionKernel::wgmma: return "wgmma";
    case AttentionKernel::ws: return "ws";
    case AttentionKernel::decode: return "decode";
  }
  return "unknown";
}

AttentionKernel select_attention_kernel(PrefillKernelChoice choice, int head_size, int head_size_v, int fp8_format,
                                        bool wgmma_image, bool ws_strides_ok) {
  // The wgmma paths have no narrow-row copies; fp8 caches (e4m3 and e5m2) have an 8-bit wgmma
  // path in the warp-specialized kernel, at D = 128 and 256.
  const bool hopper_paths = head_size == head_size_v && wgmma_image;
  const bool ws_head_size = fp8_format == 0 ? ws_kernel_head_size(head_size) : ws_fp8_head_size(head_size);
  if (hopper_paths && ws_head_size && ws_strides_ok &&
      (choice == PrefillKernelChoice::automatic || choice == PrefillKernelChoice::ws)) {
    return AttentionKernel::ws;
  }
  if (hopper_paths && fp8_format == 0 && wgmma_prefill_head_size(head_size) && choice != PrefillKernelChoice::mma) {
    return AttentionKernel::wgmma;
  }
  return AttentionKernel::mma;
}

}  // namespace pagedattn::cuda
