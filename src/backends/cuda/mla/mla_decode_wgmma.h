// CUDA_MLA decode, Hopper wgmma kernel for the compute-bound head counts (documented in
// mla_decode_wgmma.cu). Same plan, parameters and partial format as mla_decode.h's kernel;
// mla_decode.cu's launch_decode dispatches here for plans of DecodeKernel::wgmma.
#pragma once

#include "backends/cuda/mla/mla_decode.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla_decode {

// Whether the current device loads the kernel's sm_90a image (probed once per device).
bool wgmma_decode_available();

// Enqueues the decode kernel (num_parts * ceil(tokens_per_request * num_heads / 64) CTAs); the caller enqueues the
// combine kernel when the plan splits requests. Requires wgmma_decode_available() and a cache of
// the activation dtype (fp8_format 0) or fp8 (1 e4m3, 2 e5m2: mla_decode.cu's launch maps the dtype).
void launch_decode_wgmma(const DecodeParams& params, DType activation, int fp8_format, int num_parts, void* stream);

}  // namespace pagedattn::cuda::mla_decode
