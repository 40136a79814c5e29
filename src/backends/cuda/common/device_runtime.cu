// Host helpers of the CUDA backends' launches (device_runtime.h). The kernel-image queries ask the
// runtime about a probe kernel compiled with the same targets as every other kernel.
#include "backends/cuda/common/device_runtime.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

// Built for sm_90a, the probe has no static shared memory; built for another target it has a
// marker array, which cudaFuncGetAttributes reports (the device then runs that other image).
__global__ void wgmma_image_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (out != nullptr) *out = 1;
#else
  __shared__ int not_sm90a_marker[32];
  reinterpret_cast<volatile int*>(not_sm90a_marker)[threadIdx.x & 31] = 0;
  if (out != nullptr) *out = not_sm90a_marker[0];
#endif
}

}  // namespace

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) [[unlikely]] {
    throw Error("device", detail::concat("CUDA: ", what, " failed: ", cudaGetErrorString(status), " (",
                                         cudaGetErrorName(status), ")"));
  }
}

int current_device_sm_count() {
  int device = 0;
  cudaGetDevice(&device);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  check_launch("cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  return sms;
}

std::string kernel_image_problem() {
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, wgmma_image_probe_kernel);
  if (status == cudaSuccess) return {};
  (void)cudaGetLastError();
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  (void)cudaGetLastError();
  return detail::concat("device ", device, " (", prop.name, ", compute capability ", prop.major, ".", prop.minor,
                        ") cannot run this build's CUDA kernels (", cudaGetErrorString(status),
                        "): rebuild with CMAKE_CUDA_ARCHITECTURES covering it (the kernels need sm_80+; "
                        "the default build is sm_90a).");
}

namespace {
// A property of the current device, queried once per device (query(device) -> bool); false when
// there is no current device. known / value: one bit a device (device & 63).
template <class Query>
bool per_device(std::atomic<uint64_t>& known, std::atomic<uint64_t>& value, Query query) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((known.load() & bit) == 0) {
    if (query(device)) value.fetch_or(bit);
    known.fetch_or(bit);
  }
  return (value.load() & bit) != 0;
}
}  // namespace

bool wgmma_kernels_available() {
  static std::atomic<uint64_t> known{0}, available{0};
  return per_device(known, available, [](int) {
    cudaFuncAttributes attributes{};
    const bool ok = cudaFuncGetAttributes(&attributes, wgmma_image_probe_kernel) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    return ok && attributes.sharedSizeBytes == 0;
  });
}

bool programmatic_launch_supported() {
  static std::atomic<uint64_t> known{0}, supported{0};
  return per_device(known, supported, [](int device) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    return major >= 9;
  });
}

}  // namespace pagedattn::cuda
