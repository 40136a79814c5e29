// Warp-specialized Hopper kernel of the paged attention (AttentionKernel::ws, kernel_selection.h):
// 16-bit caches at head sizes D = 64, 128 and 256, and fp8 (e4m3, e5m2) caches at D = 128 and 256
// on the 8-bit wgmma (kFp8: what changes is in ws_fp8.cuh), head_size == head_size_v == D, sm_90a. It
// computes exactly what paged_attention_kernel computes for the same plan (attention_plan.h: every
// work item, decode-path or prefill-path, split or not), with one code path for both kinds of item.
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
// A tile with no mask and no general logit transform (most tiles of a long item) runs that body
// as one branch-free block (no per-warp or rescale branches), so the compiler interleaves the
// exponentials with the packing of P and the wait for P_t . V_t: the consumers' per-tile chain,
// not the tensor core, sets the tile time (docs/perf/cuda.md). fp8 at D = 256, whose 8-bit MMAs
// leave the multi-function unit the longer chain, takes a quarter of that block's exponentials on
// the FMA pipe (fma_exp2, WsTraits::kFmaExpPer8).
// The two consumers run unsynchronized: one's softmax overlaps the other's MMAs too (alternating
// their MMA issues with FlashAttention-3's turn barriers measured slower here).
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
// 3 V staging slots x 16 KB + 2 e4m3 Q tiles x 8 KB = 224 KB; fp8 D = 256: Q 64 KB (the e4m3 Q
// tiles inside it) + 3 stages x 32 KB + 3 staging slots x 16 KB = 208 KB. The decode merge borrows
// a stage.
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
// NaN isolation: a masked tile's partly visible V rows are scanned before its P . V; a non-finite
// value there is kept from the rows that cannot see its key (value_isolation.cuh: added to O and
// zeroed in prefill items, P . V key by key in decode items).
//
// Not sm_90a: the body is a trap and the builder never selects this kernel.
#pragma once

#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/paged_prefill_wgmma.cuh"
#include "backends/cuda/attention/ws_producer.cuh"

namespace pagedattn::cuda {

// Phase marks of a consumer warp in the pipelined (prefill-path) loop, for the timeline probe
// (bench/ws_timeline_probe.cu): Trace::mark(event) at the start of an iteration, when its K (and
// V) tiles have landed, when both wgmma groups are issued, when S_{t+1} has landed, after the
// softmax, and when P_t . V_t is done. The shipped kernel's WsNoTrace compiles to nothing.
// In the general step also: P packed, the masked tile's V landed for its scan, the scan's vote done.
enum WsMark : int {
  kWsMarkStart,
  kWsMarkLanded,
  kWsMarkIssued,
  kWsMarkScores,
  kWsMarkSoftmax,
  kWsMarkPv,
  kWsMarkPacked,
  kWsMarkScanLanded,
  kWsMarkScanned,
  kWsMarkEnd,
  kWsMarks
};
struct WsNoTrace {
  __device__ __forceinline__ void mark(int /*event*/) {}
  __device__ __forceinline__ void kind(int /*general*/) {}
  __device__ __forceinline__ void next() {}
};
// Probe-only policies a Trace may declare (none in WsNoTrace): kSoloConsumer, consumer 1 computes
// no prefill tile (it waits for and releases each); kTurns, the consumers take turns to issue
// their prefill wgmma groups (1: the turn passes once issued, FlashAttention-3's scheduler barrier;
// 2: once the group's S has landed); kWarpScan, a prefill tile's NaN-isolation scan is done by
// each warp over all the chunks and voted within the warp (as decode items do), no warpgroup
// barrier.
template <class Trace>
__device__ constexpr bool ws_trace_solo() {
  if constexpr (requires { Trace::kSoloConsumer; }) return Trace::kSoloConsumer;
  return false;
}
template <class Trace>
__device__ constexpr bool ws_trace_warp_scan() {
  if constexpr (requires { Trace::kWarpScan; }) return Trace::kWarpScan;
  return false;
}
template <class Trace>
__device__ constexpr int ws_trace_turns() {
  if constexpr (requires { Trace::kTurns; }) return Trace::kTurns;
  return 0;
}

// Consumer: one item's 64 rows of this warpgroup (wg = 0 or 1: rows 64 wg ..; decode-path items:
// rows 0.. and every other tile, merged into consumer 1), then its output.
template <int D, typename T, bool kFp8, bool kE5m2, class Trace = WsNoTrace>
__device__ void ws_consume_item(const AttentionKernelParams& p, const ItemContext& ctx, char* smem,
                                const WsBarriers<WsTraits<D, kFp8>>& bars, RingPos& ring, int qb, uint32_t q_phase,
                                int wg, Trace& trace) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using W = WsTraits<D, kFp8>;
  using Ops8 = wgmma::OpsFp8<kE5m2>;  // fp8: e4m3 Q / P times the cache's e4m3 / e5m2 K / V
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
  // last live row of the 64 sees the most). tiles_upto: the tiles up to a consumer's last key.
  auto tiles_upto = [&](int hi) { return hi < tiles.base ? 0 : min(tiles.count, (hi - tiles.base) / W::kKeys + 1); };
  const int first_row = decode ? 0 : 64 * wg;
  const int last_row = min(first_row + 63, ctx.item.num_rows - 1);
  const int block_hi = first_row < ctx.item.num_rows ? make_row_range(p, ctx, last_row).hi : -1;
  const int active = ws_trace_solo<Trace>() && wg == 1 && !decode ? 0 : tiles_upto(block_hi);
  constexpr int kTurns = ws_trace_turns<Trace>();
  auto turn_begin = [&] {
    if constexpr (kTurns != 0) {
      if (!decode) named_barrier::sync<256>(6 + wg);
    }
  };
  auto turn_end = [&] {
    if constexpr (kTurns != 0) {
      if (!decode) named_barrier::arrive<256>(6 + (1 - wg));
    }
  };
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
      issue_scores_with<D, Ops8, W::kKeys>(s, q8_desc(), k_desc(stage));
    } else {
      issue_scores<D, T, W::kKeys>(s, q_desc(), k_desc(stage));
    }
  };
  auto issue_o = [&](int stage) {
    if constexpr (kFp8) {
      issue_pv_fp8<D, Ops8>(o, pa, v_desc(stage));
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
    if (p.query_fp8) {  // the caller's e4m3 bytes (ws_load_q<D, 1>), row scale 1
      ws_q8_words<D>(q_smem, qrow, words);
    } else {
      ws_q_amax_e4m3<D, T>(q_smem, qrow, q_row_scale);
      ws_q_convert_e4m3<D, T>(q_smem, qrow, q_row_scale, words);
    }
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

  // The factor that takes row e's raw scores to base-2 logits, from transform_scores' factor: fp8
  // folds in the row's Q scale too, unless the general transform took the true dot products.
  auto row_factor = [&](int e, float factor, bool transformed) {
    return kFp8 && !transformed ? factor * q_row_scale[e] : factor;
  };
  // Softmax of the scores of the tile at key0 (in s); returns the corrections of the two rows.
  auto softmax = [&](int key0, float& c0, float& c1) {
    const bool masked = tile_masked(ctx, key0, W::kKeys);
    if (kFp8 && general) {  // the general logit transform takes the true dot products
#pragma unroll
      for (int j = 0; j < W::kScoreTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= q_row_scale[e >> 1];
    }
    const float factor = transform_scores<W::kScoreTiles>(s, p, ctx, rows, r0, key0, general, masked);
    c0 = online_softmax_row<W::kScoreTiles>(s, 0, row_factor(0, factor, general), m[0], l[0]);
    c1 = online_softmax_row<W::kScoreTiles>(s, 1, row_factor(1, factor, general), m[1], l[1]);
  };

  const WsStageSync<W> sync{bars};
  // P . V of a stage issued and waited for (the in-order tiles: nothing else in flight).
  auto pv_now = [&](int stage) {
    wgmma::reg_fence(pa);
    wgmma::reg_fence(o);
    wgmma::fence();
    issue_o(stage);
    wgmma::wait<0>();
    wgmma::reg_fence(o);
    wgmma::reg_fence(pa);
  };

  // NaN isolation (value_isolation.cuh). A masked tile's partly visible V rows (fp8: the 16-key
  // groups of V^T that hold them) are scanned by the warpgroup after the tile's softmax, before its
  // P . V; only if they hold a non-finite value does anything else run:
  //   prefill items (isolate): each thread adds those values to its O for the rows that see their
  //     keys, and they are zeroed in shared memory, so that the wgmma adds only finite products;
  //     the pipelined loop keeps its shape (a skipped wgmma there would cost registers in every
  //     step). `shared`: the other consumer computes the tile too; both add before consumer 0
  //     zeroes;
  //   decode items (in order, one consumer a tile): P . V key by key instead (pv_exact).
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const uint32_t nonfinite_mask = kFp8 ? nonfinite_fp8_mask(kE5m2 ? 2 : 1) : kNonFinite16<T>;
  auto v_tile = [&](int stage) { return stages + stage * W::kStageBytes + W::kKvTileBytes; };
  struct Scan {
    char* v;                 // the stage's V tile
    PartlyVisibleKeys keys;  // tile-local (fp8: whole 16-key groups, in `below`)
    int count;               // 16-byte chunks to scan
  };
  auto scan_of = [&](int stage, int key0) {
    Scan sc;
    sc.v = v_tile(stage);
    sc.keys = tile_partly_visible(ctx, key0, W::kKeys);
    if constexpr (kFp8) {
      int lo = W::kKeys, hi = 0;
      if (sc.keys.below.count() > 0) lo = sc.keys.below.lo, hi = sc.keys.below.hi;
      if (sc.keys.above.count() > 0) lo = min(lo, sc.keys.above.lo), hi = max(hi, sc.keys.above.hi);
      sc.keys.below = hi > lo ? KeySpan{lo & ~15, (hi + 15) & ~15} : KeySpan{0, 0};
      sc.keys.above = KeySpan{0, 0};
      sc.count = sc.keys.below.count() / 16 * D;
    } else {
      sc.count = sc.keys.count() * (D / 8);
    }
    return sc;
  };
  auto chunk_of = [&](const Scan& sc) {
    return [&sc](int i) -> char* {
      if constexpr (kFp8) {  // chunk (dim row, 16-key group) of V^T
        const int groups = sc.keys.below.count() / 16;
        return sc.v + ws_vt_offset<W::kKeys>(i / groups, sc.keys.below.lo / 16 + i % groups, 0);
      } else {  // N-major key rows of D / 8 chunks
        return sc.v + swizzled_offset<W::kKeys>(sc.keys.key(i / (D / 8)), i % (D / 8));
      }
    };
  };
  // Prefill: the warpgroup's 128 threads share the chunks and vote at its barrier (3 + wg); none
  // to scan is no barrier.
  auto poisoned = [&](const Scan& sc) {
    return sc.count > 0 && named_barrier::any<128>(
        3 + wg, any_nonfinite<kElemBytes>(sc.count, nonfinite_mask, threadIdx.x & 127, 128, chunk_of(sc)));
  };
  // Decode items (a few partly visible keys: the speculative rows' diagonal): every warp scans all
  // the chunks and votes alone. A warpgroup barrier here, which only the tile's consumer executes,
  // made compute-sanitizer racecheck report hazards on the decode merge's accesses at D = 256,
  // which barrier 1 orders (docs/perf/cuda.md, session 23).
  auto poisoned_warp = [&](const Scan& sc) {
    return __any_sync(0xffffffffu, any_nonfinite<kElemBytes>(sc.count, nonfinite_mask, lane, 32, chunk_of(sc)));
  };
  const auto sees = [&](int e, int key) { return rows[e].sees(key); };
  // V element (tile-local key, dim) of the stage as float.
  auto v_value = [&](const char* v, int key, int dim) {
    if constexpr (kFp8) {  // V^T column c of the key within its group
      const int c = ws_v_col(key & 15);
      const char* b = v + ws_vt_offset<W::kKeys>(dim, key >> 4, c >> 2) + (c & 3);
      return kE5m2 ? to_f32(*reinterpret_cast<const __nv_fp8_e5m2*>(b)) : to_f32(*reinterpret_cast<const __nv_fp8_e4m3*>(b));
    } else {
      return to_f32(*reinterpret_cast<const T*>(v + swizzled_offset<W::kKeys>(key, dim >> 3) + (dim & 7) * 2));
    }
  };
  auto pv_exact = [&](int stage, int key0) {
    if (!warp_live) return;  // (no row: its s is not P)
    const char* v = v_tile(stage);
    pv_visible_keys<W::kScoreTiles, D / 8>(o, s, key0, sees, [&](int key) {
      const int row = key - key0;
      return [&, v, row](int dim) { return v_value(v, row, dim); };
    });
  };
  // The other consumer's last key (its rows' ranges), and whether it computes prefill tile t too.
  const int other_first = 64 * (1 - wg);
  auto other_hi = [&] { return make_row_range(p, ctx, min(other_first + 63, ctx.item.num_rows - 1)).hi; };
  auto other_computes = [&](int t) {
    if (other_first >= ctx.item.num_rows) return false;
    return tiles.base + t * W::kKeys <= other_hi();
  };

  auto mark_no_scan = [&] {  // (the probe's scan marks where nothing is scanned)
    trace.mark(kWsMarkScanLanded);
    trace.mark(kWsMarkScanned);
  };
  // Tile t of the item (its K/V in stage `at`), after its softmax: nothing unless it is masked
  // (then its V is waited for and scanned).
  auto isolate = [&](const RingPos& at, int t) {
    const int key0 = tiles.base + t * W::kKeys;
    if (!tile_masked(ctx, key0, W::kKeys)) return mark_no_scan();
    sync.wait_v_landed(at.stage, at.phase);
    trace.mark(kWsMarkScanLanded);
    const Scan sc = scan_of(at.stage, key0);
    const bool any = ws_trace_warp_scan<Trace>() ? poisoned_warp(sc) : poisoned(sc);
    trace.mark(kWsMarkScanned);
    if (!any) return;
    const bool shared = other_computes(t);
    if (warp_live) {
      add_nonfinite_values<D / 8>(o, sc.keys, key0, sees, [&](int key, int dim) { return v_value(sc.v, key, dim); });
    }
    // every warp (both consumers when shared) has read the values
    if (shared) {
      named_barrier::sync<256>(5);
    } else {
      named_barrier::sync<128>(3 + wg);
    }
    if (!shared || wg == 0) zero_nonfinite<kElemBytes>(sc.count, nonfinite_mask, threadIdx.x & 127, 128, chunk_of(sc));
    wgmma::fence_async_smem();  // the zeros, before the wgmma's reads
    if (shared) {
      named_barrier::sync<256>(5);
    } else {
      named_barrier::sync<128>(3 + wg);
    }
  };
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
      const int key0 = tiles.base + t * W::kKeys;
      if (tile_masked(ctx, key0, W::kKeys) && poisoned_warp(scan_of(ring.stage, key0))) {
        pv_exact(ring.stage, key0);
      } else {
        pv_now(ring.stage);
      }
      if (t != merge_tile) sync.release_v(ring.stage);
      ring.template advance<W::kStages>();
    }
  } else {
    if (active > 0) {  // S_0 and P_0
      sync.wait_k(ring.stage, ring.phase);
      __syncwarp();
      wgmma::fence_async_smem();
      wgmma::fence();
      turn_begin();
      issue_s(ring.stage);
      wgmma::wait<0>();
      turn_end();
      wgmma::reg_fence(s);
      sync.release_k(ring.stage);  // K_0 read
      if (active == 1) release_q();  // the only S: Q may be refilled
      if (warp_live) {
        float c0, c1;
        softmax(tiles.base, c0, c1);  // O is zero: no rescale
        pack();
      }
      isolate(ring, 0);
    }
    // Steady state: S_{t+1} and P_t . V_t in flight together, the softmax of S_{t+1} under P_t . V_t.
    // A tile that needs no mask and no general logit transform (most tiles of a long item) runs as
    // one straight-line block: every warp computes (rows past the item are never stored), O is
    // rescaled unconditionally, and the compiler interleaves the exponentials with the wait for
    // P_t . V_t, the rescale and the packing of P (FlashAttention-3's loop body). Other tiles take the
    // general order (masks, transforms, warps without rows skip their softmax, rescale when needed).
    auto pipelined_step = [&](int t, auto fast_tag) {
      constexpr bool kFast = decltype(fast_tag)::value;
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
      turn_begin();
      issue_s(nxt.stage);
      issue_o(ring.stage);
      if constexpr (kTurns == 1) turn_end();
      trace.mark(kWsMarkIssued);
      wgmma::wait<1>();  // S_{t+1} landed; P_t . V_t may still run
      if constexpr (kTurns == 2) turn_end();
      wgmma::reg_fence(s);
      trace.mark(kWsMarkScores);
      trace.kind(kFast ? 0 : 1);
      sync.release_k(nxt.stage);  // K_{t+1} read
      if (t + 2 == active) release_q();  // that was the last S: Q may be refilled
      float c0 = 1.f, c1 = 1.f;
      if constexpr (kFast) {
        const float f0 = row_factor(0, plain_logit_factor(ctx), false);
        const float f1 = row_factor(1, plain_logit_factor(ctx), false);
        float b0, b1;
        c0 = softmax_row_max<W::kScoreTiles>(s, 0, f0, m[0], b0);
        c1 = softmax_row_max<W::kScoreTiles>(s, 1, f1, m[1], b1);
        softmax_row_exp<W::kScoreTiles, W::kFmaExpPer8>(s, 0, f0, b0, c0, l[0]);
        softmax_row_exp<W::kScoreTiles, W::kFmaExpPer8>(s, 1, f1, b1, c1, l[1]);
      } else {
        if (warp_live) softmax(tiles.base + (t + 1) * W::kKeys, c0, c1);
      }
      trace.mark(kWsMarkSoftmax);
      wgmma::wait<0>();
      wgmma::reg_fence(o);
      wgmma::reg_fence(pa);
      trace.mark(kWsMarkPv);
      sync.release_v(ring.stage);  // V_t read (the whole stage t unless split)
      if constexpr (kFast) {
        rescale_o_always(o, c0, c1);
      } else {
        rescale_o(o, c0, c1);
      }
      pack();
      trace.mark(kWsMarkPacked);
      if constexpr (!kFast) {
        isolate(nxt, t + 1);  // (the fast step's tile t + 1 is unmasked)
      } else {
        mark_no_scan();
      }
      trace.mark(kWsMarkEnd);
      trace.next();
      ring = nxt;
    };
  #pragma unroll 1
    for (int t = 0; t + 1 < active; ++t) {
      const int key0 = tiles.base + (t + 1) * W::kKeys;
      if (W::kBranchFreeSteps && !general && !tile_masked(ctx, key0, W::kKeys)) {
        pipelined_step(t, std::true_type{});
      } else {
        pipelined_step(t, std::false_type{});
      }
    }
    if (active > 0) {  // the last computed tile: P . V alone
      sync.wait_v(ring.stage, ring.phase);
      turn_begin();
      pv_now(ring.stage);
      turn_end();
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
  if constexpr (kTurns != 0) {  // as many turns as the other consumer: active + 1 each (0 if none)
    if (!decode) {
      const bool other_idle = (ws_trace_solo<Trace>() && wg == 0) || other_first >= ctx.item.num_rows;
      const int other_active = other_idle ? 0 : tiles_upto(other_hi());
      const int own_turns = active > 0 ? active + 1 : 0;
      const int other_turns = other_active > 0 ? other_active + 1 : 0;
      for (int k = own_turns; k < other_turns; ++k) {
        turn_begin();
        turn_end();
      }
    }
  }

  // Decode items: consumer 0 leaves its state (O, m, l of every thread) in the K/V tile of its
  // last stage, consumer 1 merges it into its own and releases that stage. kMergePasses = 2 (D =
  // 256): O in two halves, m and l with the first; a barrier between passes frees the scratch.
  if (merge_tile >= 0) {
    // Both consumers, before consumer 0 overwrites its last stage: consumer 0's warps are done
    // reading it (the NaN-isolation scan and pv_exact read it with generic loads), and consumer
    // 1's reads of an earlier item's merge through the same stage come first. (The stage's
    // mbarriers and TMA refill already order the latter; compute-sanitizer racecheck does not
    // follow that chain and sees only this barrier.)
    named_barrier::sync<256>(1);
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
  const bool fp8_out = p.output_scale != nullptr;
  const float q = output_quant_factor(p.output_scale);
#pragma unroll  // (o[d][2 e] must stay in registers: a loop over e left rolled puts O on the stack)
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
      const int64_t dst = row_token(ctx, r) * p.o_token_stride + row_head(ctx, r) * p.o_head_stride + 2 * quad_col;
      // At D >= 128 the output dtype's branch sits outside the row's loop: inside it ptxas made
      // each pair's store a basic block of its own, and every pair's product waited for the
      // previous store to read the one register they shared (a long-scoreboard stall a pair). At
      // D = 64 it if-converts the loop (predicated stores, a register each), and the split measured
      // slower there (docs/perf/cuda.md, session 25).
      auto store_row = [&](bool as_fp8) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          store_output2<T>(p.output, dst + d * 8, o[d][2 * e] * out_scale, o[d][2 * e + 1] * out_scale, as_fp8, q);
        }
      };
      if (D == 64) {
        store_row(fp8_out);
      } else if (fp8_out) {
        store_row(true);
      } else {
        store_row(false);
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

// kFp8: an fp8 cache (ws_fp8.cuh), e5m2 when kE5m2, else e4m3. Trace: WsNoTrace, or the timeline
// probe's recorder (bench/ws_timeline_probe.cu).
template <int D, typename T, bool kFp8 = false, bool kE5m2 = false, class Trace = WsNoTrace>
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
    if constexpr (ws_trace_turns<Trace>() != 0) {
      if (role == 2) named_barrier::arrive<256>(6);  // consumer 0 takes the first turn
    }
    ws_for_each_item(p, [&](int i, int n) {
      const ItemContext ctx = make_item_context(p, p.items[i]);
      ws_consume_item<D, T, kFp8, kE5m2, Trace>(p, ctx, smem, bars, ring, n % W::kQBuffers, (n / W::kQBuffers) & 1,
                                         role - 1, trace);
    });
  }
#else
  (void)p;
  __trap();
#endif
}

}  // namespace pagedattn::cuda
