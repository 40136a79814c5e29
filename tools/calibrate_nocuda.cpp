// GPU calibration in a build without CUDA: there is no device to measure.
#include "calibrate.h"

namespace pagedattn::cli {

std::optional<GpuCalibration> measure_gpu(int /*device_index*/, std::string* why) {
  if (why) *why = "this pagedattn was built without CUDA";
  return std::nullopt;
}

int gpu_sm_count(int /*device_index*/) { return 0; }

int64_t gpu_memory_bytes(int /*device_index*/) { return 0; }

}  // namespace pagedattn::cli
