// The CPU MLA backend ("CPU_MLA"): DeepSeek-style multi-head latent attention on the CPU. Decode
// runs the latent MQA (one KV head of L + R, values = its first L elements, all H query heads in
// one group) on the CPU backend's tile kernels; prefill goes through MLACommonImpl and the
// selected MLA prefill backend (the CPU one: cpu_mla_prefill.h). Registered right after CPU in
// backends/registry.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "pagedattn/backend.h"
#include "pagedattn/mla.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

// The one CPU MLA backend object (static lifetime). name() == "CPU_MLA".
const AttentionBackend& cpu_mla_backend();

namespace cpu {

// Decode memory of one builder: the sizes, fixed at construction, and a pool of run buffers
// (per-thread tile scratch for head size L + R, value size L and H rows, split-KV partial rows)
// from which each latent decode leases one set (cpu_internal.h, run_buffer_pool.h).
struct CpuMlaDecodeWorkspace {
  int num_threads = 1;
  int num_heads = 0;
  // Tokens of a decode request an item takes together (its rows share each key tile): a
  // speculative decode's tokens, up to kMaxItemRows rows; 1 without speculative decoding.
  int tokens_per_item = 1;
  int max_rows = 0;                   // rows of the largest item = num_heads * tokens_per_item
  int head_size = 0, head_size_v = 0; // L + R, L
  // false (batch-invariant builders): every decode token is one item over all its keys, never
  // split, whatever the batch and the thread count; no partial rows are allocated.
  bool split_kv = true;
  size_t scratch_stride = 0;          // bytes per thread, multiple of 64
  int64_t partial_capacity_rows = 0;
  int64_t partial_o_stride = 0;       // floats per partial row (L rounded up to 16)
  host::RunBufferPool<CpuRunBuffers> buffers;
  size_t bytes() const { return buffers.bytes(); }
};

// The CPU decode plan, computed in build() (decode requests are requests [0, num_decodes)):
// one work item per (decode request, run of up to tokens_per_item of its tokens, key split),
// largest first; split-KV when the decodes give
// fewer than kItemsPerThread items per thread, each split writing partial rows that a merge
// task combines by LSE.
struct CpuMlaMetadata final : MLAMetadata {
  std::vector<int32_t> decode_first_pos;        // (num_decodes,) seq_len - query_len
  // The decode rows of the step's block table, copied (the plan does not depend on the
  // caller's tensor): (num_decodes, decode_block_table_cols) row-major, the blocks in use.
  std::vector<int32_t> decode_block_table;
  int64_t decode_block_table_cols = 0;
  std::vector<WorkItem> items;
  std::vector<MergeTask> merges;
  int64_t partial_rows_used = 0;
  int block_size = 0;
  std::shared_ptr<CpuMlaDecodeWorkspace> cpu_workspace;
};

// The decode workspace of a builder (threads from resolve_num_threads(num_threads)); split_kv
// false for a batch-invariant builder; max_query_len: the most tokens a decode request has (the
// builder's reorder_batch_threshold()).
std::shared_ptr<CpuMlaDecodeWorkspace> make_mla_decode_workspace(int num_threads, int num_heads,
                                                                 const MLADimensions& dims,
                                                                 bool split_kv = true, int max_query_len = 1);

// The latent attention of a plan's decode tokens (forward_decode after its checks; also the
// benchmark's entry): q_latent (Td, H, L + R) in `activation`, kv_cache (num_blocks, block_size,
// L + R) with keys = rows, values = rows[:L] (fp8: x * k_scale), o_latent (Td, H, L), lse (H, Td)
// f32 or undefined. Arguments are NOT checked here. Allocates nothing unless another decode on
// the same workspace runs at the same time (it leases its own buffers).
void run_latent_decode(const CpuMlaMetadata& plan, const TensorView& q_latent,
                       const TensorView& kv_cache, DType activation, float scale, float k_scale,
                       const TensorView& o_latent, const TensorView& lse);

// The decode items and merges of `num_decodes` requests with the given query token ranges and
// key counts (exposed for tests): fills items / merges / partial_rows_used of `plan`.
// fast_build: one item per token run in batch order (no split-KV, no cost ordering). A workspace
// without split_kv: one item per token run, largest first.
void plan_mla_decode(CpuMlaMetadata& plan, const CpuMlaDecodeWorkspace& workspace,
                     bool fast_build = false);

}  // namespace cpu
}  // namespace pagedattn
