// A kernel launched as the programmatic dependent of the kernel before it in the stream (host side;
// the device side is pdl:: in device_primitives.cuh). On devices that take it
// (programmatic_launch_supported: sm_90+) the launch carries
// cudaLaunchAttributeProgrammaticStreamSerialization: the dependent's CTAs may be scheduled once
// every CTA of the kernel before it has executed pdl::launch_dependents (or exited), so its launch
// and ramp overlap that kernel's tail; the dependent must execute pdl::wait_for_prerequisites
// before it reads what that kernel wrote, and every CTA of it should, so that its end is the
// prerequisite's end for whatever the stream runs next. Elsewhere an ordinary stream-ordered
// launch. Stream capture records it as a programmatic edge.
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/common/device_runtime.h"

namespace pagedattn::cuda {

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, const char* what,
                      Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = programmatic_launch_supported() ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
  check_launch(what);
}

}  // namespace pagedattn::cuda
