// Which variant of the paged attention kernel a launch uses (host side; no CUDA types, so the
// header is included by device code, tests and benchmarks too).
//
// The kernel (paged_attention_kernel.cuh) is compiled in variants that differ in the prefill path
// they carry; every variant computes every plan (attention_plan.h) exactly, the variants differ
// only in speed and resources:
//   kVariantMma        decode path + the mma.sync prefill path (every head size, fp8 caches);
//   kVariantWgmma      decode path + the Hopper wgmma prefill path (paged_prefill_wgmma.cuh):
//                      16-bit caches, head sizes 64, 128 and 256, sm_90a only.
//
// PAGEDATTN_CUDA_PREFILL_KERNEL (read once): "auto" (default: wgmma where it exists and the
// device loads the sm_90a image, mma.sync elsewhere) or "mma" (the mma.sync prefill path for
// every launch). Any other value is an Error naming the variable.
#pragma once

#include <optional>

namespace pagedattn::cuda {

enum KernelVariant : int {
  kVariantMma = 0,
  kVariantWgmma = 1,
};

enum class AttentionKernelChoice { automatic, mma };

// The override when set, else PAGEDATTN_CUDA_PREFILL_KERNEL (parsed at the first call).
AttentionKernelChoice attention_kernel_choice();

// A PAGEDATTN_CUDA_PREFILL_KERNEL value (nullptr or "" = unset = auto); Error naming the variable
// for anything but auto / mma.
AttentionKernelChoice parse_prefill_kernel_choice(const char* value);

// Tests and benchmarks: force a choice for the launches and builders made after the call
// (std::nullopt = back to the environment). A builder and the launches on its plans should see
// the same choice; when they do not, the results are still exact (see above).
void set_attention_kernel_choice(std::optional<AttentionKernelChoice> choice);

// Whether the current device loads the sm_90a (wgmma) image of this build's kernels.
bool wgmma_kernels_available();

// Name of a variant ("mma", "wgmma").
const char* kernel_variant_name(int variant);

}  // namespace pagedattn::cuda
