// Device code shared by the paged attention paths (the decode path, the mma.sync and wgmma
// prefill paths, the warp-specialized kernel): per-item constants, key visibility, the logit
// transform and the online softmax.
//
// What a work item computes (attention_plan.h): for each packed query row m of the item
// (token t = m / G, query head h = g*G + m % G, position p = seq_len - query_len + t) and each
// visible key n of [kv_start, kv_end) (p - window_left <= n <= p + window_right):
//     s = scale * k_scale * (q . k_n); s = c*tanh(s/c) (soft-cap); s -= slope_h*|p - n| (ALiBi)
//     o = sum_n e^{s - m} v_n * v_scale / (e^{sink - m} + sum_n e^{s - m});  LSE = m + log(...)
// written to the output (and output_lse) or, for one split of a long key range or one side of a
// cascade (shared prefix / own keys), as an f32 partial (o, LSE) that the combine kernel merges.
// head_size_v != head_size: the kernel's D is the larger; Q/K columns past head_size_qk and V
// columns past head_size_v are zero-filled in shared memory (never read from global memory; the
// extra MMA columns add zeros), outputs and partials get head_size_v columns.
// Online softmax in base 2 (scale folded with log2 e); O is rescaled only when a row of the warp
// gets a new maximum. Page lookups take a shift for power-of-two block sizes.
//
// Precision points: logits, softmax state and o in f32; P is rounded to the activation type
// (f16/bf16) before the P.V MMA (the row sum l uses the unrounded f32 P); fp8 -> 16-bit is
// exact; the final o is rounded once to the activation type (round to nearest even); exp2 via
// ex2.approx (rel. error ~2^-22); soft-cap uses the accurate tanhf.
#pragma once

#include "backends/cuda/attention/attention_plan.h"
#include "backends/cuda/attention/output_store.cuh"
#include "backends/cuda/common/async_primitives.cuh"
#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/value_isolation.cuh"

namespace pagedattn::cuda {

// An e4m3 query (p.query_fp8: q8 = q / q_scale, q_scale folded into p.scale) into shared memory
// as T, for the CTA-wide Q loaders: `count` chunks of 8 elements; chunk i reads element offset
// `elem` of p.query when src(i, elem) is true (else zeros) and is stored at dst(i). The 8-byte
// loads go out 4 at a time before their exact conversions and stores (a thread waits about
// count / (4 x threads) load latencies, once per item); the barrier that waits for the item's
// first K/V copies covers the stores.
template <typename T, class Src, class Dst>
__device__ __forceinline__ void load_q8_rows(const AttentionKernelParams& p, int count, Src src, Dst dst) {
  const uint8_t* q = static_cast<const uint8_t*>(p.query);
  for (int base = threadIdx.x; base < count; base += 4 * kThreadsPerCta) {
    uint2 raw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * kThreadsPerCta;
      int64_t elem = 0;
      raw[u] = i < count && src(i, elem) ? *reinterpret_cast<const uint2*>(q + elem) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * kThreadsPerCta;
      if (i < count) *reinterpret_cast<uint4*>(dst(i)) = fp8x8_to_16bit<T>(raw[u], 1);
    }
  }
}

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
  // Decode pipeline step: one 64-key tile, or for direct fp8 the tiles that make the bytes of a
  // 16-bit d 128 tile (32 KB) and pay its fixed costs once: two at D = 128 (32 keys a warp), four
  // at D = 64 (64 keys a warp: one tile each). Those steps stage rows D bytes apart with their
  // 16-byte chunks swizzled (swizzled_chunk: conflict-free fragment loads without padding, so
  // that the decode-only kernel's 3 stages fit 2 CTAs an SM); other fp8 rows are D + 16 bytes apart.
  static constexpr int kDecodeStepTiles = !kDecodeDirectFp8 ? 1 : D == 128 ? 2 : D == 64 ? 4 : 1;
  static constexpr bool kDecodeSwizzled = kDecodeStepTiles > 1;
  static constexpr int kDecodeRawRowBytes = kDecodeSwizzled ? D : kRawRowBytes;
  static constexpr int kDecodeTileBytes = kFp8 ? 2 * kKeysPerTile * kDecodeRawRowBytes : kStageBytes;  // K + V
  static constexpr int kDecodeStepBytes = kDecodeStepTiles * kDecodeTileBytes;
  // Unified kernel: 3 steps (fp8 one-tile steps: 4, as they are half as large).
  static constexpr int kDecodeStages = kFp8 && kDecodeStepTiles == 1 ? 4 : 3;
  static constexpr int kMergeRowStride = D + 8;          // floats, decode merge buffer
  static constexpr int kMergeBytes = 4 * kDecodeRows * (kMergeRowStride + 2) * 4;
  static constexpr int kPrefillSmem =
      kPrefillRows * kRowStride * 2 + kPrefillStages * kStageBytes + kConvertedBytes;
  static constexpr int kDecodeSmem =
      kDecodeRows * kRowStride * 2 + kDecodeStages * kDecodeStepBytes + kDecodeConvertedBytes;
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

// Whether the key tile [key0, key0 + n) holds a key that some row of the item cannot see: the tile
// then takes the logit mask (transform_scores) and the NaN isolation of its values.
__device__ __forceinline__ bool tile_masked(const ItemContext& ctx, int key0, int n) {
  return key0 < ctx.lo_max || key0 + n - 1 > ctx.hi_min;
}
// Its keys that some rows see and others not (value_isolation.cuh): inside the item's range, below
// lo_max or past hi_min.
__device__ __forceinline__ PartlyVisibleKeys tile_partly_visible(const ItemContext& ctx, int key0, int n) {
  return partly_visible_keys(key0, n, ctx.item.kv_start, ctx.item.kv_end, ctx.lo_max, ctx.hi_min);
}

// ctx.lo_max / hi_min of the item's rows, packed `group` to a token.
__device__ __forceinline__ void set_row_visibility(const AttentionKernelParams& p, ItemContext& ctx, int group) {
  const WorkItem& item = ctx.item;
  const int context = item.seq_len - item.query_len;
  const int first_pos = context + item.row_start / group;
  const int last_pos = context + (item.row_start + item.num_rows - 1) / group;
  ctx.lo_max = max(item.kv_start, first_visible(p, last_pos));
  ctx.hi_min = min(item.kv_end - 1, last_visible(p, first_pos, item.seq_len));
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
  set_row_visibility(p, ctx, p.group_size);
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
  __device__ __forceinline__ bool sees(int key) const { return key >= lo && key <= hi; }
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

// The factor that takes raw scores to base-2 logits when no general transform runs:
// scale * k_scale * log2(e) (folded into the exp's FFMA).
__device__ __forceinline__ float plain_logit_factor(const ItemContext& ctx) { return ctx.qk_scale * kLog2e; }

// Prepares a tile of raw scores for the softmax and returns the factor that takes them to
// base-2 logits: the general path (soft-cap / ALiBi) transforms in place and returns 1; the fast
// path leaves them raw and returns plain_logit_factor.
// Masked keys become -inf either way.
// s[j][e]: n8 tile j, element e (rows[e >> 1], key key0 + j * 8 + 2 * quad_col + (e & 1)).
template <int NT>
__device__ __forceinline__ float transform_scores(float (&s)[NT][4], const AttentionKernelParams& p,
                                                  const ItemContext& ctx, const RowRange (&rows)[2],
                                                  int first_local_row, int key0, bool general,
                                                  bool masked) {
  const int quad_col = threadIdx.x & 3;
  float factor = plain_logit_factor(ctx);
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
        if (!rows[e >> 1].sees(key)) s[j][e] = neg_inf();
      }
    }
  }
  return factor;
}


// ---- online softmax --------------------------------------------------------------------------

// The online softmax of one thread's row, in two parts (online_softmax_row runs both): s[j][2*half
// + e] are the thread's NT*2 scores of the row, base-2 logits after multiplying by `factor` (> 0;
// masked ones are -inf).
// Part 1: the row's new running maximum (over the quad) and the exponent base; returns the row's
// correction e^(m_old - m_new) for its O (rescale_o): exactly 1 when the maximum did not move.
template <int NT>
__device__ __forceinline__ float softmax_row_max(const float (&s)[NT][4], int half, float factor, float& m,
                                                 float& base) {
  float mx = neg_inf();
#pragma unroll
  for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx * factor);
  base = m_new == neg_inf() ? 0.f : m_new;
  const float correction = fast_exp2(m - base);
  m = m_new;
  return correction;
}
// Part 2: the scores become P = 2^(s * factor - base); l = l * correction + their sum.
// kFmaPer8: of every 8 score tiles, the first kFmaPer8 take their exponentials on the FMA pipe
// (fma_exp2), the rest on the multi-function unit.
template <int NT, int kFmaPer8 = 0>
__device__ __forceinline__ void softmax_row_exp(float (&s)[NT][4], int half, float factor, float base,
                                                float correction, float& l) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if ((j & 7) < kFmaPer8) {
      s[j][2 * half] = fma_exp2(fmaf(s[j][2 * half], factor, -base));
      s[j][2 * half + 1] = fma_exp2(fmaf(s[j][2 * half + 1], factor, -base));
    } else {
      s[j][2 * half] = fast_exp2(fmaf(s[j][2 * half], factor, -base));
      s[j][2 * half + 1] = fast_exp2(fmaf(s[j][2 * half + 1], factor, -base));
    }
    sum += s[j][2 * half] + s[j][2 * half + 1];
  }
  l = l * correction + sum;
}
// Updates (m, l) of one thread's row with a tile of scores, which become P; returns the row's
// correction for its O.
template <int NT>
__device__ __forceinline__ float online_softmax_row(float (&s)[NT][4], int half, float factor, float& m, float& l) {
  float base;
  const float correction = softmax_row_max<NT>(s, half, factor, m, base);
  softmax_row_exp<NT>(s, half, factor, base, correction, l);
  return correction;
}

// O *= the corrections of the thread's two rows (o[d][0..1]: row r, o[d][2..3]: row r + 8),
// unconditionally: in a branch-free loop body the multiplies fill the exponentials' issue gaps.
template <int DT>
__device__ __forceinline__ void rescale_o_always(float (&o)[DT][4], float c0, float c1) {
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    o[d][0] *= c0;
    o[d][1] *= c0;
    o[d][2] *= c1;
    o[d][3] *= c1;
  }
}

// The same, skipped (warp-uniformly) when no row of the warp got a new maximum: after the first
// tiles the common case, which saves D/4 multiplies a thread and tile.
template <int DT>
__device__ __forceinline__ void rescale_o(float (&o)[DT][4], float c0, float c1) {
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) rescale_o_always(o, c0, c1);
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Natural-log LSE from the base-2 state (m, l summed over the quad; lse_base2).
__device__ __forceinline__ float lse_from_state(float m, float l) { return lse_base2<true>(m, l); }

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

}  // namespace pagedattn::cuda
