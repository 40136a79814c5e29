// The calling thread's CUDA stream (shared by the CUDA and no-CUDA builds; it is only a pointer).
#include "pagedattn/device.h"

namespace pagedattn {

namespace {
thread_local void* g_current_stream = nullptr;  // nullptr = the legacy default stream
}  // namespace

void* current_cuda_stream() { return g_current_stream; }
void set_current_cuda_stream(void* stream) { g_current_stream = stream; }

}  // namespace pagedattn
