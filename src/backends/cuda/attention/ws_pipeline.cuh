// The warp-specialized kernel's pipeline (paged_attention_ws.cuh): its traits (tile shapes, the
// shared-memory layout, the register split, for 16-bit and fp8 caches), the per-item tile
// range, the stage and Q barriers, a consumer's waits and releases of a stage, the ring position.
#pragma once

#include "backends/cuda/attention/kernel_selection.h"
#include "backends/cuda/attention/paged_attention_common.cuh"
#include "backends/cuda/common/async_primitives.cuh"

namespace pagedattn::cuda {

// kFp8: an fp8 cache (e4m3 or e5m2) on the 8-bit wgmma (ws_fp8.cuh): K tiles of D bytes a row, V^T tiles
// of kKeys bytes a row, a staging ring of kStagingSlots V tiles as copied, the 16-bit Q buffer and
// a consumer's e4m3 Q tile (at D = 256 inside the Q buffer: no room beside it).
template <int D, bool kFp8 = false>
struct WsTraits {
  static constexpr bool kSupported = kFp8 ? ws_fp8_head_size(D) : ws_kernel_head_size(D);
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
  // Unmasked tiles without a general transform on the consumers' branch-free step
  // (paged_attention_ws.cuh), except fp8 at D = 128: ptxas then waits for P_t . V_t before the
  // exponentials, and it measured no faster (docs/perf/cuda.md).
  static constexpr bool kBranchFreeSteps = !kFp8 || D == 256;
  // Exponentials of the branch-free step on the FMA pipe (fma_exp2), per 8 score tiles: fp8 at
  // D = 256 only, where the 8-bit MMAs leave the multi-function unit the longer chain; with 16-bit
  // caches and fp8 at D = 128 the added instructions measured slower (docs/perf/cuda.md).
  static constexpr int kFmaExpPer8 = kFp8 && D == 256 ? 2 : 0;
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

}  // namespace pagedattn::cuda
