// Device queries and device memory through the CUDA runtime. Every CUDA call is checked; a
// failure throws pagedattn::Error with the call and cudaGetErrorString (device_free, which runs
// in destructors, reports on stderr instead).
#include <cuda_runtime.h>

#include <cstdio>

#include "core/device_memory.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn {

namespace {

void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) [[unlikely]] {
    throw Error("device", detail::concat("device: ", call, " failed: ", cudaGetErrorString(status),
                                         " (", cudaGetErrorName(status), ")"));
  }
}

#define PAGEDATTN_CUDA_CALL(expr) ::pagedattn::check_cuda((expr), #expr)

cudaStream_t stream() { return static_cast<cudaStream_t>(current_cuda_stream()); }

// Makes `device_index` current for the scope (-1 = keep the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device_index) {
    if (device_index < 0) return;
    PAGEDATTN_CUDA_CALL(cudaGetDevice(&previous_));
    if (previous_ != device_index) {
      PAGEDATTN_CUDA_CALL(cudaSetDevice(device_index));
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace

int cuda_device_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error: no driver or no device
    return 0;
  }
  return count;
}

bool built_with_cuda() { return true; }

int current_cuda_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: the index is not used for an allocation
    return 0;
  }
  return device;
}

void set_current_cuda_device(int index) {
  const int count = cuda_device_count();
  PAGEDATTN_CHECK(index >= 0 && index < count, "device", "device: set_current_cuda_device(", index, "): ",
                  count, " CUDA devices are visible");
  PAGEDATTN_CUDA_CALL(cudaSetDevice(index));
}

void synchronize_cuda() {
  if (cuda_device_count() == 0) return;
  PAGEDATTN_CUDA_CALL(cudaStreamSynchronize(stream()));
}

namespace detail {

void* device_malloc(size_t bytes, int device_index) {
  if (bytes == 0) return nullptr;
  PAGEDATTN_CHECK(cuda_device_count() > 0, "device",
                  "device: no CUDA device is available (cudaGetDeviceCount found none)");
  DeviceGuard guard(device_index);
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("device", concat("device: cudaMalloc of ", bytes,
                                 " bytes failed: ", cudaGetErrorString(status)));
  }
  return ptr;
}

void device_free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  const cudaError_t status = cudaFree(ptr);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "pagedattn: cudaFree failed: %s\n", cudaGetErrorString(status));
  }
}

void memcpy_h2d(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  PAGEDATTN_CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
  PAGEDATTN_CUDA_CALL(cudaStreamSynchronize(stream()));
}

void memcpy_d2h(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  PAGEDATTN_CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  PAGEDATTN_CUDA_CALL(cudaStreamSynchronize(stream()));
}

void memcpy_d2d(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  PAGEDATTN_CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
}

void memcpy_d2d_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows) {
  if (row_bytes == 0 || rows == 0) return;
  PAGEDATTN_CUDA_CALL(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToDevice, stream()));
}

void device_memset(void* ptr, uint8_t byte, size_t bytes) {
  if (bytes == 0) return;
  PAGEDATTN_CUDA_CALL(cudaMemsetAsync(ptr, byte, bytes, stream()));
}

}  // namespace detail
}  // namespace pagedattn
