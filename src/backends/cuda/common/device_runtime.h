// Host helpers of every kernel launch of the CUDA backends (no CUDA types): the launch-error
// check, the device's multiprocessor count, which of this build's kernel images the current
// device loads, and whether it takes programmatic dependent launches.
#pragma once

#include <string>

namespace pagedattn::cuda {

// Throws Error("<what>: <cuda error>") when the last launch failed.
void check_launch(const char* what);

// Number of multiprocessors of the current device.
int current_device_sm_count();

// "" when this build's kernels can run on the current device; else a sentence saying why not
// (e.g. built for sm_90a, device is sm_80).
std::string kernel_image_problem();

// Whether the current device loads the sm_90a (wgmma) image of this build's kernels.
bool wgmma_kernels_available();

// Whether the current device takes programmatic dependent launches (compute capability 9.0+):
// launch_dependent (programmatic_launch.cuh) launches with the attribute only there.
bool programmatic_launch_supported();

}  // namespace pagedattn::cuda
