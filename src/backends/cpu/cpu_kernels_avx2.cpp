// AVX2 kernels of the CPU backend (compiled with -mavx2 -mfma -mf16c by module.cmake; run only
// when CPUID reports them). Every activation dtype uses the f32 tile algorithm of
// cpu_attention_tile.h (no bf16 dot product on AVX2): K pack [D][64] f32 (8x8 transposes),
// V pack [64][Dv] f32; Q·Kᵀ microkernel 6 rows x 16 keys (12 ymm accumulators), P·V 6 rows x
// 16 dims. Floor per 64-key tile and row: 2*64*(D+Dv) FLOP at 2 FMA (8 lanes)/cycle/core.
// Head-fused decode items over a bf16 / f16 / fp8 cache run the direct decode kernel instead
// (cpu_decode_avx2.h: dot products on the cache rows in place, no packing) where it applies.
// Precision: exact conversions to f32, f32 FMA accumulation, one rounding at the output.
#if defined(__x86_64__) || defined(_M_X64)

#include "backends/cpu/cpu_decode_avx2.h"

namespace pagedattn::cpu {
namespace {

void run_item_avx2(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  if (direct_decode_avx2_applies(args, item)) {
    run_direct_decode<DirectAvx2>(args, item, scratch);
    count_direct_decode_item();
  } else {
    run_item_impl<F32Ops<Vec256>>(args, item, scratch);
  }
}

void merge_avx2(const AttentionArgs& args, const MergeTask& task) { merge_impl<Vec256>(args, task); }

const KernelTable kAvx2Table = {Isa::avx2, "avx2", false, &run_item_avx2, &merge_avx2};

}  // namespace

const KernelTable* avx2_kernel_table() { return &kAvx2Table; }

}  // namespace pagedattn::cpu

#else  // not x86-64

#include "backends/cpu/cpu_kernels.h"

namespace pagedattn::cpu {
const KernelTable* avx2_kernel_table() { return nullptr; }
}  // namespace pagedattn::cpu

#endif
