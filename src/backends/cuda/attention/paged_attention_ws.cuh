// Warp-specialized Hopper kernel of the paged attention (AttentionKernel::ws, kernel_selection.h):
// 16-bit caches at head sizes D = 64, 128 and 256, and fp8 e4m3 caches at D = 128 on the 8-bit
// wgmma (kFp8: what changes is in ws_e4m3.cuh), head_size == head_size_v == D, sm_90a. It computes
// exactly what paged_attention_kernel computes for the same plan (attention_plan.h: every work
// item, decode-path or prefill-path, split or not), with one code path for both kinds of item.
//
// CTA: 3 warpgroups, 1 CTA per SM, persistent over the plan's items (the strided schedule of the
// other kernels, odd CTAs walking theirs backwards: ws_for_each_item).
//   producer (warpgroup 0, 40 registers after setmaxnreg, 56 at D = 64): copies with
//            cp.async (16-byte chunks, 8 threads a key row, zero-filled outside the item's key
//            range) the item's packed query rows and its K/V tiles of kKeys keys (128; 64 at
//            D = 256) into a ring of
//            kStages stages; each thread signals a stage's "full" barrier when its own copies
//            have landed (cp.async.mbarrier.arrive.noinc), waits for the "empty" barrier before
//            refilling.
//            Page ids are read two tiles ahead (WsKvCopier). It runs ahead of the consumers across
//            items: a consumer releases the Q buffer as soon as its last S of the item is done,
//            so the next item's Q and first tiles are in flight while the last P . V products run.
//            The usual cache (paged, power-of-two pages, K and V with the same strides) takes a
//            branch-free copy path of about half the instructions, which lifted one SM's decode
//            stream by over a third (the producer's issue rate, not the memory, was the limit: a bare
//            cp.async ring streams several times faster, bench/sm_stream_probe.cu; figures in
//            docs/perf/cuda.md).
//   consumers (warpgroups 1 and 2, 232 / 224 registers): each owns 64 of the item's 128 packed rows
//            (the wgmma M) and sees every key tile; a consumer whose rows see none of a tile's
//            keys (causal tails) only waits for and releases the stage; a warp without live rows
//            skips the softmax. Decode-path items (<= 16 rows): both consumers take the same rows
//            and alternate tiles (consumer wg computes tiles t % 2 == wg); consumer 0 leaves its
//            state (O, m, l) in its last stage and consumer 1 merges it (one named barrier; in
//            two halves of O at D = 256, where the state exceeds a stage).
// Per consumer and tile t of a prefill-path item (FlashAttention-3's in-warpgroup pipelining;
// registers: S kKeys/2, O D/2, P kKeys/4 a thread):
//   issue S_{t+1} = Q . K_{t+1}^T   (wgmma m64n<kKeys>k16, both operands in shared memory, K-major)
//   issue O += P_t . V_t            (wgmma m64nDk16, P from registers, V N-major)
//   wait for S_{t+1}; logit transform / masks (transform_scores) and online softmax of S_{t+1}
//        while P_t . V_t runs on the tensor core;
//   wait for P_t . V_t; release stage t; O *= the correction of t+1; P_{t+1} packed.
// The two consumers run unsynchronized: one's softmax overlaps the other's MMAs too.
// Decode-path items (<= 16 rows, copy-bound) run each tile in order (S, softmax, P . V) and
// release its stage at once, which keeps more stages in flight than the pipelined order (that one
// holds stage t until tile t + 1 has landed); the two consumers' chains overlap.
// Schedule: persistent, strided like the other kernels, odd CTAs walking their items backwards
// (ws_for_each_item), so a mixed batch keeps prefill and decode items on the device together.
//
// Shared memory (1024-byte aligned, every tile 128-byte swizzled as column blocks of rows x 128
// bytes, async_primitives.cuh): kQBuffers x Q (2 x 64 rows x D), kStages x [K tile, V tile] (kKeys
// keys x D each), then the barriers. D = 128: 32 KB + 3 x 64 KB = 224 KB; D = 64: 2 x 16 KB + 4 x
// 32 KB = 160 KB; D = 256: 64 KB + 2 x 64 KB = 192 KB; fp8 D = 128: Q 32 KB + 4 stages x 32 KB +
// 3 V staging slots x 16 KB + 2 e4m3 Q tiles x 8 KB = 224 KB. The decode merge borrows a stage.
//
// Memory traffic and floor: each K/V byte of an item's key range once per item (the GQA group
// packed into the rows, so once per group for decodes), Q and O once; floor = max(KV bytes / copy
// bandwidth, 4 * rows * visible keys * D / MMA rate). A decode item wastes MMA rows (4 live of
// 64) but its tile time is the copy's (a 64 KB tile at an SM's share of the memory bandwidth
// takes about twice the tile's MMA + softmax): still copy-bound. Measured: docs/perf/cuda.md
// (the warp-specialized kernel).
//
// Precision points: as the other paths (f32 logits, softmax state and O; P rounded to the
// activation type for P . V, the row sums from the f32 P; output rounded once); fp8: Q (per row)
// and P rounded to e4m3 instead.
//
// Not sm_90a: the body is a trap and the builder never selects this kernel.
#pragma once

#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/paged_prefill_wgmma.cuh"
#include "backends/cuda/attention/ws_e4m3.cuh"

namespace pagedattn::cuda {

// kFp8: an fp8 e4m3 cache on the 8-bit wgmma (ws_e4m3.cuh): K tiles of D bytes a row, V^T tiles
// of kKeys bytes a row, a staging ring of kStagingSlots V tiles as copied, the 16-bit Q buffer and
// a consumer's e4m3 Q tile (at D = 256 inside the Q buffer: no room beside it).
template <int D, bool kFp8 = false>
struct WsTraits {
  static constexpr bool kSupported = kFp8 ? ws_e4m3_head_size(D) : ws_kernel_head_size(D);
  static constexpr bool kE4m3 = kFp8;
  static constexpr int kHeadSize = D;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;  // K and V in shared memory
  static constexpr int kThreads = 384;
  // Register split, producer + 2 x consumer = 3 x 168 (the launch bound's budget): D = 64's
  // consumers hold half the O registers, so its producer gets 56 (40 spilled its fast copy path);
  // the fp8 producer (V transposes) gets 64, its consumers hold half the P and the Q fragments.
  static constexpr int kProducerRegs = kFp8 ? 64 : D == 64 ? 56 : 40;
  static constexpr int kConsumerRegs = kFp8 ? 216 : D == 64 ? 224 : 232;
  static constexpr int kRows = 128;          // packed rows of an item (64 a consumer)
  // Keys of a tile: 128, or 64 at D = 256, where a consumer's O is 128 registers a thread (S 32 and
  // P 16 then fit beside it) and a tile of 64 keys moves the same 64 KB as 128 keys at D = 128.
  static constexpr int kKeys = D == 256 ? 64 : 128;
  static constexpr int kScoreTiles = kKeys / 8;   // n8 column blocks of S
  static constexpr int kPvSteps = kKeys / (kFp8 ? 32 : 16);  // k16 (k32) steps of P . V
  static constexpr int kColBlocks = D * kElemBytes / 128;   // 128-byte column blocks of a K / V row
  static constexpr int kQTileBytes = D / 64 * 64 * 128;     // one consumer's 64 rows (16-bit)
  static constexpr int kQBytes = 2 * kQTileBytes;
  static constexpr int kKvTileBytes = kColBlocks * kKeys * 128;  // kKeys keys x D (fp8: also V^T, D x kKeys)
  static_assert(!kFp8 || !kSupported || kKvTileBytes == D * kKeys, "the fp8 V^T tile has the K tile's bytes");
  static constexpr int kStageBytes = 2 * kKvTileBytes;
  static constexpr int kQBuffers = D == 64 ? 2 : 1;
  static constexpr int kStages = kFp8 ? (D == 128 ? 4 : 3) : D == 64 ? 4 : D == 128 ? 3 : 2;
  // fp8: V^T of a tile is written kVLag tiles after its copies were issued (their landing waited
  // for then), into a ring of kVLag + 2 staging slots (a slot is refilled two transposes after it
  // was read: ws_produce_item).
  static constexpr int kVLag = 1;
  static constexpr int kStagingSlots = kFp8 ? kVLag + 2 : 0;
  static constexpr int kStagesOffset = kQBuffers * kQBytes;
  static constexpr int kStagingOffset = kStagesOffset + kStages * kStageBytes;
  static constexpr bool kQ8InQBuffer = kFp8 && D == 256;  // else 2 x 64 rows x D after the staging ring
  static constexpr int kQ8Offset = kStagingOffset + kStagingSlots * kKvTileBytes;
  // K and V halves of a stage on barriers of their own (WsBarriers) at D = 256, whose 2 stages
  // otherwise leave the producer no slack; at D = 64 and 128 the second copy pass cost more than
  // the slack won (docs/perf/cuda.md), and a stage is released whole.
  static constexpr bool kSplitKv = D == 256 && !kFp8;
  static constexpr int kBarrierOffset = kQ8Offset + (kFp8 && !kQ8InQBuffer ? 2 * 64 * D : 0);
  static constexpr int kBarriers = (kSplitKv ? 4 : 2) * kStages + 2 * kQBuffers;
  static constexpr int kSmemBytes = kBarrierOffset + kBarriers * 8;
  static_assert(!kSupported || kSmemBytes <= 227 * 1024, "fits an SM's shared memory");
  static constexpr int kChunksPerThread = kColBlocks;  // 16-byte chunks of a row, 8 threads a row
  static constexpr int kRowsPerThread = kKeys / 16;    // 128 producer threads = 16 rows a pass
  // Decode merge (consumer 0's O, m, l through a stage, 4 bytes x 128 threads a value): in one
  // pass, or in halves (quarters) of O where the whole state (D / 2 + 4 values a thread) exceeds a
  // stage.
  static constexpr int kMergePasses = (D / 2 + 4) * 128 * 4 <= kStageBytes   ? 1
                                      : (D / 4 + 4) * 128 * 4 <= kStageBytes ? 2
                                                                             : 4;
  static_assert(!kSupported || (D / 2 / kMergePasses + 4) * 128 * 4 <= kStageBytes, "a merge pass fits a stage");
};


// Per-item tile range of this kernel (tiles of kKeys keys; ItemContext's are of 64).
struct WsTiles {
  int base;
  int count;
};
__device__ __forceinline__ WsTiles ws_tiles(const ItemContext& ctx, int keys) {
  WsTiles t;
  t.base = (ctx.item.kv_start / keys) * keys;
  t.count = ctx.item.kv_end > ctx.item.kv_start ? (ctx.item.kv_end - t.base + keys - 1) / keys : 0;
  return t;
}

// Barriers in shared memory: full / empty per stage, Q full / Q empty per Q buffer. With
// kSplitKv the K tile and the V tile of a stage have barriers of their own (v = false / true): a
// consumer releases K_t as soon as S_t is done, a tile before it releases V_t (P_t . V_t runs
// under the softmax of S_{t+1}), so the producer refills the K half an iteration earlier and each
// half has an iteration more to land than a stage released whole. Without it both halves name
// the stage's one full and one empty barrier, and the consumer waits and releases a stage whole
// (WsStageSync).
template <class W>
struct WsBarriers {
  static constexpr int kS = W::kStages;
  static constexpr bool kSplit = W::kSplitKv;
  static constexpr int kHalves = kSplit ? 2 : 1;
  uint64_t* base;
  __device__ __forceinline__ uint64_t* full(int s, bool v) const { return base + (kSplit && v ? kS : 0) + s; }
  __device__ __forceinline__ uint64_t* empty(int s, bool v) const {
    return base + kHalves * kS + (kSplit && v ? kS : 0) + s;
  }
  __device__ __forceinline__ uint64_t* q_full(int b) const { return base + 2 * kHalves * kS + b; }
  __device__ __forceinline__ uint64_t* q_empty(int b) const {
    return base + 2 * kHalves * kS + W::kQBuffers + b;
  }
};

// A consumer's waits and releases of a stage's halves. Split (kSplitKv): K and V on their own
// barriers. Whole: wait_k waits for the stage, release_v releases it, wait_v and release_k are
// nothing (the same instructions as a kernel without halves).
template <class W>
struct WsStageSync {
  static constexpr bool kSplit = W::kSplitKv;
  WsBarriers<W> bars;
  __device__ __forceinline__ void wait_k(int stage, uint32_t phase) const { mbar::wait(bars.full(stage, false), phase); }
  // V landed (split; nothing otherwise: wait_k waited for the stage). wait_v also orders the
  // copies before the tensor core's reads, for a P . V issued without a wait_k just before.
  __device__ __forceinline__ void wait_v_landed(int stage, uint32_t phase) const {
    if constexpr (kSplit) mbar::wait(bars.full(stage, true), phase);
  }
  __device__ __forceinline__ void wait_v(int stage, uint32_t phase) const {
    if constexpr (kSplit) {
      wait_v_landed(stage, phase);
      __syncwarp();
      wgmma::fence_async_smem();
    }
  }
  __device__ __forceinline__ void release_k(int stage) const {
    if constexpr (kSplit) mbar::arrive(bars.empty(stage, false));
  }
  __device__ __forceinline__ void release_v(int stage) const { mbar::arrive(bars.empty(stage, true)); }
  // A tile the consumer does not compute: wait for it (phase order), release it; skip_rest after
  // wait_k.
  __device__ __forceinline__ void skip_rest(int stage, uint32_t phase) const {
    wait_v_landed(stage, phase);
    release_k(stage);
    release_v(stage);
  }
  __device__ __forceinline__ void skip(int stage, uint32_t phase) const {
    wait_k(stage, phase);
    skip_rest(stage, phase);
  }
};

// Ring position of the pipeline: stage index and the parity of its current use.
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Producer: copies of one item's query rows (zero rows past the item) into a Q buffer. A thread
// takes rows pt / 8 + 16 i and their chunks pt % 8 + 8 k, so each row's token and head (integer
// divisions by the group size) are computed once per row, not per 16-byte chunk as in the wgmma
// path's load_q_swizzled (which, reused here, slowed prefill and the mixed batch:
// docs/perf/cuda.md).
template <int D, typename T>
__device__ __forceinline__ void ws_load_q(const AttentionKernelParams& p, const ItemContext& ctx, char* q_smem,
                                          int pt) {
  using W = WsTraits<D>;
  const int lane_chunk = pt & 7;
#pragma unroll 1
  for (int row = pt >> 3; row < W::kRows; row += 16) {
    const bool valid = row < ctx.item.num_rows;
    const T* src = static_cast<const T*>(p.query);
    if (valid) src += row_token(ctx, row) * p.q_token_stride + row_head(ctx, row) * p.q_head_stride;
#pragma unroll
    for (int k = 0; k < W::kChunksPerThread; ++k) {
      const int c = lane_chunk + 8 * k;
      cp_async_16(q_smem + (row >> 6) * W::kQTileBytes + swizzled_offset<64>(row & 63, c), src + c * 8, valid);
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
  ws_load_q<W::kHeadSize, T>(p, ctx, smem + qb * W::kQBytes, pt);
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

// Phase marks of a consumer warp in the pipelined (prefill-path) loop, for the timeline probe
// (bench/ws_timeline_probe.cu): Trace::mark(event) at the start of an iteration, when its K (and
// V) tiles have landed, when both wgmma groups are issued, when S_{t+1} has landed, after the
// softmax, and when P_t . V_t is done. The shipped kernel's WsNoTrace compiles to nothing.
enum WsMark : int { kWsMarkStart, kWsMarkLanded, kWsMarkIssued, kWsMarkScores, kWsMarkSoftmax, kWsMarkPv, kWsMarks };
struct WsNoTrace {
  __device__ __forceinline__ void mark(int /*event*/) {}
  __device__ __forceinline__ void next() {}
};

// Consumer: one item's 64 rows of this warpgroup (wg = 0 or 1: rows 64 wg ..; decode-path items:
// rows 0.. and every other tile, merged into consumer 1), then its output.
template <int D, typename T, bool kFp8, class Trace = WsNoTrace>
__device__ void ws_consume_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem,
                                const WsBarriers<WsTraits<D, kFp8>>& bars, RingPos& ring, int qb, uint32_t q_phase,
                                int wg, Trace& trace) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using W = WsTraits<D, kFp8>;
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int quad_row = lane >> 2;
  const int quad_col = lane & 3;
  const WsTiles tiles = ws_tiles(ctx, W::kKeys);
  // Decode-path items (<= 16 rows): both consumers take the same rows (Q tile 0) and split the
  // tiles, consumer wg computing tiles t % 2 == wg; consumer 1 merges consumer 0's state at the end.
  const bool decode = (ctx.item.flags & kItemDecodePath) != 0;
  char* q_smem = smem + qb * W::kQBytes + (decode ? 0 : wg) * W::kQTileBytes;
  char* stages = smem + W::kStagesOffset;

  // Tiles this warpgroup computes: a prefix (visibility is monotone in the row position; the
  // last live row of the 64 sees the most).
  const int first_row = decode ? 0 : 64 * wg;
  const int last_row = min(first_row + 63, ctx.item.num_rows - 1);
  const int block_hi = first_row < ctx.item.num_rows ? make_row_range(p, ctx, last_row).hi : -1;
  const int active = block_hi < tiles.base ? 0 : min(tiles.count, (block_hi - tiles.base) / W::kKeys + 1);
  const bool warp_live = first_row + 16 * warp < ctx.item.num_rows;
  // Decode items: consumer 1 writes the rows when both computed tiles (merged), else consumer 0;
  // the writer's state holds the sink.
  const bool writes = !decode || wg == (active >= 2 ? 1 : 0);

  const int r0 = first_row + 16 * warp + quad_row;  // this thread's rows r0, r0 + 8
  RowRange rows[2];
  float m[2], l[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    rows[e] = make_row_range(p, ctx, r0 + 8 * e);
    init_row_state(p, ctx, r0 + 8 * e, writes, m[e], l[e]);
  }
  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  uint32_t pa[W::kPvSteps][4];
#pragma unroll
  for (int ks = 0; ks < W::kPvSteps; ++ks) pa[ks][0] = pa[ks][1] = pa[ks][2] = pa[ks][3] = 0u;
  float s[W::kScoreTiles][4];
  const bool general = p.soft_cap > 0.f || p.alibi_slopes != nullptr;
  // wgmma descriptors of Q and of a stage's K and V tiles, built where they are issued: their
  // start words are broadcast from lane 0 (wgmma::uniform_desc), so a tile's wgmma step them with
  // uniform-register adds (a descriptor kept across the loop lands in ordinary registers, and
  // each wgmma then waits for moves to uniform ones: docs/perf/cuda.md).
  auto q_desc = [&] { return wgmma::uniform_desc(q_smem, 16, 1024); };
  // fp8: this consumer's e4m3 Q; inside the Q buffer at D = 256: over its own 16-bit rows (prefill
  // items), or in the 16-bit tile 1 that decode items leave unread.
  char* q8_tile = !W::kQ8InQBuffer ? smem + W::kQ8Offset + wg * 64 * D
                  : decode         ? smem + qb * W::kQBytes + W::kQTileBytes + wg * 64 * D
                                   : q_smem;
  auto q8_desc = [&] { return wgmma::uniform_desc(q8_tile, 16, 1024); };
  auto k_desc = [&](int stage) { return wgmma::uniform_desc(stages + stage * W::kStageBytes, 16, 1024); };
  // V: N-major 16-bit tile (column blocks kKeys rows apart), or the fp8 V^T tile (K-major, rows of
  // kKeys bytes: 128-byte swizzle, or 64-byte at 64 keys).
  auto v_desc = [&](int stage) {
    char* v = stages + stage * W::kStageBytes + W::kKvTileBytes;
    if constexpr (kFp8 && W::kKeys == 64) return wgmma::uniform_desc(v, 16, 512, wgmma::kSwizzle64B);
    return wgmma::uniform_desc(v, kFp8 ? 16 : W::kKeys * 128, 1024);
  };
  auto issue_s = [&](int stage) {
    if constexpr (kFp8) {
      issue_scores_with<D, wgmma::OpsE4m3, W::kKeys>(s, q8_desc(), k_desc(stage));
    } else {
      issue_scores<D, T, W::kKeys>(s, q_desc(), k_desc(stage));
    }
  };
  auto issue_o = [&](int stage) {
    if constexpr (kFp8) {
      issue_pv_e4m3<D>(o, pa, v_desc(stage));
    } else {
      issue_pv<D, T>(o, pa, v_desc(stage));
    }
  };
  auto pack = [&] {
    if constexpr (kFp8) {
      pack_p_e4m3(s, pa);
    } else {
      pack_p<T>(s, pa);
    }
  };

  mbar::wait(bars.q_full(qb), q_phase);
  __syncwarp();
  wgmma::fence_async_smem();
  // fp8: Q quantised (its rows' scales applied through the softmax's factor) into this consumer's
  // e4m3 tile, after which the Q buffer is free for the next item (unless the e4m3 tile is in it).
  // 16-bit: Q is released after the item's last S.
  float q_row_scale[2] = {1.f, 1.f};
  if constexpr (kFp8) {
    const int qrow = 16 * warp + quad_row;
    uint32_t words[2][D / 16];
    ws_q_amax_e4m3<D, T>(q_smem, qrow, q_row_scale);
    ws_q_convert_e4m3<D, T>(q_smem, qrow, q_row_scale, words);
    if constexpr (W::kQ8InQBuffer) {
      named_barrier::sync<128>(3 + wg);  // the warpgroup has read the rows its e4m3 tile overlays
    } else {
      mbar::arrive(bars.q_empty(qb));
    }
    // (the previous item's S have completed: every S is waited for within its item)
    ws_q_store_e4m3<D>(q8_tile, qrow, words);
    wgmma::fence_async_smem();
    named_barrier::sync<128>(3 + wg);  // the warpgroup's rows stored
  }
  auto release_q = [&] {
    if constexpr (!kFp8 || W::kQ8InQBuffer) mbar::arrive(bars.q_empty(qb));
  };

  // Softmax of the scores of the tile at key0 (in s); returns the corrections of the two rows.
  auto softmax = [&](int key0, float& c0, float& c1) {
    const bool masked = key0 < ctx.lo_max || key0 + W::kKeys - 1 > ctx.hi_min;
    if (kFp8 && general) {  // the general logit transform takes the true dot products
#pragma unroll
      for (int j = 0; j < W::kScoreTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= q_row_scale[e >> 1];
    }
    const float factor = transform_scores<W::kScoreTiles>(s, p, ctx, rows, r0, key0, general, masked);
    const bool row_factor = kFp8 && !general;
    c0 = online_softmax_row<W::kScoreTiles>(s, 0, row_factor ? factor * q_row_scale[0] : factor, m[0], l[0]);
    c1 = online_softmax_row<W::kScoreTiles>(s, 1, row_factor ? factor * q_row_scale[1] : factor, m[1], l[1]);
  };

  const WsStageSync<W> sync{bars};

  // Decode items: consumer 0's last tile (its stage holds consumer 0's state for the merge).
  const int merge_tile = decode && active >= 2 ? ((active - 1) & ~1) : -1;
  const RingPos item_ring = ring;
  if (decode) {
    // Decode items are copy-bound: each stage is released as soon as its tile is done (S, softmax,
    // P . V in order), so the producer keeps the other stages in flight; the pipelined order
    // below holds stage t until tile t + 1 has landed (S_{t+1} is issued with P_t . V_t).
    // The two consumers take alternate tiles: with the fast copy path one consumer's chain of S,
    // softmax and P . V per tile was the next limit of an SM's decode stream (docs/perf/cuda.md),
    // which sets how much a mixed batch can overlap.
    const int own_last = active - 1 - ((active - 1 - wg) & 1);  // < 0: no tile of this consumer
    if (own_last < 0 && active > 0) release_q();  // (active == 0: below)
#pragma unroll 1
    for (int t = 0; t < active; ++t) {
      sync.wait_k(ring.stage, ring.phase);
      if ((t & 1) != wg) {  // the other consumer's tile
        sync.skip_rest(ring.stage, ring.phase);
        ring.template advance<W::kStages>();
        continue;
      }
      __syncwarp();
      wgmma::fence_async_smem();
      wgmma::reg_fence(o);
      wgmma::fence();
      issue_s(ring.stage);
      wgmma::wait<0>();
      wgmma::reg_fence(s);
      if (t != merge_tile) sync.release_k(ring.stage);  // merge_tile: after the merge
      if (t == own_last) release_q();  // its last S: Q may be refilled
      if (warp_live) {
        float c0, c1;
        softmax(tiles.base + t * W::kKeys, c0, c1);
        rescale_o(o, c0, c1);
        pack();
      }
      sync.wait_v(ring.stage, ring.phase);
      wgmma::reg_fence(pa);
      wgmma::reg_fence(o);
      wgmma::fence();
      issue_o(ring.stage);
      wgmma::wait<0>();
      wgmma::reg_fence(o);
      wgmma::reg_fence(pa);
      if (t != merge_tile) sync.release_v(ring.stage);
      ring.template advance<W::kStages>();
    }
  } else {
    if (active > 0) {  // S_0 and P_0
      sync.wait_k(ring.stage, ring.phase);
      __syncwarp();
      wgmma::fence_async_smem();
      wgmma::fence();
      issue_s(ring.stage);
      wgmma::wait<0>();
      wgmma::reg_fence(s);
      sync.release_k(ring.stage);  // K_0 read
      if (active == 1) release_q();  // the only S: Q may be refilled
      if (warp_live) {
        float c0, c1;
        softmax(tiles.base, c0, c1);  // O is zero: no rescale
        pack();
      }
    }
    // Steady state: S_{t+1} and P_t . V_t in flight together, the softmax of S_{t+1} under P_t . V_t.
  #pragma unroll 1
    for (int t = 0; t + 1 < active; ++t) {
      RingPos nxt = ring;
      nxt.template advance<W::kStages>();
      trace.mark(kWsMarkStart);
      sync.wait_k(nxt.stage, nxt.phase);
      sync.wait_v_landed(ring.stage, ring.phase);  // V_t
      trace.mark(kWsMarkLanded);
      __syncwarp();
      wgmma::fence_async_smem();
      wgmma::reg_fence(pa);
      wgmma::reg_fence(o);
      wgmma::fence();
      issue_s(nxt.stage);
      issue_o(ring.stage);
      trace.mark(kWsMarkIssued);
      wgmma::wait<1>();  // S_{t+1} landed; P_t . V_t may still run
      wgmma::reg_fence(s);
      trace.mark(kWsMarkScores);
      sync.release_k(nxt.stage);  // K_{t+1} read
      if (t + 2 == active) release_q();  // that was the last S: Q may be refilled
      float c0 = 1.f, c1 = 1.f;
      if (warp_live) softmax(tiles.base + (t + 1) * W::kKeys, c0, c1);
      trace.mark(kWsMarkSoftmax);
      wgmma::wait<0>();
      wgmma::reg_fence(o);
      wgmma::reg_fence(pa);
      trace.mark(kWsMarkPv);
      trace.next();
      sync.release_v(ring.stage);  // V_t read (the whole stage t unless split)
      rescale_o(o, c0, c1);
      pack();
      ring = nxt;
    }
    if (active > 0) {  // the last computed tile: P . V alone
      sync.wait_v(ring.stage, ring.phase);
      wgmma::reg_fence(pa);
      wgmma::reg_fence(o);
      wgmma::fence();
      issue_o(ring.stage);
      wgmma::wait<0>();
      wgmma::reg_fence(o);
      sync.release_v(ring.stage);
      ring.template advance<W::kStages>();
    }
  }
  // Tiles none of this warpgroup's rows sees: wait for each (phase order), release it.
#pragma unroll 1
  for (int t = active; t < tiles.count; ++t) {
    sync.skip(ring.stage, ring.phase);
    ring.template advance<W::kStages>();
  }
  if (active == 0) release_q();  // no S read Q

  // Decode items: consumer 0 leaves its state (O, m, l of every thread) in the K/V tile of its
  // last stage, consumer 1 merges it into its own and releases that stage. kMergePasses = 2 (D =
  // 256): O in two halves, m and l with the first; a barrier between passes frees the scratch.
  if (merge_tile >= 0) {
    RingPos mp = item_ring;
    for (int t = 0; t < merge_tile; ++t) mp.template advance<W::kStages>();
    float* scratch = reinterpret_cast<float*>(stages + mp.stage * W::kStageBytes) + (threadIdx.x & 127);
    constexpr int kStride = 128;  // element e of thread i at e * 128 + i: conflict-free
    constexpr int kBlocks = D / 8 / W::kMergePasses;  // o[d] blocks a pass
    constexpr int kM = 4 * kBlocks;                   // m at kM + e, l at kM + 2 + e
    float c_own[2] = {1.f, 1.f}, c_other[2] = {0.f, 0.f};
#pragma unroll
    for (int pass = 0; pass < W::kMergePasses; ++pass) {
      if (pass > 0) named_barrier::sync<256>(1);  // consumer 1 has read the previous pass
      if (wg == 0 && warp_live) {
#pragma unroll
        for (int d = 0; d < kBlocks; ++d)
#pragma unroll
          for (int j = 0; j < 4; ++j) scratch[(4 * d + j) * kStride] = o[pass * kBlocks + d][j];
        if (pass == 0) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            scratch[(kM + e) * kStride] = m[e];
            scratch[(kM + 2 + e) * kStride] = l[e];
          }
        }
      }
      named_barrier::sync<256>(1);  // consumer 0's state (this pass) written
      if (wg == 1 && warp_live) {
        if (pass == 0) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float m_other = scratch[(kM + e) * kStride];
            const float l_other = scratch[(kM + 2 + e) * kStride];
            const float m_new = fmaxf(m[e], m_other);
            const float base = m_new == neg_inf() ? 0.f : m_new;
            c_own[e] = fast_exp2(m[e] - base);
            c_other[e] = fast_exp2(m_other - base);
            l[e] = l[e] * c_own[e] + l_other * c_other[e];
            m[e] = m_new;
          }
        }
#pragma unroll
        for (int d = 0; d < kBlocks; ++d)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float& od = o[pass * kBlocks + d][j];
            od = od * c_own[j >> 1] + scratch[(4 * d + j) * kStride] * c_other[j >> 1];
          }
      }
    }
    if (wg == 1) {  // with its own arrival: the stage's 256
      sync.release_k(mp.stage);
      sync.release_v(mp.stage);
    }
  }

  // Epilogue: normalized rows straight from registers (16-bit pairs, or f32 partials for a split).
  const bool split = ctx.item.partial_row >= 0;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + 8 * e;
    const float lsum = quad_sum(l[e]);
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float out_scale = inv * ctx.v_scale;
    const float lse = lse_from_state(m[e], lsum);
    if (r >= ctx.item.num_rows || !writes) continue;
    if (split) {
      float* dst = p.partial_out + static_cast<int64_t>(ctx.item.partial_row + r) * D + 2 * quad_col;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[d][2 * e] * out_scale, o[d][2 * e + 1] * out_scale);
      }
      if (quad_col == 0) p.partial_lse[ctx.item.partial_row + r] = lse;
    } else {
      T* dst = static_cast<T*>(p.output) + row_token(ctx, r) * p.o_token_stride + row_head(ctx, r) * p.o_head_stride +
               2 * quad_col;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        *reinterpret_cast<uint32_t*>(dst + d * 8) = Mma<T>::pack(o[d][2 * e] * out_scale, o[d][2 * e + 1] * out_scale);
      }
      if (quad_col == 0 && p.lse != nullptr) {
        p.lse[row_head(ctx, r) * p.lse_head_stride + static_cast<int64_t>(row_token(ctx, r)) * p.lse_token_stride] =
            lse;
      }
    }
  }
#else
  (void)p;
  (void)ctx;
  (void)smem;
  (void)bars;
  (void)ring;
  (void)qb;
  (void)q_phase;
  (void)wg;
  __trap();
#endif
}

// Calls f(item index, n) for this CTA's items (the strided schedule of the other kernels: items
// blockIdx.x + k * gridDim.x), n counting them. Odd CTAs walk their list backwards: the plan puts
// the costliest items first (attention planner), so in a mixed batch half the SMs start on the
// MMA-bound prefill items while the other half streams decodes, and the two halves swap, instead
// of every SM prefilling, then every SM decoding against the memory bound (the mixed batch gained:
// docs/perf/cuda.md). Each CTA's items are the same either way.
template <class F>
__device__ __forceinline__ void ws_for_each_item(const AttentionKernelParams& p, F&& f) {
  const int num_items = p.header->num_work_items;
  const int cta = static_cast<int>(blockIdx.x);
  const int grid = static_cast<int>(gridDim.x);
  const int count = cta < num_items ? (num_items - 1 - cta) / grid + 1 : 0;
  const bool backwards = (cta & 1) != 0;
  for (int n = 0; n < count; ++n) f(cta + (backwards ? count - 1 - n : n) * grid, n);
}

// kFp8: an fp8 e4m3 cache (ws_e4m3.cuh). Trace: WsNoTrace, or the timeline probe's recorder
// (bench/ws_timeline_probe.cu).
template <int D, typename T, bool kFp8 = false, class Trace = WsNoTrace>
__global__ void __launch_bounds__(WsTraits<D, kFp8>::kThreads, 1)
    paged_attention_ws_kernel(const AttentionKernelParams p) {
  using W = WsTraits<D, kFp8>;
  static_assert(W::kSupported);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  const WsBarriers<W> bars{reinterpret_cast<uint64_t*>(smem + W::kBarrierOffset)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < W::kStages; ++s) {
      for (int v = 0; v < WsBarriers<W>::kHalves; ++v) {
        // every producer thread, when its copies landed (fp8: and again when its V^T writes are done)
        mbar::init(bars.full(s, v), kFp8 ? 256 : 128);
        mbar::init(bars.empty(s, v), 256);  // every consumer thread
      }
    }
    for (int b = 0; b < W::kQBuffers; ++b) {
      mbar::init(bars.q_full(b), 128);
      mbar::init(bars.q_empty(b), 256);
    }
  }
  __syncthreads();
  const int role = threadIdx.x >> 7;  // 0: producer, 1 / 2: consumers
  if (role == 0) {
    warpgroup_regs_dec<W::kProducerRegs>();
    const int pt = threadIdx.x;
    RingPos ring;
    WsKvCopier<W> copier;
    WsTransposer<W> vt;       // fp8: V^T writes owed
    int prev_first_tile = 0;  // fp8: the first tile of the previous item
    ws_for_each_item(p, [&](int i, int n) {
      const ItemContext ctx = make_item_context(p, p.items[i]);
      copier.begin_item(p, ctx, pt);
      if (WsKvCopier<W>::fast_path(p, ctx)) {
        ws_produce_item<W, T, true>(p, ctx, copier, smem, bars, ring, n, pt, vt, prev_first_tile);
      } else {
        ws_produce_item<W, T, false>(p, ctx, copier, smem, bars, ring, n, pt, vt, prev_first_tile);
      }
    });
    if constexpr (kFp8) vt.write_before(smem, bars, pt, vt.copied);
    cp_async_wait<0>();
  } else {
    warpgroup_regs_inc<W::kConsumerRegs>();
    RingPos ring;
    Trace trace{};
    ws_for_each_item(p, [&](int i, int n) {
      const ItemContext ctx = make_item_context(p, p.items[i]);
      ws_consume_item<D, T, kFp8, Trace>(p, ctx, smem, bars, ring, n % W::kQBuffers, (n / W::kQBuffers) & 1,
                                         role - 1, trace);
    });
  }
#else
  (void)p;
  __trap();
#endif
}

}  // namespace pagedattn::cuda
