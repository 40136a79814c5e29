// device_capability(Device::cuda) for the MLA prefill selector: the compute capability of the
// calling thread's current CUDA device (cudaDevAttrComputeCapabilityMajor / Minor).
#include <cuda_runtime.h>

#include <string>

#include "pagedattn/error.h"
#include "pagedattn/mla.h"

namespace pagedattn::mla {

DeviceCapability cuda_device_capability() {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  PAGEDATTN_CHECK(err == cudaSuccess, "device", "device_capability: cudaGetDevice failed: ",
                  cudaGetErrorString(err));
  DeviceCapability cap;
  err = cudaDeviceGetAttribute(&cap.major, cudaDevAttrComputeCapabilityMajor, device);
  PAGEDATTN_CHECK(err == cudaSuccess, "device", "device_capability: cudaDeviceGetAttribute failed: ",
                  cudaGetErrorString(err));
  err = cudaDeviceGetAttribute(&cap.minor, cudaDevAttrComputeCapabilityMinor, device);
  PAGEDATTN_CHECK(err == cudaSuccess, "device", "device_capability: cudaDeviceGetAttribute failed: ",
                  cudaGetErrorString(err));
  return cap;
}

}  // namespace pagedattn::mla
