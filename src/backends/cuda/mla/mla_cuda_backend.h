// The CUDA_MLA backend (DeepSeek MLA on Hopper): latent MQA decode kernel with balanced split-KV
// (mla_decode.cu) around the shared MLA run (src/backends/mla/mla_common.h), and the "CUDA" MLA
// prefill backend (mla_prefill.cu). Registered right after the CUDA backend in
// backends/registry.cpp, and first in backends/mla/prefill_registry.cpp, under PAGEDATTN_HAS_CUDA.
#pragma once

#include "pagedattn/backend.h"
#include "pagedattn/mla.h"

namespace pagedattn {

// The one CUDA_MLA backend object (static lifetime). name() == "CUDA_MLA".
const AttentionBackend& cuda_mla_backend();

// The CUDA MLA prefill backend class (name "CUDA"): f16/bf16, qk_head_dim 192 / v_head_dim 128.
const MLAPrefillBackendClass& cuda_mla_prefill_backend();

}  // namespace pagedattn
