// Paged attention kernel of the CUDA backend: one launch serves a whole batch that mixes
// decodes, prefill chunks (causal with context), non-causal rows (encoder types, cross
// attention), over a paged cache (NHD or HND, 16-bit or fp8) or over the current K/V rows.
//
// What it computes, per work item (attention_plan.h): for each packed query row m of the item
// (token t = m / G, query head h = g*G + m % G, position p = seq_len - query_len + t) and each
// visible key n of [kv_start, kv_end) (p - window_left <= n <= p + window_right):
//     s = scale * k_scale * (q . k_n); s = c*tanh(s/c) (soft-cap); s -= slope_h*|p - n| (ALiBi)
//     o = sum_n e^{s - m} v_n * v_scale / (e^{sink - m} + sum_n e^{s - m});  LSE = m + log(...)
// written to the output (and output_lse) or, for one split of a long key range or one side of a
// cascade (shared prefix / own keys), as an f32 partial (o, LSE) that the combine kernel merges.
// head_size_v != head_size: this kernel's D is the larger; Q/K columns past head_size_qk and V
// columns past head_size_v are zero-filled in shared memory (never read from global memory; the
// extra MMA columns add zeros), outputs and partials get head_size_v columns. Equal sizes take
// unpredicated copies (a launch-uniform branch).
//
// Tiling: a CTA of 4 warps runs items in a persistent loop (grid <= resident CTAs; graph
// capturable: the counts are read from device memory). Keys stream through shared memory in
// tiles of 64 (cp.async 16-byte copies, zero-filled outside the item's range; the page id of
// the next tile is fetched one iteration ahead). 2 to 8 adjacent threads copy one key row, each
// at least two 16-byte chunks of it (TileCopy: 256-byte rows 8 threads, whole 128-byte lines of 4
// rows per warp request; 128-byte rows 4). Q.K^T and P.V run on tensor cores (mma.sync
// m16n8k16, f32 accumulate); K fragments via ldmatrix, V via ldmatrix.trans; shared rows are
// padded by 16 bytes (conflict-free ldmatrix for every head size here). Online softmax in base 2
// (scale folded with log2 e); O is rescaled only when a row of the warp gets a new maximum. Page
// lookups take a shift for power-of-two block sizes.
//   decode path  (<= 16 rows): Q in registers; warp w takes keys [16w, 16w+16) of each tile;
//                3-stage pipeline (4 for fp8); the 4 warps' (m, l, o) are merged through shared
//                memory.
// Pipeline: each iteration first refills the stage freed by the previous tile, then waits for
// the current tile, so kStages tiles are in flight while a CTA waits (decode is latency-bound:
// bytes in flight per SM set the bandwidth).
//   prefill path (64 / 128 rows): warp w owns rows [16*MT*w, 16*MT*(w+1)); 2-stage pipeline.
// Variants (template argument kVariant, attention_kernel_choice.h; chosen per launch on the
// host, each computes every plan): kVariantMma carries the mma.sync prefill path above;
// kVariantWgmma (16-bit caches, D = 64 / 128 / 256, sm_90a) the Hopper wgmma prefill path of
// paged_prefill_wgmma.cuh instead (the default there; PAGEDATTN_CUDA_PREFILL_KERNEL=mma forces
// mma.sync).
// Decode-only kernel (paged_decode_kernel, end of file; head sizes <= 128): the decode path alone
// with 2 stages, 3 CTAs per SM, for plans of decodes (the builder's choice, planner.h).
// fp8 caches: raw fp8 tiles are staged (rows D + 16 bytes apart). The decode path (D % 32 == 0)
// converts its MMA fragments in registers straight from the raw rows: Q.K^T with the head dims
// permuted alike in Q and K (4-byte loads), P.V with the output dims permuted (4 bytes of each of
// a lane's 4 keys, paired by byte_perm) and put back in order in the warp merge. Otherwise (the
// prefill paths, D = 80) the tile is first converted (exactly) to the activation type in shared
// memory. k_scale is folded into the logit scale, v_scale applied to o.
//
// Memory traffic: each KV byte of an item's range once per GQA group (plus the zero-filled tile
// edges); Q and O once per item; the floor is KV bytes / copy bandwidth for decode and
// 4*rows*keys*D (halved by causality) / MMA rate for prefill.
//
// Precision points: logits, softmax state and o in f32; P is rounded to the activation type
// (f16/bf16) before the P.V MMA (the row sum l uses the unrounded f32 P); fp8 -> 16-bit is
// exact; the final o is rounded once to the activation type (round to nearest even); exp2 via
// ex2.approx (rel. error ~2^-22); soft-cap uses the accurate tanhf.
#pragma once

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/common/device_primitives.cuh"

namespace pagedattn::cuda {

template <int D, typename T, bool kFp8>
struct AttentionTraits {
  static_assert(D % 16 == 0, "head size must be a multiple of 16");
  static constexpr int kRowStride = D + 8;              // elements per shared row (16-byte pad)
  static constexpr int kChunks = D * 2 / 16;            // 16-byte chunks of a 16-bit row
  static constexpr int kRawChunks = D / 16;             // 16-byte chunks of an fp8 row
  static constexpr int kLoadChunks = kFp8 ? kRawChunks : kChunks;
  static constexpr int kMTiles = D <= 128 ? 2 : 1;      // 16-row MMA tiles per warp (prefill)
  static constexpr int kPrefillRows = 64 * kMTiles;
  static_assert(kPrefillRows == prefill_rows_for_head_size(D));
  static constexpr int kPrefillStages = 2;
  static constexpr int kDecodeStages = kFp8 ? 4 : 3;    // fp8 stages are half as large
  static constexpr int kKTiles = D / 16;                // k16 steps of Q.K^T
  static constexpr int kDTiles = D / 8;                 // n8 tiles of the output
  static constexpr int kTileBytes = kKeysPerTile * kRowStride * 2;   // one 16-bit K or V tile
  // fp8 rows are staged D + 16 bytes apart: the decode path's 4-byte fragment loads (8 rows x
  // 16 bytes for K, 4 rows x 32 bytes for V per warp request) then hit 32 distinct banks.
  static constexpr int kRawRowBytes = D + 16;
  static constexpr int kRawTileBytes = kKeysPerTile * kRawRowBytes;  // one fp8 K or V tile
  static constexpr int kStageBytes = 2 * (kFp8 ? kRawTileBytes : kTileBytes);
  static constexpr int kConvertedBytes = kFp8 ? 2 * kTileBytes : 0;  // converted K + V tile
  // The decode path converts fp8 fragments in registers (no converted tile) when D % 32 == 0.
  static constexpr bool kDecodeDirectFp8 = kFp8 && D % 32 == 0;
  static constexpr int kDecodeConvertedBytes = kDecodeDirectFp8 ? 0 : kConvertedBytes;
  static constexpr int kMergeRowStride = D + 8;          // floats, decode merge buffer
  static constexpr int kMergeBytes = 4 * kDecodeRows * (kMergeRowStride + 2) * 4;
  static constexpr int kPrefillSmem =
      kPrefillRows * kRowStride * 2 + kPrefillStages * kStageBytes + kConvertedBytes;
  static constexpr int kDecodeSmem =
      kDecodeRows * kRowStride * 2 + kDecodeStages * kStageBytes + kDecodeConvertedBytes;
  static constexpr int kSmemBytes = kPrefillSmem > kDecodeSmem ? kPrefillSmem : kDecodeSmem;
  static_assert(kMergeBytes <= kDecodeSmem - kDecodeRows * kRowStride * 2);
  static constexpr int kMinCtasPerSm = D <= 128 ? 2 : 1;
};

// Per-item constants every thread needs.
struct ItemContext {
  WorkItem item;
  int group_size;
  int tile_base;        // kv_start rounded down to a tile
  int num_tiles;
  int lo_max;           // largest first-visible key over the item's rows
  int hi_min;           // smallest last-visible key over the item's rows
  float qk_scale;       // scale * k_scale
  float v_scale;
  int block_shift;      // log2(block_size) for a power-of-two page size (the usual case), else -1
};

__device__ __forceinline__ int first_visible(const AttentionKernelParams& p, int pos) {
  return p.window_left >= 0 ? max(0, pos - p.window_left) : 0;
}
__device__ __forceinline__ int last_visible(const AttentionKernelParams& p, int pos, int seq_len) {
  return p.window_right >= 0 ? min(seq_len - 1, pos + p.window_right) : seq_len - 1;
}

__device__ __forceinline__ ItemContext make_item_context(const AttentionKernelParams& p,
                                                         const WorkItem& item) {
  ItemContext ctx;
  ctx.item = item;
  ctx.group_size = p.group_size;
  ctx.tile_base = (item.kv_start / kKeysPerTile) * kKeysPerTile;
  ctx.num_tiles = item.kv_end > item.kv_start
                      ? (item.kv_end - ctx.tile_base + kKeysPerTile - 1) / kKeysPerTile
                      : 0;
  const int context = item.seq_len - item.query_len;
  const int first_pos = context + item.row_start / p.group_size;
  const int last_pos = context + (item.row_start + item.num_rows - 1) / p.group_size;
  ctx.lo_max = max(item.kv_start, first_visible(p, last_pos));
  ctx.hi_min = min(item.kv_end - 1, last_visible(p, first_pos, item.seq_len));
  const float k_scale = p.k_scale_per_head != nullptr ? p.k_scale_per_head[item.kv_head] : p.k_scale;
  ctx.v_scale = p.v_scale_per_head != nullptr ? p.v_scale_per_head[item.kv_head] : p.v_scale;
  ctx.qk_scale = p.scale * k_scale;
  const int bs = p.block_size;
  ctx.block_shift = p.paged && bs > 0 && (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  return ctx;
}

// Page (block-table column) of key position `pos`: a shift for power-of-two page sizes instead of
// an integer division (about 20 instructions, 8 per thread and tile in the copy loops).
__device__ __forceinline__ int page_index(const AttentionKernelParams& p, const ItemContext& ctx, int pos) {
  return ctx.block_shift >= 0 ? pos >> ctx.block_shift : pos / p.block_size;
}

// The visible keys [lo, hi] of one packed query row (hi < lo: the row sees nothing, e.g. the
// padding rows past num_rows).
struct RowRange {
  int lo, hi;
};

__device__ __forceinline__ int row_position(const ItemContext& ctx, int local_row) {
  return ctx.item.seq_len - ctx.item.query_len + (ctx.item.row_start + local_row) / ctx.group_size;
}
__device__ __forceinline__ int row_head(const ItemContext& ctx, int local_row) {
  const int m = ctx.item.row_start + local_row;
  return ctx.item.kv_head * ctx.group_size + m % ctx.group_size;
}
__device__ __forceinline__ int row_token(const ItemContext& ctx, int local_row) {
  return ctx.item.query_start + (ctx.item.row_start + local_row) / ctx.group_size;
}

__device__ __forceinline__ RowRange make_row_range(const AttentionKernelParams& p,
                                                   const ItemContext& ctx, int local_row) {
  if (local_row >= ctx.item.num_rows) return RowRange{0, -1};
  const int pos = row_position(ctx, local_row);
  return RowRange{max(ctx.item.kv_start, first_visible(p, pos)),
                  min(ctx.item.kv_end - 1, last_visible(p, pos, ctx.item.seq_len))};
}

// Logit constants of one row for the general path (soft-cap / ALiBi).
struct RowLogit {
  int pos;
  float alibi_slope;  // 0 = none
};
__device__ __forceinline__ RowLogit make_row_logit(const AttentionKernelParams& p,
                                                   const ItemContext& ctx, int local_row) {
  RowLogit r;
  r.pos = row_position(ctx, local_row);
  r.alibi_slope = p.alibi_slopes != nullptr && local_row < ctx.item.num_rows
                      ? p.alibi_slopes[row_head(ctx, local_row)]
                      : 0.f;
  return r;
}

// Logit transform of one score (natural units in, base-2 units out), without the mask.
__device__ __forceinline__ float general_logit(float dot, const AttentionKernelParams& p,
                                               const ItemContext& ctx, const RowLogit& row, int key) {
  float s = dot * ctx.qk_scale;
  if (p.soft_cap > 0.f) s = p.soft_cap * tanhf(s / p.soft_cap);
  if (row.alibi_slope != 0.f) s -= row.alibi_slope * fabsf(static_cast<float>(row.pos - key));
  return s * kLog2e;
}

// Prepares a tile of raw scores for the softmax and returns the factor that takes them to
// base-2 logits: the general path (soft-cap / ALiBi) transforms in place and returns 1; the fast
// path leaves them raw and returns scale * k_scale * log2(e) (folded into the exp's FFMA).
// Masked keys become -inf either way.
// s[j][e]: n8 tile j, element e (rows[e >> 1], key key0 + j * 8 + 2 * quad_col + (e & 1)).
template <int NT>
__device__ __forceinline__ float transform_scores(float (&s)[NT][4], const AttentionKernelParams& p,
                                                  const ItemContext& ctx, const RowRange (&rows)[2],
                                                  int first_local_row, int key0, bool general,
                                                  bool masked) {
  const int quad_col = threadIdx.x & 3;
  float factor = ctx.qk_scale * kLog2e;
  if (general) {
    const RowLogit logit[2] = {make_row_logit(p, ctx, first_local_row),
                               make_row_logit(p, ctx, first_local_row + 8)};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[j][e] = general_logit(s[j][e], p, ctx, logit[e >> 1], key0 + j * 8 + 2 * quad_col + (e & 1));
    factor = 1.f;
  }
  if (masked) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + j * 8 + 2 * quad_col + (e & 1);
        if (key < rows[e >> 1].lo || key > rows[e >> 1].hi) s[j][e] = neg_inf();
      }
    }
  }
  return factor;
}

// ---- tile loads ------------------------------------------------------------------------------

// Byte offsets of key position `pos` (head g) in K and V; the page id comes from `block`.
struct KVRowOffsets {
  int64_t k, v;
};
__device__ __forceinline__ KVRowOffsets kv_row_offsets(const AttentionKernelParams& p,
                                                       const ItemContext& ctx, int pos, int block,
                                                       int elem_bytes) {
  KVRowOffsets o;
  const int g = ctx.item.kv_head;
  if (p.paged) {
    const int offset = pos - page_index(p, ctx, pos) * p.block_size;
    o.k = (static_cast<int64_t>(block) * p.k_block_stride + offset * p.k_token_stride +
           g * p.k_head_stride) * elem_bytes;
    o.v = (static_cast<int64_t>(block) * p.v_block_stride + offset * p.v_token_stride +
           g * p.v_head_stride) * elem_bytes;
  } else {
    const int64_t token = ctx.item.query_start + pos;
    o.k = (token * p.k_token_stride + g * p.k_head_stride) * elem_bytes;
    o.v = (token * p.v_token_stride + g * p.v_head_stride) * elem_bytes;
  }
  return o;
}

// Copy mapping of a K/V tile: kThreadsPerRow adjacent threads copy one key row, each at least 2
// of its 16-byte chunks (chunk lane + k * kThreadsPerRow), up to 8 threads (a 128-byte line per
// row and instruction); rows tid / kThreadsPerRow + i * kRowStep. Each thread owns
// kRowsPerThread rows of every tile, and each row costs a page lookup and its address arithmetic:
// 128-byte rows (fp8 at D = 128, 16-bit at D = 64) take 4 threads a row and 2 rows a thread (8
// threads and 4 rows: fp8 decode 10-15% slower, the d 64 mixed batch 10%; H200, 2026-11-24);
// 256-byte rows keep 8 threads (4 threads, i.e. half lines per instruction: bf16 decode at d 128
// 5-10% slower).
template <class Tr, bool kFp8>
struct TileCopy {
  static constexpr int kChunks = kFp8 ? Tr::kRawChunks : Tr::kChunks;
  static constexpr int kThreadsPerRow = kChunks % 8 == 0 && kChunks >= 16  ? 8
                                       : kChunks % 4 == 0 && kChunks >= 8 ? 4
                                       : kChunks % 2 == 0 && kChunks >= 4 ? 2
                                                                          : 1;
  static constexpr int kChunksPerThread = kChunks / kThreadsPerRow;
  static constexpr int kRowStep = kThreadsPerCta / kThreadsPerRow;
  static constexpr int kRowsPerThread = kRowStep >= kKeysPerTile ? 1 : kKeysPerTile / kRowStep;
  static __device__ __forceinline__ int row(int i) { return threadIdx.x / kThreadsPerRow + i * kRowStep; }
};

// Page ids of this thread's key rows in tile `tile` (0 outside the item's range or when the
// source is not paged; -1 when the block table holds an id outside the cache: the row then reads
// as zeros). Read through the read-only path one iteration before they are used.
template <class Tr, bool kFp8>
__device__ __forceinline__ void fetch_blocks(const AttentionKernelParams& p, const ItemContext& ctx, int tile,
                                             int (&blocks)[TileCopy<Tr, kFp8>::kRowsPerThread]) {
  using C = TileCopy<Tr, kFp8>;
#pragma unroll
  for (int i = 0; i < C::kRowsPerThread; ++i) {
    const int row = C::row(i);
    const int pos = ctx.tile_base + tile * kKeysPerTile + row;
    blocks[i] = 0;
    if (p.paged && tile < ctx.num_tiles && row < kKeysPerTile && pos >= ctx.item.kv_start &&
        pos < ctx.item.kv_end) {
      const int block = __ldg(p.block_table + ctx.item.request * p.block_table_stride + page_index(p, ctx, pos));
      blocks[i] = block >= 0 && block < p.num_blocks ? block : -1;
    }
  }
}

// Issues the copies of K and V tile `tile` into a stage. 16-bit: rows of kRowStride elements;
// fp8: raw rows of D bytes, kRawRowBytes apart. kNarrow (head_size_qk or head_size_v < D): the
// chunks past a row's k_chunks / v_chunks are zero-filled (no global read).
template <class Tr, bool kFp8, bool kNarrow>
__device__ __forceinline__ void load_kv_tile_rows(const AttentionKernelParams& p, const ItemContext& ctx,
                                                  int tile, const int (&blocks)[TileCopy<Tr, kFp8>::kRowsPerThread],
                                                  char* stage, int k_chunks, int v_chunks) {
  using C = TileCopy<Tr, kFp8>;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  constexpr int kRowBytes = kFp8 ? Tr::kRawRowBytes : Tr::kRowStride * 2;
  constexpr int kTileBytes = kFp8 ? Tr::kRawTileBytes : Tr::kTileBytes;
  const int lane_chunk = threadIdx.x % C::kThreadsPerRow;
#pragma unroll
  for (int i = 0; i < C::kRowsPerThread; ++i) {
    const int row = C::row(i);
    if (row >= kKeysPerTile) continue;
    const int pos = ctx.tile_base + tile * kKeysPerTile + row;
    const bool valid = pos >= ctx.item.kv_start && pos < ctx.item.kv_end && blocks[i] >= 0;
    const KVRowOffsets off = kv_row_offsets(p, ctx, valid ? pos : ctx.item.kv_start, blocks[i], kElemBytes);
    const char* k_src = static_cast<const char*>(p.key) + (valid ? off.k : 0);
    const char* v_src = static_cast<const char*>(p.value) + (valid ? off.v : 0);
    char* k_dst = stage + row * kRowBytes;
    char* v_dst = stage + kTileBytes + row * kRowBytes;
#pragma unroll
    for (int k = 0; k < C::kChunksPerThread; ++k) {
      const int c = lane_chunk + k * C::kThreadsPerRow;
      cp_async_16(k_dst + c * 16, k_src + c * 16, kNarrow ? valid && c < k_chunks : valid);
    }
#pragma unroll
    for (int k = 0; k < C::kChunksPerThread; ++k) {
      const int c = lane_chunk + k * C::kThreadsPerRow;
      cp_async_16(v_dst + c * 16, v_src + c * 16, kNarrow ? valid && c < v_chunks : valid);
    }
  }
}

// Equal head sizes (head_size_qk == head_size_v == D) take the unpredicated copies: the branch
// is uniform over the launch.
template <class Tr, bool kFp8>
__device__ __forceinline__ void load_kv_tile(const AttentionKernelParams& p, const ItemContext& ctx, int tile,
                                             const int (&blocks)[TileCopy<Tr, kFp8>::kRowsPerThread],
                                             char* stage) {
  constexpr int kD = Tr::kDTiles * 8;
  if (p.head_size_qk == kD && p.head_size_v == kD) {
    load_kv_tile_rows<Tr, kFp8, false>(p, ctx, tile, blocks, stage, 0, 0);
  } else {
    constexpr int kElemsPerChunk = kFp8 ? 16 : 8;
    load_kv_tile_rows<Tr, kFp8, true>(p, ctx, tile, blocks, stage, p.head_size_qk / kElemsPerChunk,
                                      p.head_size_v / kElemsPerChunk);
  }
}

// fp8: converts a staged raw K/V tile into 16-bit rows (call between two barriers). One thread
// makes one 16-byte output chunk from 8 raw bytes: consecutive lanes write consecutive chunks
// of a row (no bank conflicts beyond the 4 wavefronts a warp's 512 bytes need).
template <class Tr, typename T>
__device__ __forceinline__ void convert_kv_tile(const char* raw, char* converted, int format) {
  constexpr int kOutChunks = Tr::kChunks;                  // 16-byte chunks of a 16-bit row
  constexpr int kChunksPerTile = kKeysPerTile * kOutChunks;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < 2 * kChunksPerTile; idx += kThreadsPerCta) {
    const int which = idx / kChunksPerTile;  // 0 = K, 1 = V
    const int rem = idx - which * kChunksPerTile;
    const int row = rem / kOutChunks;
    const int c = rem - row * kOutChunks;
    const uint2 in = *reinterpret_cast<const uint2*>(raw + which * Tr::kRawTileBytes +
                                                     row * Tr::kRawRowBytes + c * 8);
    *reinterpret_cast<uint4*>(converted + which * Tr::kTileBytes + row * Tr::kRowStride * 2 + c * 16) =
        fp8x8_to_16bit<T>(in, format);
  }
}

// Copies `rows` packed query rows into shared memory (zero rows past the item, zero columns
// past head_size_qk).
template <class Tr, typename T>
__device__ __forceinline__ void load_q_tile(const AttentionKernelParams& p, const ItemContext& ctx,
                                            int rows, T* q_smem) {
  const int q_chunks = p.head_size_qk / 8;
  for (int idx = threadIdx.x; idx < rows * Tr::kChunks; idx += kThreadsPerCta) {
    const int row = idx / Tr::kChunks;
    const int c = idx - row * Tr::kChunks;
    const bool valid = row < ctx.item.num_rows && c < q_chunks;
    const T* src = static_cast<const T*>(p.query);
    if (valid) {
      src += row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride + c * 8;
    }
    cp_async_16(q_smem + row * Tr::kRowStride + c * 8, src, valid);
  }
}

// ---- online softmax --------------------------------------------------------------------------

// Updates (m, l) of one thread's row with a tile of scores: s[j][2*half + e] are the thread's
// NT*2 scores of the row, base-2 logits after multiplying by `factor` (> 0; masked ones are -inf);
// they become P. Returns the row's correction e^(m_old - m_new) for its O (rescale_o): exactly 1
// when the maximum did not move (exp2(0)).
template <int NT>
__device__ __forceinline__ float online_softmax_row(float (&s)[NT][4], int half, float factor, float& m, float& l) {
  float mx = neg_inf();
#pragma unroll
  for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx * factor);
  const float base = m_new == neg_inf() ? 0.f : m_new;
  const float correction = fast_exp2(m - base);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    s[j][2 * half] = fast_exp2(fmaf(s[j][2 * half], factor, -base));
    s[j][2 * half + 1] = fast_exp2(fmaf(s[j][2 * half + 1], factor, -base));
    sum += s[j][2 * half] + s[j][2 * half + 1];
  }
  l = l * correction + sum;
  m = m_new;
  return correction;
}

// O *= the corrections of the thread's two rows (o[d][0..1]: row r, o[d][2..3]: row r + 8),
// skipped (warp-uniformly) when no row of the warp got a new maximum: after the first tiles the
// common case, which saves D/4 multiplies a thread and tile.
template <int DT>
__device__ __forceinline__ void rescale_o(float (&o)[DT][4], float c0, float c1) {
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      o[d][0] *= c0;
      o[d][1] *= c0;
      o[d][2] *= c1;
      o[d][3] *= c1;
    }
  }
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Natural-log LSE from the base-2 state (m, l summed over the quad).
__device__ __forceinline__ float lse_from_state(float m, float l) {
  return l > 0.f ? (m + __log2f(l)) * kLn2 : neg_inf();
}

// Initial state of a row: the sink acts as one extra logit with no value row.
__device__ __forceinline__ void init_row_state(const AttentionKernelParams& p, const ItemContext& ctx,
                                               int local_row, bool owns_sink, float& m, float& l) {
  m = neg_inf();
  l = 0.f;
  if (p.sinks != nullptr && local_row < ctx.item.num_rows) {
    m = p.sinks[row_head(ctx, local_row)] * kLog2e;
    l = owns_sink && (ctx.item.flags & kItemOwnsSink) && (threadIdx.x & 3) == 0 ? 1.f : 0.f;
  }
}

// ---- decode path: 16 rows, the warps split each tile's keys ------------------------------------

// kStages: pipeline depth (the unified kernel's Tr::kDecodeStages; the decode-only kernel runs 2
// stages so that 3 CTAs fit an SM).
template <int D, typename T, bool kFp8, int kStages = AttentionTraits<D, T, kFp8>::kDecodeStages>
__device__ void run_decode_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem) {
  using Tr = AttentionTraits<D, T, kFp8>;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;  // rows quad_row, quad_row + 8
  const int quad_col = lane & 3;

  constexpr bool kDirect = Tr::kDecodeDirectFp8;
  T* q_smem = reinterpret_cast<T*>(smem);  // (16, kRowStride)
  char* stages = smem + kDecodeRows * Tr::kRowStride * 2;
  char* converted = stages + kStages * Tr::kStageBytes;  // fp8 with D % 32 != 0 only

  load_q_tile<Tr, T>(p, ctx, kDecodeRows, q_smem);
  cp_async_commit();
  constexpr int kRows = TileCopy<Tr, kFp8>::kRowsPerThread;
  int blocks[kRows], next_blocks[kRows];
  fetch_blocks<Tr, kFp8>(p, ctx, 0, next_blocks);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
    fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
    if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + t * Tr::kStageBytes);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();
  __syncthreads();

  uint32_t q_frag[Tr::kKTiles][4];  // A fragments of the 16 x D query tile
#pragma unroll
  for (int kk = 0; kk < Tr::kKTiles; ++kk) {
    if constexpr (kDirect) {
      // Direct fp8: the k16 step kk takes dims 16kk + 4c + {0, 1} as MMA columns 2c + {0, 1} and
      // 16kk + 4c + {2, 3} as 2c + 8 + {0, 1} (c = quad_col); K's fragments below take the same
      // dims, so Q.K^T sums the same products (the order of a dot product's terms is free).
      const T* q0 = q_smem + quad_row * Tr::kRowStride + kk * 16 + 4 * quad_col;
      const T* q8 = q0 + 8 * Tr::kRowStride;
      q_frag[kk][0] = *reinterpret_cast<const uint32_t*>(q0);
      q_frag[kk][1] = *reinterpret_cast<const uint32_t*>(q8);
      q_frag[kk][2] = *reinterpret_cast<const uint32_t*>(q0 + 2);
      q_frag[kk][3] = *reinterpret_cast<const uint32_t*>(q8 + 2);
    } else {
      ldmatrix_x4(q_frag[kk], q_smem + (lane & 15) * Tr::kRowStride + kk * 16 + (lane >> 4) * 8);
    }
  }
  RowRange rows[2];
  float m[2], l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rows[h] = make_row_range(p, ctx, quad_row + 8 * h);
    init_row_state(p, ctx, quad_row + 8 * h, warp == 0, m[h], l[h]);
  }
  float o[Tr::kDTiles][4];
#pragma unroll
  for (int d = 0; d < Tr::kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;

#pragma unroll 1
  for (int tile = 0; tile < ctx.num_tiles; ++tile) {
    __syncthreads();  // every warp is done with tile - 1, whose stage is refilled below
    {
      const int t = tile + kStages - 1;
#pragma unroll
      for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
      fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
      if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + (t % kStages) * Tr::kStageBytes);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // tile landed; the kStages - 1 newer tiles stay in flight
    __syncthreads();
    const char* stage = stages + (tile % kStages) * Tr::kStageBytes;
    if constexpr (kFp8 && !kDirect) {
      convert_kv_tile<Tr, T>(stage, converted, p.fp8_format);
      __syncthreads();
      stage = converted;
    }
    const T* k_tile = reinterpret_cast<const T*>(stage);
    const T* v_tile = reinterpret_cast<const T*>(stage + Tr::kTileBytes);

    // S (16 x 16) = Q . K^T for keys [16*warp, 16*warp + 16) of the tile.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < Tr::kKTiles; ++kk) {
      uint32_t kb[4];
      if constexpr (kDirect) {
        // Key warp*16 + 8j + quad_row, dims 16kk + 4c .. + 3 (the Q order above): one 4-byte load.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t raw = *reinterpret_cast<const uint32_t*>(
              stage + (warp * 16 + 8 * j + quad_row) * Tr::kRawRowBytes + kk * 16 + 4 * quad_col);
          const uint2 pairs = fp8x4_to_16bit<T>(raw, p.fp8_format);
          kb[2 * j] = pairs.x;
          kb[2 * j + 1] = pairs.y;
        }
      } else {
        ldmatrix_x4(kb, k_tile + (warp * 16 + (lane & 7) + (lane >> 4) * 8) * Tr::kRowStride + kk * 16 +
                            ((lane >> 3) & 1) * 8);
      }
      Mma<T>::mma(s[0], q_frag[kk], kb[0], kb[1]);
      Mma<T>::mma(s[1], q_frag[kk], kb[2], kb[3]);
    }
    const int key0 = ctx.tile_base + tile * kKeysPerTile;
    const bool masked = key0 < ctx.lo_max || key0 + kKeysPerTile - 1 > ctx.hi_min;
    const float factor = transform_scores<2>(s, p, ctx, rows, quad_row, key0 + warp * 16, general, masked);
    const float c0 = online_softmax_row<2>(s, 0, factor, m[0], l[0]);
    const float c1 = online_softmax_row<2>(s, 1, factor, m[1], l[1]);
    rescale_o(o, c0, c1);

    // O += P (16 x 16) . V (16 x D)
    uint32_t pa[4];
    pa[0] = Mma<T>::pack(s[0][0], s[0][1]);
    pa[1] = Mma<T>::pack(s[0][2], s[0][3]);
    pa[2] = Mma<T>::pack(s[1][0], s[1][1]);
    pa[3] = Mma<T>::pack(s[1][2], s[1][3]);
    if constexpr (kDirect) {
      // Direct fp8: output n8 tile 4b + t holds dims 32b + 4n + t (n = the MMA column): a lane
      // (n = quad_row) reads 4 bytes (dims 32b + 4n .. + 3) of each of its keys 2c, 2c + 1,
      // 2c + 8, 2c + 9 and pairs the keys' bytes of one dim (byte_perm) for the B fragments.
      const char* v_raw = stage + Tr::kRawTileBytes + (warp * 16 + 2 * quad_col) * Tr::kRawRowBytes + 4 * quad_row;
#pragma unroll
      for (int b = 0; b < Tr::kDTiles / 4; ++b) {
        const char* src = v_raw + 32 * b;
        const uint32_t u0 = *reinterpret_cast<const uint32_t*>(src);
        const uint32_t u1 = *reinterpret_cast<const uint32_t*>(src + Tr::kRawRowBytes);
        const uint32_t u8 = *reinterpret_cast<const uint32_t*>(src + 8 * Tr::kRawRowBytes);
        const uint32_t u9 = *reinterpret_cast<const uint32_t*>(src + 9 * Tr::kRawRowBytes);
        const uint2 lo01 = fp8x4_to_16bit<T>(__byte_perm(u0, u1, 0x5140), p.fp8_format);  // dims +0, +1
        const uint2 hi01 = fp8x4_to_16bit<T>(__byte_perm(u0, u1, 0x7362), p.fp8_format);  // dims +2, +3
        const uint2 lo89 = fp8x4_to_16bit<T>(__byte_perm(u8, u9, 0x5140), p.fp8_format);
        const uint2 hi89 = fp8x4_to_16bit<T>(__byte_perm(u8, u9, 0x7362), p.fp8_format);
        Mma<T>::mma(o[4 * b], pa, lo01.x, lo89.x);
        Mma<T>::mma(o[4 * b + 1], pa, lo01.y, lo89.y);
        Mma<T>::mma(o[4 * b + 2], pa, hi01.x, hi89.x);
        Mma<T>::mma(o[4 * b + 3], pa, hi01.y, hi89.y);
      }
    } else {
#pragma unroll
      for (int dd = 0; dd < Tr::kDTiles / 2; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + (warp * 16 + (lane & 15)) * Tr::kRowStride + dd * 16 + (lane >> 4) * 8);
        Mma<T>::mma(o[2 * dd], pa, vb[0], vb[1]);
        Mma<T>::mma(o[2 * dd + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: reuse them for the merge

  // Merge the 4 warps' states: (m, l) per row and o (16 x D) per warp, through shared memory.
  float* merge_o = reinterpret_cast<float*>(stages);                      // (4, 16, kMergeRowStride)
  float* merge_m = merge_o + 4 * kDecodeRows * Tr::kMergeRowStride;       // (4, 16)
  float* merge_l = merge_m + 4 * kDecodeRows;                              // (4, 16)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = quad_row + 8 * h;
    const float lsum = quad_sum(l[h]);
    if (quad_col == 0) {
      merge_m[warp * kDecodeRows + r] = m[h];
      merge_l[warp * kDecodeRows + r] = lsum;
    }
    float* dst = merge_o + (warp * kDecodeRows + r) * Tr::kMergeRowStride;
    if constexpr (kDirect) {
      // Tile 4b + t, column 2c + e holds dim 32b + 8c + 4e + t.
#pragma unroll
      for (int b = 0; b < Tr::kDTiles / 4; ++b) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *reinterpret_cast<float4*>(dst + 32 * b + 8 * quad_col + 4 * e) =
              make_float4(o[4 * b][2 * h + e], o[4 * b + 1][2 * h + e], o[4 * b + 2][2 * h + e],
                          o[4 * b + 3][2 * h + e]);
        }
      }
    } else {
#pragma unroll
      for (int d = 0; d < Tr::kDTiles; ++d) {
        *reinterpret_cast<float2*>(dst + d * 8 + 2 * quad_col) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      }
    }
  }
  __syncthreads();

  // 8 threads per row, 8 columns per step.
  const int r = threadIdx.x >> 3;
  if (r < ctx.item.num_rows) {
    float weight[4];
    float mmax = neg_inf();
#pragma unroll
    for (int w = 0; w < 4; ++w) mmax = fmaxf(mmax, merge_m[w * kDecodeRows + r]);
    const float base = mmax == neg_inf() ? 0.f : mmax;
    float lsum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      weight[w] = fast_exp2(merge_m[w * kDecodeRows + r] - base);
      lsum += weight[w] * merge_l[w * kDecodeRows + r];
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float out_scale = inv * ctx.v_scale;
    const bool split = ctx.item.partial_row >= 0;
    const int token = row_token(ctx, r);
    const int head = row_head(ctx, r);
    for (int c = threadIdx.x & 7; c < p.head_size_v / 8; c += 8) {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float* src = merge_o + (w * kDecodeRows + r) * Tr::kMergeRowStride + c * 8;
        const float4 a = *reinterpret_cast<const float4*>(src);
        const float4 b = *reinterpret_cast<const float4*>(src + 4);
        acc[0] += weight[w] * a.x; acc[1] += weight[w] * a.y;
        acc[2] += weight[w] * a.z; acc[3] += weight[w] * a.w;
        acc[4] += weight[w] * b.x; acc[5] += weight[w] * b.y;
        acc[6] += weight[w] * b.z; acc[7] += weight[w] * b.w;
      }
      if (split) {
        float* dst = p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * p.head_size_v + c * 8;
        *reinterpret_cast<float4*>(dst) =
            make_float4(acc[0] * out_scale, acc[1] * out_scale, acc[2] * out_scale, acc[3] * out_scale);
        *reinterpret_cast<float4*>(dst + 4) =
            make_float4(acc[4] * out_scale, acc[5] * out_scale, acc[6] * out_scale, acc[7] * out_scale);
      } else {
        uint4 packed;
        packed.x = Mma<T>::pack(acc[0] * out_scale, acc[1] * out_scale);
        packed.y = Mma<T>::pack(acc[2] * out_scale, acc[3] * out_scale);
        packed.z = Mma<T>::pack(acc[4] * out_scale, acc[5] * out_scale);
        packed.w = Mma<T>::pack(acc[6] * out_scale, acc[7] * out_scale);
        T* dst = static_cast<T*>(p.output) + token * p.o_token_stride + head * p.o_head_stride + c * 8;
        *reinterpret_cast<uint4*>(dst) = packed;
      }
    }
    if ((threadIdx.x & 7) == 0) {
      const float lse = lse_from_state(mmax, lsum);
      if (split) {
        p.partial_lse[ctx.item.partial_row + r] = lse;
      } else if (p.lse != nullptr) {
        p.lse[head * p.lse_head_stride + static_cast<int64_t>(token) * p.lse_token_stride] = lse;
      }
    }
  }
}

// ---- prefill path: 16*MT rows per warp, every warp sees every key of a tile ---------------------

template <int D, typename T, bool kFp8>
__device__ void run_prefill_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem) {
  using Tr = AttentionTraits<D, T, kFp8>;
  constexpr int kStages = Tr::kPrefillStages;
  constexpr int MT = Tr::kMTiles;
  constexpr int NT = kKeysPerTile / 8;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;
  const int quad_col = lane & 3;
  const int warp_row0 = warp * 16 * MT;

  T* q_smem = reinterpret_cast<T*>(smem);  // (kPrefillRows, kRowStride)
  char* stages = smem + Tr::kPrefillRows * Tr::kRowStride * 2;
  char* converted = stages + kStages * Tr::kStageBytes;

  load_q_tile<Tr, T>(p, ctx, Tr::kPrefillRows, q_smem);
  cp_async_commit();
  constexpr int kRows = TileCopy<Tr, kFp8>::kRowsPerThread;
  int blocks[kRows], next_blocks[kRows];
  fetch_blocks<Tr, kFp8>(p, ctx, 0, next_blocks);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
    fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
    if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + t * Tr::kStageBytes);
    cp_async_commit();
  }

  RowRange rows[MT][2];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
      rows[mt][h] = make_row_range(p, ctx, r);
      init_row_state(p, ctx, r, true, m[mt][h], l[mt][h]);
    }
  }
  float o[MT][Tr::kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < Tr::kDTiles; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;
  // Keys past the last row's visibility are skipped per warp (causal: the upper triangle).
  int warp_hi = -1;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) warp_hi = max(warp_hi, rows[mt][h].hi);
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 4));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 8));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 16));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 1));
  warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, 2));

#pragma unroll 1
  for (int tile = 0; tile < ctx.num_tiles; ++tile) {
    __syncthreads();  // every warp is done with tile - 1, whose stage is refilled below
    {
      const int t = tile + kStages - 1;
#pragma unroll
      for (int i = 0; i < kRows; ++i) blocks[i] = next_blocks[i];
      fetch_blocks<Tr, kFp8>(p, ctx, t + 1, next_blocks);
      if (t < ctx.num_tiles) load_kv_tile<Tr, kFp8>(p, ctx, t, blocks, stages + (t % kStages) * Tr::kStageBytes);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // tile landed; the kStages - 1 newer tiles stay in flight
    __syncthreads();
    const char* stage = stages + (tile % kStages) * Tr::kStageBytes;
    if constexpr (kFp8) {
      convert_kv_tile<Tr, T>(stage, converted, p.fp8_format);
      __syncthreads();
      stage = converted;
    }
    const int key0 = ctx.tile_base + tile * kKeysPerTile;
    if (key0 > warp_hi) continue;  // no row of this warp sees this tile (uniform per warp)
    const T* k_tile = reinterpret_cast<const T*>(stage);
    const T* v_tile = reinterpret_cast<const T*>(stage + Tr::kTileBytes);

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kKTiles; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldmatrix_x4(qa[mt], q_smem + (warp_row0 + mt * 16 + (lane & 15)) * Tr::kRowStride + kk * 16 +
                                (lane >> 4) * 8);
      }
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * Tr::kRowStride + kk * 16 +
                            ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::mma(s[mt][2 * nn], qa[mt], kb[0], kb[1]);
          Mma<T>::mma(s[mt][2 * nn + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    const bool masked = key0 < ctx.lo_max || key0 + kKeysPerTile - 1 > ctx.hi_min;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float factor =
          transform_scores<NT>(s[mt], p, ctx, rows[mt], warp_row0 + mt * 16 + quad_row, key0, general, masked);
      const float c0 = online_softmax_row<NT>(s[mt], 0, factor, m[mt][0], l[mt][0]);
      const float c1 = online_softmax_row<NT>(s[mt], 1, factor, m[mt][1], l[mt][1]);
      rescale_o(o[mt], c0, c1);
    }
#pragma unroll
    for (int kk = 0; kk < kKeysPerTile / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < Tr::kDTiles / 2; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + (kk * 16 + (lane & 15)) * Tr::kRowStride + dd * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::mma(o[mt][2 * dd], pa[mt], vb[0], vb[1]);
          Mma<T>::mma(o[mt][2 * dd + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncwarp();  // the warp's last ldmatrix reads of its Q rows precede the staging writes

  // Epilogue: normalize; the warp stages its rows in its own (no longer read) Q rows, then
  // writes 16-byte chunks. Split items write f32 partials straight from registers.
  const bool split = ctx.item.partial_row >= 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
      const float lsum = quad_sum(l[mt][h]);
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      const float out_scale = inv * ctx.v_scale;
      const float lse = lse_from_state(m[mt][h], lsum);
      const bool live = r < ctx.item.num_rows;
      if (split) {
        if (live) {
          float* dst =
              p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * p.head_size_v + 2 * quad_col;
#pragma unroll
          for (int d = 0; d < Tr::kDTiles; ++d) {
            if (d * 8 < p.head_size_v) {
              *reinterpret_cast<float2*>(dst + d * 8) =
                  make_float2(o[mt][d][2 * h] * out_scale, o[mt][d][2 * h + 1] * out_scale);
            }
          }
          if (quad_col == 0) p.partial_lse[ctx.item.partial_row + r] = lse;
        }
      } else {
        T* dst = q_smem + r * Tr::kRowStride + 2 * quad_col;
#pragma unroll
        for (int d = 0; d < Tr::kDTiles; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              Mma<T>::pack(o[mt][d][2 * h] * out_scale, o[mt][d][2 * h + 1] * out_scale);
        }
        if (live && quad_col == 0 && p.lse != nullptr) {
          p.lse[row_head(ctx, r) * p.lse_head_stride +
                static_cast<int64_t>(row_token(ctx, r)) * p.lse_token_stride] = lse;
        }
      }
    }
  }
  if (!split) {
    __syncwarp();
    const int out_chunks = p.head_size_v / 8;
    for (int idx = lane; idx < 16 * MT * Tr::kChunks; idx += 32) {
      const int rr = idx / Tr::kChunks;
      const int c = idx - rr * Tr::kChunks;
      const int r = warp_row0 + rr;
      if (r < ctx.item.num_rows && c < out_chunks) {
        T* dst = static_cast<T*>(p.output) + row_token(ctx, r) * p.o_token_stride +
                 row_head(ctx, r) * p.o_head_stride + c * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(q_smem + r * Tr::kRowStride + c * 8);
      }
    }
  }
}

// ---- the kernel ------------------------------------------------------------------------------

}  // namespace pagedattn::cuda

#include "backends/cuda/attention/attention_kernel_choice.h"
#include "backends/cuda/attention/paged_prefill_wgmma.cuh"

namespace pagedattn::cuda {

// Resources of a kernel variant (attention_kernel_choice.h).
template <int D, typename T, bool kFp8, int kVariant>
struct KernelVariantTraits {
  using Tr = AttentionTraits<D, T, kFp8>;
  using W = WgmmaPrefillTraits<D>;
  static constexpr bool kWgmma = kVariant == kVariantWgmma;
  static constexpr bool kValid = kVariant == kVariantMma || (kWgmma && W::kSupported && !kFp8);
  static_assert(kValid, "no such kernel variant for this head size / cache");
  static constexpr int kPrefillSmem = kWgmma ? W::kSmemBytes : Tr::kPrefillSmem;
  static constexpr int kSmemBytes = kPrefillSmem > Tr::kDecodeSmem ? kPrefillSmem : Tr::kDecodeSmem;
  static constexpr int kMinCtasPerSm = Tr::kMinCtasPerSm;
};

template <int D, typename T, bool kFp8, int kVariant>
__global__ void __launch_bounds__(kThreadsPerCta, KernelVariantTraits<D, T, kFp8, kVariant>::kMinCtasPerSm)
    paged_attention_kernel(const AttentionKernelParams p) {
  using V = KernelVariantTraits<D, T, kFp8, kVariant>;
  extern __shared__ __align__(1024) char smem[];  // 1024: the wgmma path's 128-byte swizzle
  const int num_items = p.header->num_work_items;
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const ItemContext ctx = make_item_context(p, p.items[i]);
    if (ctx.item.flags & kItemDecodePath) {
      run_decode_item<D, T, kFp8>(p, ctx, smem);
    } else if constexpr (V::kWgmma) {
      run_prefill_item_wgmma<D, T>(p, ctx, smem);
    } else {
      run_prefill_item<D, T, kFp8>(p, ctx, smem);
    }
    __syncthreads();  // shared memory is reused by the next item
  }
}

// ---- the decode-only kernel ----------------------------------------------------------------
// For plans whose items are all decode-path items (the builder's choice, attention_plan.h): the
// same decode path with a 2-stage pipeline and no prefill path, so the registers (<= 168) and the
// shared memory (D = 128: 74 KB) let 3 CTAs share an SM instead of 2. It still computes any plan
// exactly (prefill-path items in 16-row slices), so a graph captured with it replays any plan.
// A decode item's math is latency-bound (one 16-row MMA chain per warp per tile), so it is the
// number of independent CTAs per SM, not the pipeline depth, that hides it behind the copies
// (bench/kv_access_probe.cu measured both: 3-stage CTAs x 2 lose 20-25% of their copy rate to a
// decode tile's worth of math, 2-stage CTAs x 3 about 5%). Head sizes <= 128 (beyond, the o accumulators alone would
// need 128 registers).
template <int D, typename T, bool kFp8>
struct DecodeKernelTraits {
  using Tr = AttentionTraits<D, T, kFp8>;
  static constexpr bool kExists = D <= 128;
  static constexpr int kStages = 2;
  static constexpr int kSmemBytes =
      kDecodeRows * Tr::kRowStride * 2 + kStages * Tr::kStageBytes + Tr::kDecodeConvertedBytes;
  static_assert(Tr::kMergeBytes <= kSmemBytes - kDecodeRows * Tr::kRowStride * 2);
  static constexpr int kMinCtasPerSm = 3;
};

template <int D, typename T, bool kFp8>
__global__ void __launch_bounds__(kThreadsPerCta, DecodeKernelTraits<D, T, kFp8>::kMinCtasPerSm)
    paged_decode_kernel(const AttentionKernelParams p) {
  static_assert(DecodeKernelTraits<D, T, kFp8>::kExists);
  extern __shared__ __align__(128) char smem[];
  constexpr int kStages = DecodeKernelTraits<D, T, kFp8>::kStages;
  const int num_items = p.header->num_work_items;
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const WorkItem item = p.items[i];
    // 16-row slices: a decode-path item is one slice (itself); a prefill-path item (only when a
    // graph captured with a decode-only plan replays another plan) is several, each over the
    // item's keys: exact, not fast.
    for (int r0 = 0; r0 < item.num_rows; r0 += kDecodeRows) {
      WorkItem slice = item;
      slice.row_start += r0;
      slice.num_rows = min(kDecodeRows, item.num_rows - r0);
      if (slice.partial_row >= 0) slice.partial_row += r0;
      run_decode_item<D, T, kFp8, kStages>(p, make_item_context(p, slice), smem);
      __syncthreads();  // shared memory is reused by the next slice
    }
  }
}

}  // namespace pagedattn::cuda
