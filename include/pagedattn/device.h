// Device queries and the CUDA stream pagedattn launches on. No CUDA types: a stream is passed
// as an opaque pointer (a cudaStream_t).
#pragma once

namespace pagedattn {

// Number of CUDA devices visible (0 when built without CUDA or when no driver/device).
int cuda_device_count();
bool built_with_cuda();
// The calling thread's current CUDA device (cudaGetDevice; 0 without CUDA or without a device). New
// device tensors are allocated there unless given a device index: a rank of a multi-GPU group
// calls cudaSetDevice once, and its layers, builders and caches live on its GPU.
int current_cuda_device();
// Makes CUDA device `index` current for the calling thread (cudaSetDevice): a rank's thread calls
// it first. Error naming "device" when there is no such device (a build without CUDA has none).
void set_current_cuda_device(int index);
// Stream used by every kernel and copy pagedattn issues from the calling thread
// (thread-local; nullptr = the legacy default stream). Capture CUDA graphs on a stream you set.
void* current_cuda_stream();
void set_current_cuda_stream(void* stream);
// Blocks until the current stream is idle (no-op without CUDA).
void synchronize_cuda();

}  // namespace pagedattn
