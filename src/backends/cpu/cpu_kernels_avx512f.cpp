// AVX-512F kernels of the CPU backend, for CPUs with AVX-512 F/BW/DQ/VL but without AVX512_BF16
// (Skylake-SP, Cascade Lake, Ice Lake servers): compiled with -mavx512f/bw/dq/vl -mavx2 -mfma
// -mf16c by module.cmake (no BF16 flag, so no BF16 instruction can be emitted); run only when
// CPUID reports them (cpu_dispatch.cpp).
//   Every activation dtype uses the f32 tile algorithm of cpu_attention_tile.h in 16 lanes
//   (F32Ops<Vec512>: K pack [D][64] f32, 16x16 transposes; Q·Kᵀ and P·V microkernels of 6 rows x
//   64 keys / dims, 24 zmm accumulators). Floor per 64-key tile and row: 2*64*(D+Dv) FLOP at
//   2 FMA (16 lanes)/cycle/core, twice the avx2 path's.
//   Head-fused decode items run the direct decode kernel in 16-lane f32 FMA
//   (cpu_decode_avx512_fma.h) where it applies, else (head sizes not a multiple of 32) the AVX2
//   one (cpu_decode_avx2.h).
// Precision: exact conversions to f32, f32 FMA accumulation, one rounding at the output.
#if defined(__x86_64__) || defined(_M_X64)

#include "backends/cpu/cpu_avx512f_ops.h"
#include "backends/cpu/cpu_decode_avx512_fma.h"

namespace pagedattn::cpu {
namespace {

void run_item_avx512f(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  if (direct_decode_fma_applies(args, item)) {
    run_direct_decode<DirectAvx512Fma>(args, item, scratch);
    count_direct_decode_item();
  } else if (direct_decode_avx2_applies(args, item)) {  // head sizes not a multiple of 32
    run_direct_decode<DirectAvx2>(args, item, scratch);
    count_direct_decode_item();
  } else {
    run_item_impl<F32Ops<Vec512>>(args, item, scratch);
  }
}

void merge_avx512f(const AttentionArgs& args, const MergeTask& task) {
  merge_impl<Vec512>(args, task);
}

const KernelTable kAvx512fTable = {Isa::avx512f, "avx512f", false, &run_item_avx512f,
                                   &merge_avx512f};

}  // namespace

const KernelTable* avx512f_kernel_table() { return &kAvx512fTable; }

}  // namespace pagedattn::cpu

#else  // not x86-64

#include "backends/cpu/cpu_kernels.h"

namespace pagedattn::cpu {
const KernelTable* avx512f_kernel_table() { return nullptr; }
}  // namespace pagedattn::cpu

#endif
