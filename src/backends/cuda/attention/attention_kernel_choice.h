// Which variant of the paged attention kernel a launch uses (host side; no CUDA types, so the
// header is included by device code, tests and benchmarks too).
//
// The kernel (paged_attention_kernel.cuh) is compiled in variants that differ in the prefill path
// they carry; every variant computes every plan (attention_plan.h) exactly, the variants differ
// only in speed and resources:
//   kVariantMma        decode path + the mma.sync prefill path (every head size, fp8 caches);
//   kVariantWgmma      decode path + the Hopper wgmma prefill path (paged_prefill_wgmma.cuh):
//                      16-bit caches, head sizes 64, 128 and 256, sm_90a only;
//   kVariantWs         the warp-specialized kernel (paged_attention_ws.cuh: a producer warpgroup
//                      and two wgmma consumer warpgroups, one code path for every item): 16-bit
//                      caches, head sizes 64 and 128 (equal head_size_v), sm_90a only.
//
// PAGEDATTN_CUDA_PREFILL_KERNEL (read once): "auto" (default: on a device that loads the sm_90a
// image, the warp-specialized kernel for head sizes 64 and 128 and wgmma for 256; mma.sync
// elsewhere), "mma" (the mma.sync prefill path for every launch), "wgmma" (the one-warpgroup
// wgmma path where it exists) or "ws" (the warp-specialized kernel where it exists, head sizes 64
// and 128; the same as auto today). Any other value is an Error naming the variable. (Head size
// 64 on ws vs wgmma, same run: prefill 4x4k 304 vs 215 TFLOP/s, mixed batch 0.127 vs 0.175 ms;
// docs/perf/cuda.md.)
#pragma once

#include <optional>

namespace pagedattn::cuda {

enum KernelVariant : int {
  kVariantMma = 0,
  kVariantWgmma = 1,
  kVariantWs = 2,
};

enum class AttentionKernelChoice { automatic, mma, ws, wgmma };

// The override when set, else PAGEDATTN_CUDA_PREFILL_KERNEL (parsed at the first call).
AttentionKernelChoice attention_kernel_choice();

// A PAGEDATTN_CUDA_PREFILL_KERNEL value (nullptr or "" = unset = auto); Error naming the variable
// for anything but auto / mma.
AttentionKernelChoice parse_prefill_kernel_choice(const char* value);

// Tests and benchmarks: force a choice for the launches and builders made after the call
// (std::nullopt = back to the environment). A builder and the launches on its plans should see
// the same choice; when they do not, the results are still exact (see above).
void set_attention_kernel_choice(std::optional<AttentionKernelChoice> choice);

// Decode-only kernel (paged_decode_kernel.cuh, head sizes <= 128): the builder plans a batch
// whose items are all decode-path items (every request's query_len * group <= 16; no cascade) for
// it. PAGEDATTN_CUDA_DECODE_KERNEL (read once): "auto" (default: the decode-only kernel unless the
// batch is so small that its best split leaves chunks under 8 tiles, which the unified kernel's
// deeper pipeline runs faster, or, where the head size's launches run the warp-specialized kernel,
// the batch has over 32 64-key tiles per SM: that kernel streams those faster), "decode" (the decode-only kernel for every decode batch) or
// "unified" (every plan runs the paged attention kernel). Any other value is an Error naming the
// variable. The choice is read when a plan is built; the plan records which kernel runs it.
enum class DecodeKernelChoice { automatic, unified, decode };
DecodeKernelChoice decode_kernel_choice();
DecodeKernelChoice parse_decode_kernel_choice(const char* value);
// Tests and benchmarks: force a choice for the plans built after the call (nullopt = environment).
void set_decode_kernel_choice(std::optional<DecodeKernelChoice> choice);

// Name of a variant ("mma", "wgmma", "ws").
const char* kernel_variant_name(int variant);

}  // namespace pagedattn::cuda
