// AVX-512 kernels of the CPU backend (compiled with -mavx512f/bw/dq/vl/bf16 -mfma -mf16c by
// module.cmake; run only when CPUID reports all of them, see cpu_dispatch.cpp).
//
// Two compute modes over the tile algorithm of cpu_attention_tile.h (operations in
// cpu_avx512_ops.h, shared with the AMX kernels):
//   Bf16Ops  (bf16 activations, fp8 caches): Q·Kᵀ and P·V with vdpbf16ps, f32 accumulation,
//            6 rows x 64 keys (or dims) register blocks.
//            Floor per 64-key tile and row: 2*64*(D+Dv) FLOP at 2 vdpbf16ps/cycle/core.
//   F32Ops<Vec512> (f32 / f16 activations): the same tiling with f32 FMA (6 x 64 per block).
// Head-fused decode items run a direct decode kernel instead (dot products on the cache rows in
// place, no packing) where one applies: bf16 dot products over a bf16 or fp8 cache
// (cpu_decode_avx512.h), unless this CPU runs f32 FMA faster (AttentionArgs::direct_fma); f32 FMA
// (cpu_decode_avx512_fma.h) for the other items it takes (f16 caches, f32 / f16 activations).
// Precision: see cpu_attention_tile.h; bf16 rounding of f32/f16 operands uses vcvtne2ps2bf16
// (round to nearest even; f32 denormals flush to zero, far below every tolerance).
#if defined(__x86_64__) || defined(_M_X64)

#include "backends/cpu/cpu_decode_avx512.h"
#include "backends/cpu/cpu_decode_avx512_fma.h"

namespace pagedattn::cpu {
namespace {

void run_item_avx512(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  if (!args.direct_fma && direct_decode_applies(args, item)) {
    run_direct_decode<DirectAvx512>(args, item, scratch);
    count_direct_decode_item();
  } else if (direct_decode_fma_applies(args, item)) {
    run_direct_decode<DirectAvx512Fma>(args, item, scratch);
    count_direct_decode_item();
  } else if (args.precision == Precision::bf16_dot) {
    run_item_impl<Bf16Ops>(args, item, scratch);
  } else {
    run_item_impl<F32Ops<Vec512>>(args, item, scratch);
  }
}

void merge_avx512(const AttentionArgs& args, const MergeTask& task) { merge_impl<Vec512>(args, task); }

const KernelTable kAvx512Table = {Isa::avx512, "avx512", true, &run_item_avx512, &merge_avx512};

}  // namespace

const KernelTable* avx512_kernel_table() { return &kAvx512Table; }

}  // namespace pagedattn::cpu

#else  // not x86-64

#include "backends/cpu/cpu_kernels.h"

namespace pagedattn::cpu {
const KernelTable* avx512_kernel_table() { return nullptr; }
}  // namespace pagedattn::cpu

#endif
