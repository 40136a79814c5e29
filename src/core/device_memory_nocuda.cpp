// Device queries and device memory for a build without CUDA: no devices, and every request for
// device memory is an Error (host code paths never get here).
#include "core/device_memory.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn {

int cuda_device_count() { return 0; }
bool built_with_cuda() { return false; }
int current_cuda_device() { return 0; }
void set_current_cuda_device(int index) {
  throw Error("device", detail::concat("device: set_current_cuda_device(", index, "): pagedattn was built without CUDA"));
}
void synchronize_cuda() {}

namespace detail {

namespace {
[[noreturn]] void throw_no_cuda() {
  throw Error("device", "device: pagedattn was built without CUDA");
}
}  // namespace

void* device_malloc(size_t bytes, int /*device_index*/) {
  if (bytes == 0) return nullptr;
  throw_no_cuda();
}
void device_free(void* ptr) noexcept { (void)ptr; }  // nothing can have been allocated
void memcpy_h2d(void*, const void*, size_t) { throw_no_cuda(); }
void memcpy_d2h(void*, const void*, size_t) { throw_no_cuda(); }
void memcpy_d2d(void*, const void*, size_t) { throw_no_cuda(); }
void memcpy_d2d_2d(void*, size_t, const void*, size_t, size_t, size_t) { throw_no_cuda(); }
void device_memset(void*, uint8_t, size_t) { throw_no_cuda(); }

}  // namespace detail
}  // namespace pagedattn
