// K/V and Q tile copies of the mma.sync paths (the decode path, decode_path.cuh, and the mma.sync
// prefill path, prefill_mma.cuh).
//
// Keys stream through shared memory in tiles of 64 (cp.async 16-byte copies, zero-filled outside
// the item's range; the page id of the next tile is fetched one iteration ahead). 2 to 8
// adjacent threads copy one key row, each at least two 16-byte chunks of it (TileCopy: 256-byte
// rows 8 threads, whole 128-byte lines of 4 rows per warp request; 128-byte rows 4). Shared rows
// are padded by 16 bytes (conflict-free ldmatrix for every head size here). Equal head sizes take
// unpredicated copies (a launch-uniform branch); a narrower head_size_qk / head_size_v zero-fills
// the chunks past it.
// fp8 caches: raw fp8 tiles are staged (rows D + 16 bytes apart); the prefill paths and the
// decode path at D % 32 != 0 convert a staged tile (exactly) to the activation type in shared
// memory (convert_kv_tile); the decode path at D % 32 == 0 reads the raw rows directly.
//
// Memory traffic: each KV byte of an item's range once (plus the zero-filled tile edges), Q once
// per item.
#pragma once

#include "backends/cuda/attention/paged_attention_common.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

// Page id of key position `pos` of a paged cache from the block table, or -1 when the table holds
// an id outside the cache (the row then reads as zeros).
__device__ __forceinline__ int cache_page(const AttentionKernelParams& p, const ItemContext& ctx, int pos) {
  const int block = __ldg(p.block_table + ctx.item.request * p.block_table_stride + page_index(p, ctx, pos));
  return block >= 0 && block < p.num_blocks ? block : -1;
}

// Byte offsets of key position `pos` (head g) in K and V; the page id comes from `block`.
struct KVRowOffsets {
  int64_t k, v;
};
// heads_per_item: 2 for a kv-head pair (kItemPairedHeads: the pair's first head, 2 kv_head).
__device__ __forceinline__ KVRowOffsets kv_row_offsets(const AttentionKernelParams& p,
                                                       const ItemContext& ctx, int pos, int block,
                                                       int elem_bytes, int heads_per_item = 1) {
  KVRowOffsets o;
  const int g = ctx.item.kv_head * heads_per_item;
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

// The V row of key position `pos` (in the item's range) read from global memory, element by
// element as the MMAs take it (fp8: decoded, before v_scale), as float: the exact P . V path of
// value_isolation.cuh (pv_visible_keys' row(key)). Dims past head_size_v read 0 (as the
// zero-filled tile columns), and so does a row whose page id is outside the cache (as the
// copies). kPaired (kItemPairedHeads): dims [0, head_size_v) are kv head 2 kv_head's, the next
// head_size_v the second head's.
template <typename T, bool kPaired = false>
struct CacheValueRow {
  const char* row;  // nullptr: zeros
  int64_t second;   // bytes from the first head's row to the second's (kPaired)
  int head_size_v, format;
  __device__ __forceinline__ float operator()(int dim) const {
    if (row == nullptr) return 0.f;
    const char* src = row;
    if (kPaired && dim >= head_size_v) {
      src += second;
      dim -= head_size_v;
    }
    if (dim >= head_size_v) return 0.f;
    if (format == 1) return to_f32(reinterpret_cast<const __nv_fp8_e4m3*>(src)[dim]);
    if (format == 2) return to_f32(reinterpret_cast<const __nv_fp8_e5m2*>(src)[dim]);
    return to_f32(reinterpret_cast<const T*>(src)[dim]);
  }
};
template <typename T, bool kPaired = false>
__device__ __forceinline__ CacheValueRow<T, kPaired> cache_value_row(const AttentionKernelParams& p,
                                                                     const ItemContext& ctx, int pos) {
  const int elem_bytes = p.fp8_format != 0 ? 1 : 2;
  CacheValueRow<T, kPaired> r{nullptr, p.v_head_stride * elem_bytes, p.head_size_v, p.fp8_format};
  const int block = p.paged ? cache_page(p, ctx, pos) : 0;
  if (block < 0) return r;
  r.row = static_cast<const char*>(p.value) + kv_row_offsets(p, ctx, pos, block, elem_bytes, kPaired ? 2 : 1).v;
  return r;
}

// Copy mapping of a K/V tile: kThreadsPerRow adjacent threads copy one key row, each at least 2
// of its 16-byte chunks (chunk lane + k * kThreadsPerRow), up to 8 threads (a 128-byte line per
// row and instruction); rows tid / kThreadsPerRow + i * kRowStep. Each thread owns
// kRowsPerThread rows of every tile, and each row costs a page lookup and its address arithmetic:
// 128-byte rows (fp8 at D = 128, 16-bit at D = 64) take 4 threads a row and 2 rows a thread (8
// threads and 4 rows ran fp8 decode and the d 64 mixed batch slower); 256-byte rows keep 8
// threads (4 threads, i.e. half lines per instruction, ran bf16 decode at d 128 slower). Figures:
// docs/perf/cuda.md.
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
      blocks[i] = cache_page(p, ctx, pos);
    }
  }
}

// The chunk where 16-byte chunk `chunk` of row `row` sits in a tile of unpadded kRowBytes rows
// whose chunks are swizzled (the decode path's multi-tile fp8 steps): chunk ^ (row & 7) for
// 128-byte rows, chunk ^ ((row >> 1) & 3) for 64-byte rows. Either way the fragment loads of
// decode_path.cuh (16-byte K loads of 8 rows, V loads of rows 2c + {0, 1, 8, 9}) hit distinct bank
// groups.
template <int kRowBytes>
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "swizzled staging: 64- or 128-byte rows");
  if constexpr (kRowBytes == 128) return chunk ^ (row & 7);
  return chunk ^ ((row >> 1) & 3);
}

// Issues the copies of K and V tile `tile` into a stage. 16-bit: rows of kRowStride elements;
// fp8: raw rows of D bytes, kRawRowBytes apart, or (kSwizzle: the decode path's multi-tile steps,
// D = 64 or 128) D bytes apart with their chunks swizzled (swizzled_chunk). kNarrow
// (head_size_qk or head_size_v < D): the chunks past a row's k_chunks / v_chunks are zero-filled
// (no global read). kPaired (kItemPairedHeads, D = 2 x the layer's head size): a staged row is the
// rows of heads 2 kv_head and 2 kv_head + 1 side by side (its second half read a head stride on).
template <class Tr, bool kFp8, bool kNarrow, bool kSwizzle = false, bool kPaired = false>
__device__ __forceinline__ void load_kv_tile_rows(const AttentionKernelParams& p, const ItemContext& ctx,
                                                  int tile, const int (&blocks)[TileCopy<Tr, kFp8>::kRowsPerThread],
                                                  char* stage, int k_chunks, int v_chunks) {
  using C = TileCopy<Tr, kFp8>;
  static_assert(!kSwizzle || (kFp8 && (Tr::kRawChunks == 8 || Tr::kRawChunks == 4)), "swizzled staging: fp8 rows of 64 or 128 bytes");
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  constexpr int kRowBytes = kSwizzle ? Tr::kRawChunks * 16 : kFp8 ? Tr::kRawRowBytes : Tr::kRowStride * 2;
  constexpr int kTileBytes = kKeysPerTile * kRowBytes;
  const int lane_chunk = threadIdx.x % C::kThreadsPerRow;
#pragma unroll
  for (int i = 0; i < C::kRowsPerThread; ++i) {
    const int row = C::row(i);
    if (row >= kKeysPerTile) continue;
    const int pos = ctx.tile_base + tile * kKeysPerTile + row;
    const bool valid = pos >= ctx.item.kv_start && pos < ctx.item.kv_end && blocks[i] >= 0;
    const KVRowOffsets off =
        kv_row_offsets(p, ctx, valid ? pos : ctx.item.kv_start, blocks[i], kElemBytes, kPaired ? 2 : 1);
    const char* k_src = static_cast<const char*>(p.key) + (valid ? off.k : 0);
    const char* v_src = static_cast<const char*>(p.value) + (valid ? off.v : 0);
    // Byte offset of source chunk c in its row (kPaired: the second head's half a head stride on).
    const auto src = [&](int c, int64_t head_stride) {
      if constexpr (kPaired) {
        constexpr int kHalf = C::kChunks / 2;
        return c < kHalf ? int64_t{c} * 16 : (c - kHalf) * 16 + head_stride * kElemBytes;
      } else {
        return c * 16;
      }
    };
    char* k_dst = stage + row * kRowBytes;
    char* v_dst = stage + kTileBytes + row * kRowBytes;
#pragma unroll
    for (int k = 0; k < C::kChunksPerThread; ++k) {
      const int c = lane_chunk + k * C::kThreadsPerRow;
      int dst_c = c;
      if constexpr (kSwizzle) dst_c = swizzled_chunk<kRowBytes>(row, c);
      cp_async_16(k_dst + dst_c * 16, k_src + src(c, p.k_head_stride), kNarrow ? valid && c < k_chunks : valid);
    }
#pragma unroll
    for (int k = 0; k < C::kChunksPerThread; ++k) {
      const int c = lane_chunk + k * C::kThreadsPerRow;
      int dst_c = c;
      if constexpr (kSwizzle) dst_c = swizzled_chunk<kRowBytes>(row, c);
      cp_async_16(v_dst + dst_c * 16, v_src + src(c, p.v_head_stride), kNarrow ? valid && c < v_chunks : valid);
    }
  }
}

// Equal head sizes (head_size_qk == head_size_v == D) take the unpredicated copies: the branch
// is uniform over the launch.
template <class Tr, bool kFp8, bool kSwizzle = false, bool kPaired = false>
__device__ __forceinline__ void load_kv_tile(const AttentionKernelParams& p, const ItemContext& ctx, int tile,
                                             const int (&blocks)[TileCopy<Tr, kFp8>::kRowsPerThread],
                                             char* stage) {
  constexpr int kD = Tr::kDTiles * 8;
  if constexpr (kPaired) {  // two whole rows of head_size_qk == head_size_v == D / 2
    load_kv_tile_rows<Tr, kFp8, false, kSwizzle, true>(p, ctx, tile, blocks, stage, 0, 0);
  } else if (p.head_size_qk == kD && p.head_size_v == kD) {
    load_kv_tile_rows<Tr, kFp8, false, kSwizzle>(p, ctx, tile, blocks, stage, 0, 0);
  } else {
    constexpr int kElemsPerChunk = kFp8 ? 16 : 8;
    load_kv_tile_rows<Tr, kFp8, true, kSwizzle>(p, ctx, tile, blocks, stage, p.head_size_qk / kElemsPerChunk,
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
// past head_size_qk): cp.async for a 16-bit query, converting loads for an e4m3 one.
template <class Tr, typename T>
__device__ __forceinline__ void load_q_tile(const AttentionKernelParams& p, const ItemContext& ctx,
                                            int rows, T* q_smem) {
  const int q_chunks = p.head_size_qk / 8;
  if (p.query_fp8) {
    load_q8_rows<T>(
        p, rows * Tr::kChunks,
        [&](int idx, int64_t& elem) {
          const int row = idx / Tr::kChunks, c = idx - row * Tr::kChunks;
          if (row >= ctx.item.num_rows || c >= q_chunks) return false;
          elem = row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride + c * 8;
          return true;
        },
        [&](int idx) {
          const int row = idx / Tr::kChunks;
          return q_smem + row * Tr::kRowStride + (idx - row * Tr::kChunks) * 8;
        });
    return;
  }
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

// kItemPairedHeads (D = 2 x the layer's head size): row r, a query head of the pair's half
// ((row_start + r) % 2G) / G, holds its query in columns [half D/2, (half + 1) D/2) of the
// D-wide tile and zeros in the other half, so that Q . K^T over the pair's 128-byte rows is each
// row's own head's dot product.
template <class Tr, typename T>
__device__ __forceinline__ void load_q_tile_paired(const AttentionKernelParams& p, const ItemContext& ctx,
                                                   T* q_smem) {
  constexpr int kHalfChunks = Tr::kChunks / 2;
  const auto source = [&](int idx, int64_t& elem) {
    const int row = idx / Tr::kChunks, c = idx - row * Tr::kChunks;
    if (row >= ctx.item.num_rows) return false;
    const int half = ((ctx.item.row_start + row) % ctx.group_size) / p.group_size;
    if (c / kHalfChunks != half) return false;
    elem = row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride + (c - half * kHalfChunks) * 8;
    return true;
  };
  const auto destination = [&](int idx) {
    const int row = idx / Tr::kChunks;
    return q_smem + row * Tr::kRowStride + (idx - row * Tr::kChunks) * 8;
  };
  if (p.query_fp8) {
    load_q8_rows<T>(p, kDecodeRows * Tr::kChunks, source, destination);
    return;
  }
  for (int idx = threadIdx.x; idx < kDecodeRows * Tr::kChunks; idx += kThreadsPerCta) {
    int64_t elem = 0;
    const bool valid = source(idx, elem);
    cp_async_16(destination(idx), static_cast<const T*>(p.query) + (valid ? elem : 0), valid);
  }
}

}  // namespace pagedattn::cuda
