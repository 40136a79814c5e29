// The one switch that overrides the CUDA backends' kernel choices, for tests and benchmarks:
// environment variable PAGEDATTN_CUDA_KERNEL (read once), or set_kernel_override (same parser).
// Pure C++ (no CUDA types): compiled in every build, so its grammar is tested without a GPU.
//
// Grammar (empty or unset: every choice automatic):
//   PAGEDATTN_CUDA_KERNEL = [ENTRY {"," ENTRY}]
//   ENTRY = "prefill=" (auto | mma | wgmma | ws)   the paged attention kernel of non-decode plans
//         | "decode="  (auto | decode | unified)   whether batches of decodes take the decode-only kernel
//         | "mla="     (auto | mma)                the CUDA_MLA decode kernel
// e.g. PAGEDATTN_CUDA_KERNEL=prefill=mma,decode=unified. A key may appear once; anything else is
// an Error naming the variable and listing this grammar.
//   prefill: auto = on sm_90a the warp-specialized kernel at head sizes 64, 128 and 256 with a
//            16-bit cache and at 128 and 256 with an fp8 (e4m3, e5m2) cache (head_size == head_size_v,
//            K/V strides under 4 GiB), else the one-warpgroup wgmma path where it exists (16-bit,
//            D = 64 / 128 / 256), mma.sync elsewhere (kernel_selection.h). mma = the mma.sync
//            prefill path everywhere; wgmma = the one-warpgroup wgmma path where it exists,
//            mma.sync elsewhere; ws = the same as auto.
//   decode:  auto = the decode-only kernel for batches of decodes at head sizes <= 128, but not the
//            smallest (chunks under 8 tiles) nor, where the warp-specialized kernel runs with a
//            16-bit cache, the large ones (over 32 64-key tiles per SM); decode = the decode-only
//            kernel for every batch of decodes (and, with an fp8 cache at head size 64, kv-head
//            pairs for every batch, not only the large ones: planner.h); unified = never.
//   mla:     auto = the wgmma kernel for requests of more than 16 rows (query tokens x heads) with a
//            16-bit cache on sm_90a, mma.sync elsewhere (mla/mla_decode.h); mma = the mma.sync
//            kernel for every shape.
// The builders read the override once, at construction, and store the kernel they chose in each
// plan (kernel_selection.h, mla/mla_decode.h); launches run the plan's kernel.
#pragma once

#include <optional>
#include <string_view>

namespace pagedattn::cuda {

inline constexpr const char* kKernelOverrideVariable = "PAGEDATTN_CUDA_KERNEL";

enum class PrefillKernelChoice { automatic, mma, wgmma, ws };
enum class DecodeKernelChoice { automatic, decode, unified };
enum class MlaDecodeKernelChoice { automatic, mma };

struct KernelOverride {
  PrefillKernelChoice prefill = PrefillKernelChoice::automatic;
  DecodeKernelChoice decode = DecodeKernelChoice::automatic;
  MlaDecodeKernelChoice mla = MlaDecodeKernelChoice::automatic;
};

// A PAGEDATTN_CUDA_KERNEL value ("" = every choice automatic); Error naming the variable for
// anything outside the grammar.
KernelOverride parse_kernel_override(std::string_view spec);

// The override set by set_kernel_override, else the environment's (read and parsed at the first
// call; an invalid value throws at every call).
KernelOverride kernel_override();

// Tests and benchmarks: the override for the builders made after the call (std::nullopt = back to
// the environment's).
void set_kernel_override(std::optional<KernelOverride> choice);

}  // namespace pagedattn::cuda
