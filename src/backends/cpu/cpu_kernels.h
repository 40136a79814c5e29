// Internal interface between the CPU backend's host side (plan, impl, OpenMP driver) and its
// ISA-specific kernels (cpu_kernels_{scalar,avx2,avx512f,avx512,amx}.cpp).
//
// Everything here is plain data (no std containers, no inline functions with external linkage):
// the ISA translation units are compiled with different -m flags, and any inline function they
// shared with the rest of the library could be emitted with AVX-512 instructions and picked by
// the linker for a generic caller. The kernels only see these structs.
//
// Vocabulary (one forward call):
//   row        one (query token, query head) pair of a work item; inside an item the rows are
//              ordered token-major: row = (token - item.tok_begin) * group_size + head_in_group,
//              so every row of one token shares its causal/window mask.
//   tile       kKeyTile consecutive keys of one request, packed in 16-key chunks (one page
//              lookup per chunk when the block size is a multiple of 16, one per key otherwise).
//   work item  (kv head, token range, key range): the rows of all query heads of one KV head for
//              a token range, attended over a key range with an online softmax. Items either
//              write final output rows or, for split-KV, partial rows that a merge task combines.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedattn/dtype.h"

namespace pagedattn::cpu {

// Keys per tile (the K/V pack granularity). Multiple of 16 (page chunks) and of 2 (bf16 pairs).
inline constexpr int kKeyTile = 64;
// Rows per work item (a q tile holds max(1, kMaxItemRows / group_size) tokens).
inline constexpr int kMaxItemRows = 128;
// Largest head size (keys and values) the standard CPU backend accepts; multiples of 16.
inline constexpr int kMaxHeadSize = 256;
// Largest head size the kernels themselves handle (scratch, zero rows, merge rows): the MLA
// latent row of 576 = kv_lora_rank 512 + qk_rope_head_dim 64 (CPU_MLA decode). The standard
// backend stays at kMaxHeadSize (its conformance grid covers up to 256).
inline constexpr int kMaxKernelHeadSize = 576;
inline constexpr int kHeadSizeMultiple = 16;

// avx512f = AVX-512 F/BW/DQ/VL without AVX512_BF16: the f32 tile kernels in 16 lanes.
// amx = the avx512 kernels with Q·Kᵀ and P·V of bf16 operands on AMX-BF16 tiles.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3, avx512f = 4 };

// How Q·Kᵀ and P·V are computed.
//   f32       operands converted to f32, f32 FMA (every ISA; used for f32/f16 activations).
//   bf16_dot  operands as bf16 pairs, vdpbf16ps with f32 accumulation (AVX-512 BF16 only; used
//             for bf16 activations and fp8 caches, whose values are exact in bf16).
enum class Precision : int { f32 = 0, bf16_dot = 1 };

// Where a work item's keys and values come from.
//   paged:    element (block b, offset o, kv head g, dim d) at
//             base + b*block_stride + o*token_stride + g*head_stride + d (d contiguous), with
//             block b = block_table[req * block_table_stride + key / block_size].
//   no cache: (token t, kv head g, dim d) at base + t*token_stride + g*head_stride + d, the key
//             of request r at position j being token query_start_loc[r] + j.
struct KvSource {
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t k_block_stride = 0, k_token_stride = 0, k_head_stride = 0;
  int64_t v_block_stride = 0, v_token_stride = 0, v_head_stride = 0;
  DType dtype = DType::bf16;
  bool paged = true;
  const int32_t* block_table = nullptr;  // (num_reqs, block_table_stride) i32
  int64_t block_table_stride = 0;
  int block_size = 16;
  // No cache only: the key of request r at position j is token key_start_loc[r] + j instead
  // (MLA prefill context chunks, whose keys are laid out by the chunk's cu_seq_lens).
  const int32_t* key_start_loc = nullptr;  // (num_reqs,) or nullptr = query_start_loc
};

// One unit of parallel work (see the file comment).
struct WorkItem {
  int32_t kv_head = 0;
  int32_t req_begin = 0, req_end = 0;  // requests whose tokens are in [tok_begin, tok_end)
  int32_t tok_begin = 0, tok_end = 0;  // global token rows (flat token axis)
  // Keys of the (single) request past the shared prefix: [kv_begin, kv_end); multi-request
  // (cascade) items use each request's whole range [prefix_len, seq_len).
  int32_t kv_begin = 0, kv_end = 0;
  // Cascade: keys [0, prefix_len) of req_begin's block table are read once for every row.
  int32_t prefix_len = 0;
  // -1: the item writes final output rows. Else the item is split `split_index` of a split-KV
  // group and writes partial rows at partial_base + split_index * rows + row.
  int32_t partial_base = -1;
  int32_t split_index = 0;
  // Head-fused items (single request, final output rows only): KV heads
  // [kv_head, kv_head + num_kv_heads). Row = head_block * rows_per_head + (token - tok_begin) * G
  // + head_in_group, rows_per_head = (tok_end - tok_begin) * G. Each key tile is read for all
  // those heads in turn, so the item streams whole pages (all heads of a token are contiguous in
  // the NHD cache) instead of one 256-byte row per token and page.
  int32_t num_kv_heads = 1;
  int64_t cost = 0;  // estimated multiply-adds, for ordering (largest first)
};

// Combines the partial rows of one split-KV group into final output rows.
struct MergeTask {
  int32_t kv_head = 0;
  int32_t tok_begin = 0, tok_end = 0;
  int32_t num_splits = 0;
  int32_t partial_base = 0;  // split s, row r at partial_base + s * rows + r
};

// Everything a forward call needs, as raw pointers and strides. Built by the impl (host side).
struct AttentionArgs {
  // query (T, Hq, D):(q_stride_t, q_stride_h, 1)
  const void* query = nullptr;
  int64_t q_stride_t = 0, q_stride_h = 0;
  DType q_dtype = DType::bf16;
  KvSource kv;
  // output (T, Hq, Dv):(o_stride_t, o_stride_h, 1); fp8_e4m3 output stores saturate(o / output_scale)
  void* output = nullptr;
  int64_t o_stride_t = 0, o_stride_h = 0;
  DType o_dtype = DType::bf16;
  float output_scale = 1.f;
  // output_lse (Hq, T):(lse_stride_h, lse_stride_t), natural log; nullptr = not requested
  float* lse = nullptr;
  int64_t lse_stride_h = 0, lse_stride_t = 0;

  int num_heads = 0, num_kv_heads = 0, group_size = 1, head_size = 0, head_size_v = 0;
  float scale = 1.f;                        // logits = scale * q.k
  float k_scale = 1.f, v_scale = 1.f;       // fp8 caches: read = fp8 * scale
  const float* k_scale_per_head = nullptr;  // (Hkv,) replaces k_scale when given
  const float* v_scale_per_head = nullptr;
  int64_t k_scale_per_head_stride = 1, v_scale_per_head_stride = 1;
  float soft_cap = 0.f;                     // 0 = off; else s <- cap * tanh(s / cap)
  const float* alibi_slopes = nullptr;      // (Hq,): s -= slope * |q_pos - k_pos|
  const float* sinks = nullptr;             // (Hq,): extra logit in the denominator only
  int window = 0;                           // 0 = off; W: keys in [p-(W-1), p] (+ p+(W-1) if symmetric)
  bool causal = true;
  bool window_symmetric = false;
  Precision precision = Precision::f32;
  // Head-fused decode items run the direct decode kernel where it applies (cpu_decode_direct.h);
  // false: always the tile kernel (PAGEDATTN_CPU_DECODE_KERNEL=tile, see decode_kernel()).
  bool direct_decode = true;
  // The avx512 and amx paths' direct kernel form: f32 FMA (cpu_decode_avx512_fma.h) rather than
  // bf16 dot products (cpu_decode_avx512.h). Resolved once per call from decode_kernel().
  bool direct_fma = false;

  // Batch (copied into the plan by the builder).
  const int32_t* query_start_loc = nullptr;  // (num_reqs + 1,)
  const int32_t* seq_lens = nullptr;         // (num_reqs,) keys of each request
  const int32_t* first_query_pos = nullptr;  // (num_reqs,) absolute position of each first query

  // Workspace (allocated by the builder): per-thread scratch and split-KV partials.
  int max_rows = kMaxItemRows;               // rows of the largest item (scratch is sized for it)
  char* scratch = nullptr;
  size_t scratch_stride = 0;                 // bytes between two threads' scratch
  float* partial_o = nullptr;                // (partial rows, partial_o_stride) unnormalised O
  float* partial_ml = nullptr;               // (partial rows, 2): running max, sum
  int64_t partial_o_stride = 0;
};

// Bytes of scratch one thread needs for head sizes D, Dv (every precision; 64-byte aligned parts).
size_t thread_scratch_bytes(int head_size, int head_size_v, int max_rows);

// The kernels of one ISA.
struct KernelTable {
  Isa isa = Isa::scalar;
  const char* name = "scalar";
  bool has_bf16_dot = false;
  // Runs one work item on the calling thread with its scratch (thread_scratch_bytes large).
  void (*run_item)(const AttentionArgs& args, const WorkItem& item, char* scratch) = nullptr;
  // Combines one split-KV group and writes its output rows (and LSE).
  void (*merge)(const AttentionArgs& args, const MergeTask& task) = nullptr;
};

// Tables compiled in this build (nullptr when the ISA is not compiled, e.g. non-x86 hosts).
const KernelTable* scalar_kernel_table();
const KernelTable* avx2_kernel_table();
const KernelTable* avx512f_kernel_table();
const KernelTable* avx512_kernel_table();
const KernelTable* amx_kernel_table();
// The AMX kernels with the tile unit emulated in plain C++ (tests: checks the AMX tiling on CPUs
// without AMX; needs AVX-512). Not chosen by dispatch; see set_kernel_table_override.
const KernelTable* amx_emulated_kernel_table();

// Dispatch, chosen once: env PAGEDATTN_CPU_ISA = scalar | avx2 | avx512f | avx512 | amx (read on
// first use; a value the CPU cannot run, or an unknown name, is an Error naming PAGEDATTN_CPU_ISA),
// else the best the CPU supports (CPUID; amx also needs the OS's tile state and Linux's
// arch_prctl(ARCH_REQ_XCOMP_PERM) permission, requested once on first use). set_isa_override
// (tests, benchmarks) replaces the choice; it throws Error when the CPU lacks the ISA.
const KernelTable& active_kernels();
bool isa_supported(Isa isa);
Isa best_isa();
const char* isa_name(Isa isa);
Isa parse_isa(const char* name, const char* argument);
void set_isa_override(Isa isa);
void clear_isa_override();
// Tests: runs `table` (one of the tables above) until cleared with nullptr; wins over
// set_isa_override. Throws Error when the CPU cannot run it (the emulated AMX table needs avx512).
void set_kernel_table_override(const KernelTable* table);

// Decode kernel choice, read once: env PAGEDATTN_CPU_DECODE_KERNEL = auto (the default: the direct
// decode kernel for the head-fused decode items it applies to, on the avx2, avx512f, avx512 and amx
// paths, cpu_decode_direct.h; on the avx512 and amx paths in the form this CPU runs faster,
// direct_decode_prefers_fma) | tile (the tile kernel for every item; for A/B measurements) | fma |
// dot (the direct kernel, in that form on the avx512 and amx paths: f32 FMA, cpu_decode_avx512_fma.h,
// or bf16 dot products, cpu_decode_avx512.h; other paths as auto; for tests and A/B measurements).
// An unknown value is an Error naming the variable. set_decode_kernel_override (tests, benchmarks)
// replaces the choice until cleared.
enum class DecodeKernel : int { automatic = 0, tile = 1, fma = 2, dot = 3 };
DecodeKernel decode_kernel();
DecodeKernel parse_decode_kernel(const char* name, const char* argument);
void set_decode_kernel_override(DecodeKernel kernel);
void clear_decode_kernel_override();
// Work items run by the direct decode kernel since the process started (tests check that a case
// took the path); count_direct_decode_item is called by the kernels once per item.
uint64_t direct_decode_items_run();
// The CPU's vendor (CPUID leaf 0, read once; other: unknown or not x86). The direct decode kernels
// take per-vendor plans from it: the AVX2 kernel's prefetches (avx2_prefetch_plan) and the AVX-512
// kernel form (direct_decode_prefers_fma). set_cpu_vendor_override (tests: the per-vendor plans of
// the direct decode kernels as on a CPU of that vendor) replaces it until cleared.
enum class CpuVendor : int { intel, amd, other };
CpuVendor cpu_vendor();
void set_cpu_vendor_override(CpuVendor vendor);
void clear_cpu_vendor_override();
// Whether this CPU runs the direct decode kernel's dot products faster as f32 FMA than with
// vdpbf16ps: Intel cores, where vdpbf16ps measured half the f32 FMA's FLOP rate (AMD Zen 5 runs it
// at 1.85x: docs/perf/cpu.md).
inline bool direct_decode_prefers_fma() { return cpu_vendor() == CpuVendor::intel; }
void count_direct_decode_item();

}  // namespace pagedattn::cpu
