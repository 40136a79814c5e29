// The warp-specialized kernel's producer warpgroup (paged_attention_ws.cuh): the Q copies, the K/V
// copier (page ids read two tiles ahead, the fast path for the usual cache), the fp8 V^T writes it
// owes (WsTransposer, ws_fp8.cuh), and one item's production.
#pragma once

#include "backends/cuda/attention/ws_fp8.cuh"
#include "backends/cuda/attention/ws_pipeline.cuh"

namespace pagedattn::cuda {

// Producer: copies of one item's query rows (zero rows past the item) into a Q buffer. A thread
// takes rows pt / 8 + 16 i and their chunks pt % 8 + 8 k, so each row's token and head (integer
// divisions by the group size) are computed once per row, not per 16-byte chunk as in the wgmma
// path's load_q_swizzled (which, reused here, slowed prefill and the mixed batch:
// docs/perf/cuda.md). kQElemBytes 2: a 16-bit query; 1: an e4m3 query (the 8-bit kernel with
// p.query_fp8) copied as its bytes, 16-byte chunk j (elements 16 j ..) where the 16-bit layout
// keeps its chunk j (ws_q8_words reads them).
template <int D, int kQElemBytes>
__device__ __forceinline__ void ws_load_q(const AttentionKernelParams& p, const ItemContext& ctx, char* q_smem,
                                          int pt) {
  using W = WsTraits<D>;
  constexpr int kChunksPerThread = D * kQElemBytes / 128;  // 16-byte chunks of a row, 8 threads a row
  const int lane_chunk = pt & 7;
#pragma unroll 1
  for (int row = pt >> 3; row < W::kRows; row += 16) {
    const bool valid = row < ctx.item.num_rows;
    const char* src = static_cast<const char*>(p.query);
    if (valid) src += (row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride) * kQElemBytes;
#pragma unroll
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int c = lane_chunk + 8 * k;
      cp_async_16(q_smem + (row >> 6) * W::kQTileBytes + swizzled_offset<64>(row & 63, c), src + c * 16, valid);
    }
  }
}

// Producer: the K/V rows of one thread. Thread pt copies rows pt / 8 + 16 i (i < 8) of every tile,
// 16-byte chunks pt % 8 + 8 k: a warp request covers whole 128-byte lines of 4 rows. Per item the
// thread's source bases (head and chunk offsets folded in) and 32-bit byte strides are set once
// (the builder picks this kernel only for caches whose strides fit 32 bits and forward checks
// the tensors' own: ws_strides_fit); per row the address is a 32-bit multiply and one 32 x 32 ->
// 64-bit multiply-add per K and V, the destination an immediate offset (row i is 2 KB further;
// rows pt / 8 + 16 i share a swizzle).
// The page ids of a tile are read two tiles ahead and checked only when copied, so the block-table
// load (about a DRAM latency when the copies saturate the memory) never stalls the producer (with
// the load consumed one tile after it was issued, the producer's tile rate fell by half:
// docs/perf/cuda.md).
// Invalid rows (outside the item's range, ids outside the cache) copy zeros from a row of page 0.
// Parts of a tile WsKvCopier::copy issues.
inline constexpr int kCopyK = 1;
inline constexpr int kCopyV = 2;
inline constexpr int kCopyKV = kCopyK | kCopyV;

template <class W>
struct WsKvCopier {
  static constexpr int kRows = W::kRowsPerThread;
  static constexpr int kE = W::kElemBytes;
  const char* k_base;
  int64_t kv_delta;      // V source - K source (bytes)
  const int32_t* table;  // the request's block-table row; nullptr: not paged
  uint32_t k_block, k_token;  // byte strides (V's are read from p: the general path only)
  uint32_t num_blocks;   // ids >= this read as zeros
  uint32_t mask;         // block_size - 1 (fast path)
  int shift;             // log2(block_size) (fast path)
  int row0;
  int dst0;              // byte offset of row row0, chunk pt % 8, in a K tile
  int cur[kRows];        // page ids (paged; 0 not paged) of the tile to copy; -1: zeros
  int ahead[kRows];      // those of the tile after it (loads in flight)

  __device__ __forceinline__ void begin_item(const AttentionKernelParams& p, const ItemContext& ctx, int pt) {
    const int lane_chunk = pt & 7;
    row0 = pt >> 3;
    dst0 = swizzled_offset<W::kKeys>(row0, lane_chunk);
    k_base = static_cast<const char*>(p.key) + static_cast<int64_t>(ctx.item.kv_head) * p.k_head_stride * kE + lane_chunk * 16;
    const char* v_base =
        static_cast<const char*>(p.value) + static_cast<int64_t>(ctx.item.kv_head) * p.v_head_stride * kE + lane_chunk * 16;
    if (p.paged) {
      table = p.block_table + ctx.item.request * p.block_table_stride;
      k_block = static_cast<uint32_t>(p.k_block_stride * kE);
    } else {  // rows of the current K/V: token query_start + position
      k_base += static_cast<int64_t>(ctx.item.query_start) * p.k_token_stride * kE;
      v_base += static_cast<int64_t>(ctx.item.query_start) * p.v_token_stride * kE;
      table = nullptr;
      k_block = 0;
    }
    kv_delta = v_base - k_base;
    k_token = static_cast<uint32_t>(p.k_token_stride * kE);
    num_blocks = p.paged ? static_cast<uint32_t>(min(p.num_blocks, static_cast<int64_t>(0x7fffffff))) : 0x7fffffffu;
    shift = ctx.block_shift;
    mask = static_cast<uint32_t>(p.block_size - 1);
  }
  // Paged, power-of-two pages, K and V with the same strides (the usual cache): the fast path.
  __device__ __forceinline__ static bool fast_path(const AttentionKernelParams& p, const ItemContext& ctx) {
    return p.paged && ctx.block_shift >= 0 && p.k_block_stride == p.v_block_stride &&
           p.k_token_stride == p.v_token_stride;
  }

  // Reads the page ids of the rows of the tile at key0 into `ahead` (not waited for: only copy()
  // looks at them, one tile later). Fast path: branch-free (the position clamped into the item's
  // range, so the table read stays inside the request's row).
  template <bool kFast>
  __device__ __forceinline__ void fetch(const AttentionKernelParams& p, const ItemContext& ctx, int key0) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int pos = key0 + row0 + 16 * i;
      const bool in_range = pos >= ctx.item.kv_start && pos < ctx.item.kv_end;
      if constexpr (kFast) {
        const int clamped = min(max(pos, ctx.item.kv_start), ctx.item.kv_end - 1);
        const int id = __ldg(table + (clamped >> shift));
        ahead[i] = in_range ? id : -1;
      } else {
        ahead[i] = in_range ? 0 : -1;
        if (table != nullptr && in_range) ahead[i] = __ldg(table + page_index(p, ctx, pos));
      }
    }
  }
  // The ahead ids become the current ones; the ids of the tile at key0 (when `more`) are read.
  template <bool kFast>
  __device__ __forceinline__ void shift_ids(const AttentionKernelParams& p, const ItemContext& ctx, int key0,
                                            bool more) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) cur[i] = ahead[i];
    if (more) fetch<kFast>(p, ctx, key0);
  }

  // Issues the copies of the K tile, the V tile or both (kParts) of the fetched tile at key0 into
  // a stage ([K tile][V tile]; fp8: V rows into v_staging, ws_staging_offset). The row's position
  // in its page: pos & (block_size - 1) for power-of-two pages (a uniform branch). Fast path: V's
  // offset is K's (same strides), no branch.
  template <bool kFast, int kParts>
  __device__ __forceinline__ void copy(const AttentionKernelParams& p, const ItemContext& ctx, int key0,
                                       char* stage, char* v_staging = nullptr) const {
    const bool pow2 = ctx.block_shift >= 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int pos = key0 + row0 + 16 * i;
      const bool valid = static_cast<uint32_t>(cur[i]) < num_blocks;  // -1 and ids outside the cache: zeros
      const uint32_t block = valid ? static_cast<uint32_t>(cur[i]) : 0u;
      const char* k_src;
      const char* v_src;
      if constexpr (kFast) {
        const uint32_t row = static_cast<uint32_t>(pos) & mask;
        k_src = k_base + (static_cast<uint64_t>(block) * k_block + static_cast<uint64_t>(row) * k_token);
        v_src = k_src + kv_delta;
      } else {
        uint32_t row;  // token within the page (paged) or position (not paged)
        if (table == nullptr) {
          row = valid ? static_cast<uint32_t>(pos) : 0u;
        } else if (pow2) {
          row = static_cast<uint32_t>(pos) & mask;
        } else {
          row = static_cast<uint32_t>(pos - page_index(p, ctx, pos) * p.block_size);
        }
        k_src = k_base + (static_cast<uint64_t>(block) * k_block + static_cast<uint64_t>(row) * k_token);
        const uint32_t v_block = p.paged ? static_cast<uint32_t>(p.v_block_stride * kE) : 0u;
        const uint32_t v_token = static_cast<uint32_t>(p.v_token_stride * kE);
        v_src = k_base + kv_delta + (static_cast<uint64_t>(block) * v_block + static_cast<uint64_t>(row) * v_token);
      }
      char* dst = stage + dst0 + i * 16 * 128;
      // fp8: the staging swizzle flips chunk bit 0 on odd rows / 16 (ws_staging_offset; one column
      // block).
      char* v_dst = W::kE4m3 ? v_staging + ((dst0 + i * 16 * 128) ^ ((i & 1) << 4)) : dst + W::kKvTileBytes;
#pragma unroll
      for (int k = 0; k < W::kChunksPerThread; ++k) {
        if constexpr ((kParts & kCopyK) != 0) cp_async_16(dst + k * W::kKeys * 128, k_src + k * 128, valid);
        if constexpr ((kParts & kCopyV) != 0) cp_async_16(v_dst + k * W::kKeys * 128, v_src + k * 128, valid);
      }
    }
  }
};

// fp8 producer: the V^T writes it owes, for the tiles `written` .. `copied` - 1 (indices over the
// CTA's tiles, all items; tile g sits in stage g % kStages, its V rows in staging slot
// g % kStagingSlots). One cp.async group a tile (its K and V copies).
template <class W>
struct WsTransposer {
  int copied = 0;
  int written = 0;
  __device__ __forceinline__ static char* slot(char* smem, int g) {
    return smem + W::kStagingOffset + (g % W::kStagingSlots) * W::kKvTileBytes;
  }
  // V^T of the oldest owed tile, whose copies this thread has waited for: the named barrier tells
  // that every producer thread's have landed and that every thread is done with the slots read
  // before (so a slot is refilled only two writes after it was read: kStagingSlots = kVLag + 2).
  __device__ __forceinline__ void write_oldest(char* smem, const WsBarriers<W>& bars, int pt) {
    named_barrier::sync<128>(2);
    const int stage = written % W::kStages;
    ws_transpose_v<W::kHeadSize, W::kKeys>(slot(smem, written),
                                           smem + W::kStagesOffset + stage * W::kStageBytes + W::kKvTileBytes, pt);
    wgmma::fence_async_smem();
    mbar::arrive(bars.full(stage, false));
    ++written;
  }
  // After a tile's copies were issued and committed: the write kVLag tiles behind them.
  __device__ __forceinline__ void after_copy(char* smem, const WsBarriers<W>& bars, int pt) {
    if (++copied - written > W::kVLag) {
      cp_async_wait<W::kVLag>();
      write_oldest(smem, bars, pt);
    }
  }
  // Every write owed for tiles before `first` (the newest copied - first groups may stay in flight).
  __device__ __forceinline__ void write_before(char* smem, const WsBarriers<W>& bars, int pt, int first) {
    static_assert(W::kVLag <= 2);
    if (written >= first) return;
    if (copied - first >= 1) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    while (written < first) write_oldest(smem, bars, pt);
  }
};

// Producer: one item's tiles (Q first), the copier's fast or general path. fp8 (W::kE4m3): each
// tile's K and V copies go out together, V into a staging slot; its V^T is written kVLag tiles
// later (WsTransposer). Before it waits for the Q buffer (freed when the consumers start the
// previous item) it writes what it owes for the items before the previous one, which the
// consumers must finish first (at D = 256, where the Q buffer frees after the previous item's
// last S, all it owes).
template <class W, typename T, bool kFast>
__device__ __forceinline__ void ws_produce_item(const AttentionKernelParams& p, const ItemContext& ctx,
                                                WsKvCopier<W>& copier, char* smem, const WsBarriers<W>& bars,
                                                RingPos& ring, int n, int pt, WsTransposer<W>& vt,
                                                int& prev_first_tile) {
  char* stages = smem + W::kStagesOffset;
  const WsTiles tiles = ws_tiles(ctx, W::kKeys);
  const int qb = n % W::kQBuffers;
  if (tiles.count > 0) copier.template fetch<kFast>(p, ctx, tiles.base);
  copier.template shift_ids<kFast>(p, ctx, tiles.base + W::kKeys, tiles.count > 1);
  if constexpr (W::kE4m3) {
    // (With the e4m3 Q tile in the Q buffer the consumers free it after the previous item's last
    // S, which waits for that item's last V^T too: everything owed first.)
    vt.write_before(smem, bars, pt, W::kQ8InQBuffer ? vt.copied : prev_first_tile);
    prev_first_tile = vt.copied;
  }
  // Q first: its buffer frees when the consumers have issued the previous item's last S
  // (about a tile before they release its last stages; fp8: when they have read it into
  // registers), so the next item's Q and first tiles land while they finish it.
  mbar::wait(bars.q_empty(qb), ((n / W::kQBuffers) & 1) ^ 1u);
  if (W::kE4m3 && p.query_fp8) {
    ws_load_q<W::kHeadSize, 1>(p, ctx, smem + qb * W::kQBytes, pt);
  } else {
    ws_load_q<W::kHeadSize, 2>(p, ctx, smem + qb * W::kQBytes, pt);
  }
  mbar::arrive_on_copies(bars.q_full(qb));
#pragma unroll 1
  for (int t = 0; t < tiles.count; ++t) {
    const int key0 = tiles.base + t * W::kKeys;
    char* stage = stages + ring.stage * W::kStageBytes;
    mbar::wait(bars.empty(ring.stage, false), ring.phase ^ 1u);  // the whole stage unless split
    if constexpr (W::kE4m3) {
      copier.template copy<kFast, kCopyKV>(p, ctx, key0, stage, vt.slot(smem, vt.copied));
      mbar::arrive_on_copies(bars.full(ring.stage, false));
      cp_async_commit();
      copier.template shift_ids<kFast>(p, ctx, key0 + 2 * W::kKeys, t + 2 < tiles.count);
      vt.after_copy(smem, bars, pt);
    } else {
      copier.template copy<kFast, W::kSplitKv ? kCopyK : kCopyKV>(p, ctx, key0, stage);
      mbar::arrive_on_copies(bars.full(ring.stage, false));
      if constexpr (W::kSplitKv) {
        mbar::wait(bars.empty(ring.stage, true), ring.phase ^ 1u);
        copier.template copy<kFast, kCopyV>(p, ctx, key0, stage);
        mbar::arrive_on_copies(bars.full(ring.stage, true));
      }
      copier.template shift_ids<kFast>(p, ctx, key0 + 2 * W::kKeys, t + 2 < tiles.count);
    }
    ring.template advance<W::kStages>();
  }
}

}  // namespace pagedattn::cuda
