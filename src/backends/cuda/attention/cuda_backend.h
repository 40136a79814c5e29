// The CUDA attention backend (Hopper, sm_90a): paged prefill + decode in one launch, split-KV,
// fp8 KV, CUDA graphs. Registered first (highest priority) in backends/registry.cpp under
// PAGEDATTN_HAS_CUDA.
#pragma once

#include "pagedattn/backend.h"

namespace pagedattn {

// The one CUDA backend object (static lifetime). name() == "CUDA".
const AttentionBackend& cuda_backend();

}  // namespace pagedattn
