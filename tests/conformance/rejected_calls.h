// Rejected calls leave the KV cache byte-identical, on every backend: a block table naming a
// block the cache lacks (>= num_blocks, -1, 2^31 - 1), a plan built for a larger cache than the
// one passed, slots past the cache, a bad output_scale (0, -1, NaN, inf: host backends; CUDA reads
// the scale on the device, and an invalid one gives all-NaN output instead). Each case runs the
// layer's forward (cache write + attention) and compares every byte of the cache before and
// after; a valid call on the same data is the control (it must run and change the cache). MLA
// layers also check the fp8-output arguments (output_scale on a backend without fused fp8 output,
// a wrong output dtype or scale tensor, invalid scale values) and that a valid fp8 forward writes
// every output element.
// Shared by the CPU suites (CPU, REFERENCE, CPU_MLA, REFERENCE_MLA) and tests/gpu (CUDA,
// CUDA_MLA).
#pragma once

#include <string>

#include "pagedattn/tensor.h"

namespace pagedattn::testing {

// Standard layers (Attention) forced onto `backend` on `device`.
void expect_rejected_forwards_leave_cache_untouched(const std::string& backend, Device device);

// MLA layers (MLAAttention) forced onto `backend` on `device`.
void expect_rejected_mla_forwards_leave_cache_untouched(const std::string& backend, Device device);

}  // namespace pagedattn::testing
