// CUDA_MLA decode, Hopper wgmma kernel for the compute-bound head counts (documented in
// mla_decode_wgmma.cu). Same plan, parameters and partial format as mla_decode.h's kernel;
// mla_decode.cu's launch_decode dispatches here when wgmma_decode_covers() says so.
#pragma once

#include "mla_decode.h"  // relative: also included from tests/gpu
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla_decode {

// True for num_heads >= 64, a 16-bit cache of the activation dtype, and a device that loads the
// kernel's sm_90a image — unless env PAGEDATTN_MLA_DECODE_KERNEL=mma sends every head count to
// the mma.sync kernel (A/B runs; gpu-check's racecheck step, see docs/perf/mla.md). Any value
// other than auto / mma is an Error naming the variable.
bool wgmma_decode_covers(int num_heads, DType activation, DType cache_dtype);

// Enqueues the decode kernel (num_parts * ceil(num_heads / 64) CTAs); the caller enqueues the
// combine kernel when the plan splits requests. Requires wgmma_decode_covers().
void launch_decode_wgmma(const DecodeParams& params, DType activation, int num_parts, void* stream);

int wgmma_decode_smem_bytes();

}  // namespace pagedattn::cuda::mla_decode
