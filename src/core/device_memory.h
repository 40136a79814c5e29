// Internal device-memory primitives used by Tensor (and by backends that need raw copies).
// Two implementations: device_memory.cu (CUDA runtime; every call checked, failures throw
// pagedattn::Error carrying cudaGetErrorString) and device_memory_nocuda.cpp (every allocation
// or copy throws "device: pagedattn was built without CUDA").
// All copies and memsets are issued on current_cuda_stream(). Host<->device copies return only
// when the copy is complete (the host buffer may be reused or read at once); device->device
// copies and memsets are asynchronous on the stream.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedattn::detail {

// Allocates `bytes` on CUDA device `device_index` (-1 = the calling thread's current device).
// Returns nullptr only for bytes == 0.
void* device_malloc(size_t bytes, int device_index = -1);
// Frees memory from device_malloc (nullptr is a no-op). Never throws (it runs in destructors):
// a failure is reported on stderr.
void device_free(void* ptr) noexcept;
void memcpy_h2d(void* dst, const void* src, size_t bytes);
void memcpy_d2h(void* dst, const void* src, size_t bytes);
void memcpy_d2d(void* dst, const void* src, size_t bytes);
// `rows` rows of `row_bytes` each, from src (rows src_pitch bytes apart) to dst (dst_pitch apart).
void memcpy_d2d_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows);
void device_memset(void* ptr, uint8_t byte, size_t bytes);

}  // namespace pagedattn::detail
