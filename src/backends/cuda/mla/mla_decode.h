// The CUDA_MLA decode plan and kernel entry points (host/device shared plain structs; no CUDA
// types). The kernel is documented in mla_decode.cu.
//
// Rows. A decode request of q tokens (q = 1, or up to 1 + k with k speculative tokens) is ONE
// request of the kernels: its rows are (token t, head h), row t * H + h of the plan's
// tokens_per_request * H rows (tokens_per_request = the batch's largest q; the rows of tokens past
// a request's q are idle), and row tiles of 16 or 64 rows are its CTAs' query rows. Every row
// keeps its own causal end: token t sees keys [0, seq_len - q + 1 + t). So the q tokens of a
// request read its latent rows once per row tile, not once per token.
//
// Plan (FlashMLA-style balanced split-KV): the decode requests' key ranges, in 64-key tiles, are
// laid end to end and cut into `num_parts` parts of about equal cost (tiles + a fixed per-segment
// overhead). A part is a list of SEGMENTS (request, [kv_start, kv_end)); one CTA per (part, row
// tile) runs its segments in order. A request cut by a part boundary has several segments: each
// writes an f32 partial (o, LSE) of its rows into slot partial_row of the partial buffers and the
// combine kernel merges the request's slots; an uncut request writes the output directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda/common/kernel_override.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla_decode {

inline constexpr int kLatent = 576;       // kv_lora_rank + qk_rope_head_dim: key width
inline constexpr int kValue = 512;        // kv_lora_rank: value width (first 512 of each row)
inline constexpr int kKeysPerTile = 64;

struct Segment {
  int32_t request;       // decode request (index into Plan::requests)
  int32_t kv_start;      // keys [kv_start, kv_end), kv_start a multiple of kKeysPerTile
  int32_t kv_end;        // <= the request's seq_len (each row masks its own causal end)
  int32_t partial_row;   // -1: write the output; else slot (rows slot * R .. + R of the partials,
                         // R = tokens_per_request * H)
};

struct DecodeRequest {
  int32_t first_token;   // its tokens: rows first_token .. + num_tokens of q, the output, the LSE
  int32_t num_tokens;    // q >= 1: token t sees keys [0, seq_len - num_tokens + 1 + t)
  int32_t seq_len;       // keys of its last token
  int32_t num_splits;    // 1: written directly
  int32_t partial_base;  // first slot of the request's segments
};

struct Plan {
  std::vector<Segment> segments;
  std::vector<int32_t> part_begin;      // (num_parts + 1,) segment ranges of the parts
  std::vector<DecodeRequest> requests;  // (num_requests,)
  int tokens_per_request = 1;           // the largest q: each request has tokens_per_request * H rows
  int num_parts = 0;
  int num_partial_slots = 0;
  bool any_split = false;
};

// How the launch merges split requests (the combine kernel, mla_decode.cu): none (no request is
// split), narrow (a warp a row, 8 rows a CTA: every request's slots in consecutive batches) or wide
// (a plan with a request of more than kNarrowSplits segments: one or a few long requests spread
// over every part; a CTA a row for those, the 8 warps splitting its slots). Capture plans take
// narrow: any plan at replay is merged correctly, and a wide grid would launch requests x rows
// CTAs at every replay.
enum class Combine : int32_t { none, narrow, wide };
inline constexpr int kNarrowSplits = 8;
inline Combine plan_combine(const Plan& plan) {
  if (!plan.any_split) return Combine::none;
  for (const DecodeRequest& r : plan.requests) {
    if (r.num_splits > kNarrowSplits) return Combine::wide;
  }
  return Combine::narrow;
}

// Capacity of a plan for `max_requests` requests cut into at most `max_parts` parts.
inline int64_t max_segments(int64_t max_requests, int64_t max_parts) { return max_requests + max_parts; }
inline int64_t max_partial_slots(int64_t max_parts) { return 2 * max_parts; }

// Batch-invariant plans (BuilderConfig::batch_invariant): each request cut in segments of
// split_tiles tiles from key 0 (the last shorter), whatever the batch and the SM count, so what a
// segment computes and how its request's slots merge depend on the request alone; the segments are
// then dealt to at most num_parts parts of about equal cost (which part runs a segment changes
// nothing it computes). A request of one segment writes the output directly.
inline constexpr int kBatchInvariantSplitTiles = 32;  // 2048 keys, as the CUDA backend's decodes
Plan make_fixed_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int split_tiles,
                     int num_parts);
// Segments (and partial slots) of fixed plans of at most max_requests requests of <= max_len keys.
inline int64_t max_fixed_segments(int64_t max_requests, int64_t max_len, int split_tiles) {
  const int64_t tiles = (max_len + kKeysPerTile - 1) / kKeysPerTile;
  return max_requests * std::max<int64_t>(1, (tiles + split_tiles - 1) / split_tiles);
}

// The decode kernel of a plan, chosen by the builder (mla_cuda_backend.cpp: once per
// tokens_per_request, at construction) from the rows of a request, R = tokens_per_request * H, and
// run by the launch as named:
//   mma_16_rows  the mma.sync kernel (mla_decode.cu), 16 rows a CTA: R <= 16 (single-token
//                decodes of <= 16 heads: memory-bound), and R <= 32 where wgmma does not run;
//   mma_64_rows  the mma.sync kernel, 64 rows a CTA: R > 32 without the sm_90a image, or
//                under the override mla=mma;
//   wgmma        the Hopper wgmma kernel (mla_decode_wgmma.cu), 64 rows a CTA, on sm_90a: R > 16
//                with a 16-bit cache of the activation dtype, R > 32 with an fp8 one (one pass
//                over a request's keys for up to 64 rows, where 16-row CTAs would each read them).
enum class DecodeKernel : int32_t { mma_16_rows, mma_64_rows, wgmma };

// Rows of one CTA of `kernel`, and the CTAs (row tiles) of a request of `rows` rows.
constexpr int rows_per_cta(DecodeKernel kernel) { return kernel == DecodeKernel::mma_16_rows ? 16 : 64; }
constexpr int row_tiles(DecodeKernel kernel, int rows) { return (rows + rows_per_cta(kernel) - 1) / rows_per_cta(kernel); }

// The split-KV partition for `kernel`'s CTAs (mla_decode_plan.cpp): the cheaper under plan_cost of
// a balanced partition (requests cut at part boundaries) and whole requests dealt longest first.
// seq_lens (num_requests,) >= 0: the keys of each request's last token; query_start_loc
// (num_requests + 1,) from 0, each request >= 1 token, or empty: one token each; num_parts >= 1.
Plan make_plan(std::span<const int32_t> seq_lens, std::span<const int32_t> query_start_loc, int num_parts,
               DecodeKernel kernel);
// A plan's cost in tile units (a CTA's 64-key tile of `kernel`): its most loaded part (tiles +
// kSegmentOverhead a segment) plus, with a cut request, its partial slots' write and combine read
// spread over the parts and the combine's launch.
double plan_cost(const Plan& plan, DecodeKernel kernel);

// The kernel for requests of `rows` rows (tokens_per_request * num_heads) and the cache's storage
// dtype (pure). wgmma_image: the device loads the wgmma kernel's sm_90a image
// (wgmma_decode_available()).
DecodeKernel select_decode_kernel(MlaDecodeKernelChoice choice, int rows, DType cache_dtype, bool wgmma_image);

// select_decode_kernel under kernel_override() on the current device: what a builder stores in its
// plans (tests and benchmarks that launch without a builder call it too).
DecodeKernel resolve_decode_kernel(int rows, DType cache_dtype);

struct DecodeParams {
  const void* q;              // (tokens, H, 576):(q_token_stride, q_head_stride, 1)
  int64_t q_token_stride, q_head_stride;
  const void* cache;          // (num_blocks, block_size, 576):(block_stride, token_stride, 1)
  int64_t block_stride, token_stride;
  int64_t num_blocks;         // page ids outside [0, num_blocks) read as zeros
  const int32_t* block_table; // (requests, cols):(bt_stride, 1)
  int64_t bt_stride;
  int32_t block_size;
  int32_t num_heads;
  void* out;                  // (tokens, H, 512):(o_token_stride, o_head_stride, 1), activation dtype
  int64_t o_token_stride, o_head_stride;
  float* lse;                 // (H, tokens):(lse_head_stride, lse_token_stride) or nullptr
  int64_t lse_head_stride, lse_token_stride;
  const Segment* segments;
  const int32_t* part_begin;
  const DecodeRequest* requests;
  float* partial_out;         // (slots, tokens_per_request * H, 512) f32
  float* partial_lse;         // (slots, tokens_per_request * H) f32, natural log
  int32_t num_requests;
  int32_t tokens_per_request; // the plan's: rows of a request = tokens_per_request * num_heads
  float scale_log2;           // softmax scale * k_scale * log2(e)
  float out_scale;            // k_scale for fp8 caches, else 1
};

// cache_dtype: f16/bf16 (must equal activation) or fp8_e4m3/e5m2. Enqueues `kernel` (num_parts *
// row tiles CTAs) and, unless combine is none, the combine kernel (its grid sized for `combine`:
// plan_combine of the plan, narrow for a captured graph); Error when `kernel` cannot run this cache
// (wgmma: 16-bit caches only).
void launch_decode(const DecodeParams& params, DType activation, DType cache_dtype, DecodeKernel kernel,
                   int num_parts, Combine combine, void* stream);

}  // namespace pagedattn::cuda::mla_decode
