// NaN isolation of values behind a mask (docs/reliability.md, "NaN isolation"): the exact path
// for a key tile whose V rows hold a non-finite value at a key that some query rows of the tile
// cannot see.
//
// Why: the kernels mask a key by its logit (-inf, so P = 0) and still multiply its V row into
// P . V on the tensor core whenever another row of the tile sees the key; 0 x NaN and 0 x inf are
// NaN, so a NaN or an infinity there would reach rows that cannot see it (REFERENCE: a non-finite
// V element of a key reaches element d of exactly the rows that see the key). Keys outside an
// item's range are zero-filled, and a tile every row sees entirely needs no mask, so the keys at
// stake are the "partly visible" ones: inside the item's range, outside [lo_max, hi_min] (the
// keys every row sees): the causal diagonal, a sliding window's lower edge.
// How: a masked tile's partly visible V rows are scanned in shared memory for an element whose
// exponent bits are all ones (any_nonfinite: a few 16-byte loads a lane, on masked tiles only; the
// callers vote over the threads that share the tile's P . V). Only if one is found does anything
// else run, in one of two ways (about 50x the MMA's time for that tile, on poisoned inputs only):
//   pv_visible_keys: the tile's P . V key by key in f32, each row only over the keys it sees,
//     instead of the MMA (the mma.sync prefill and decode paths, the wgmma prefill path, the
//     warp-specialized kernel's decode items, the MLA prefill);
//   add_nonfinite_values + zero_nonfinite: each non-finite value is added to O by the rows that
//     see its key, then zeroed in shared memory, and the MMA runs as usual (the warp-specialized
//     kernel's pipelined prefill loop, whose two consumers share a tile and whose steps cannot
//     afford a skipped-MMA variant's registers).
#pragma once

#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/nonfinite_scan.h"

namespace pagedattn::cuda {

// Keys [lo, hi) of a tile, in tile-local indices (hi <= lo: none).
struct KeySpan {
  int lo, hi;
  __device__ __forceinline__ int count() const { return hi > lo ? hi - lo : 0; }
};

// The partly visible keys of the tile [key0, key0 + n): inside the item's range [kv_start, kv_end)
// and below lo_max (the largest first-visible key of the item's rows) or past hi_min (the
// smallest last-visible key).
struct PartlyVisibleKeys {
  KeySpan below, above;
  __device__ __forceinline__ int count() const { return below.count() + above.count(); }
  // Tile-local key of index i < count() (the keys of `below`, then those of `above`).
  __device__ __forceinline__ int key(int i) const {
    const int nb = below.count();
    return i < nb ? below.lo + i : above.lo + (i - nb);
  }
};
__device__ __forceinline__ PartlyVisibleKeys partly_visible_keys(int key0, int n, int kv_start, int kv_end,
                                                                 int lo_max, int hi_min) {
  PartlyVisibleKeys k;
  k.below = KeySpan{max(key0, kv_start) - key0, min(key0 + n, min(lo_max, kv_end)) - key0};
  k.above = KeySpan{max(key0, max(kv_start, hi_min + 1)) - key0, min(key0 + n, kv_end) - key0};
  return k;
}

template <typename T>
inline constexpr uint32_t kNonFinite16 = std::is_same_v<T, __half> ? kNonFiniteF16 : kNonFiniteBf16;

// Whether any of the 16-byte chunks chunk(i), i = first, first + step, .. < count, holds a
// non-finite element (this thread's share; the caller reduces over the threads).
template <int kElemBytes, class Chunk>
__device__ __forceinline__ bool any_nonfinite(int count, uint32_t mask, int first, int step, Chunk chunk) {
  NonfiniteScan<kElemBytes> scan(mask);
  for (int i = first; i < count; i += step) {
    const uint4 v = *reinterpret_cast<const uint4*>(chunk(i));
    scan.take(v.x);
    scan.take(v.y);
    scan.take(v.z);
    scan.take(v.w);
  }
  return scan.found();
}

// Zeroes the non-finite elements of the same chunks (this thread's share; chunks without one are
// not written).
template <int kElemBytes, class Chunk>
__device__ __forceinline__ void zero_nonfinite(int count, uint32_t mask, int first, int step, Chunk chunk) {
  const NonfiniteScan<kElemBytes> scan(mask);
  for (int i = first; i < count; i += step) {
    uint4* c = reinterpret_cast<uint4*>(chunk(i));
    const uint4 v = *c;
    const uint4 bad = make_uint4(scan.elements(v.x), scan.elements(v.y), scan.elements(v.z), scan.elements(v.w));
    if ((bad.x | bad.y | bad.z | bad.w) != 0u) *c = make_uint4(v.x & ~bad.x, v.y & ~bad.y, v.z & ~bad.z, v.w & ~bad.w);
  }
}

// The other half of that path for a kernel that keeps its MMA (the warp-specialized kernel, whose
// two consumers share a tile): each non-finite element v of the keys' V rows is added to O[r, d] by
// the rows r of this thread that see its key (it decides the sum: o + p v is v's NaN or infinity
// for p > 0), before the rows are zeroed (zero_nonfinite) for the MMA, which then adds only finite
// products. o[d][e] is row e >> 1, dim 8 d + 2 quad_col + (e & 1); value(key, dim) reads the
// element as float, key tile-local; sees(e, key) takes the key's position (key0 + key).
template <int DT, class Sees, class Value>
__device__ __forceinline__ void add_nonfinite_values(float (&o)[DT][4], const PartlyVisibleKeys& keys, int key0,
                                                     Sees sees, Value value) {
  const int quad_col = threadIdx.x & 3;
#pragma unroll 1
  for (int i = 0; i < keys.count(); ++i) {
    const int key = keys.key(i);
    const bool s0 = sees(0, key0 + key), s1 = sees(1, key0 + key);
    if (!s0 && !s1) continue;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const float x = value(key, 8 * d + 2 * quad_col + b);
        if (!isfinite(x)) {
          if (s0) o[d][b] += x;
          if (s1) o[d][2 + b] += x;
        }
      }
    }
  }
}

// O += P . V over the keys key0 + [0, 8 NT) of this thread's two rows, one key at a time, each row
// only over the keys it sees: the tile's P . V when its V rows hold a non-finite value that a row
// must not see. Layouts are the mma.sync / wgmma accumulator's: pr[j][e] is P of row e >> 1 and key
// key0 + 8 j + 2 quad_col + (e & 1); o[d][e] is row e >> 1, dim 8 d + 2 quad_col + (e & 1).
// sees(e, key): whether the thread's row e (0: r, 1: r + 8) sees the key. row(key) (called for
// seen keys only) returns a callable that gives element `dim` of the key's V row as the MMA would
// take it (before v_scale), as float. P is taken in f32 (the MMA takes it rounded to the operand
// type). Every lane of the warp calls it (shuffles). The key loop stays rolled (a P register is
// picked by selects), so that each inlined copy is small: this path runs on poisoned inputs only.
template <int NT, int DT, class Sees, class Row>
__device__ __forceinline__ void pv_visible_keys(float (&o)[DT][4], const float (&pr)[NT][4], int key0, Sees sees,
                                                Row row) {
  const int lane = threadIdx.x & 31;
  const int quad_col = lane & 3;
#pragma unroll 1
  for (int k = 0; k < 8 * NT; ++k) {
    const int j = k >> 3;
    const bool odd = (k & 1) != 0;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int jj = 0; jj < NT; ++jj) {
      if (jj == j) {
        a0 = odd ? pr[jj][1] : pr[jj][0];
        a1 = odd ? pr[jj][3] : pr[jj][2];
      }
    }
    const int src = (lane & ~3) | ((k & 7) >> 1);  // the quad lane that holds this key's P
    const float p0 = __shfl_sync(0xffffffffu, a0, src);
    const float p1 = __shfl_sync(0xffffffffu, a1, src);
    const int key = key0 + k;
    const bool s0 = sees(0, key), s1 = sees(1, key);
    if (!s0 && !s1) continue;
    const auto value = row(key);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      const int dim = 8 * d + 2 * quad_col;
      const float x = value(dim), y = value(dim + 1);
      if (s0) {
        o[d][0] = fmaf(p0, x, o[d][0]);
        o[d][1] = fmaf(p0, y, o[d][1]);
      }
      if (s1) {
        o[d][2] = fmaf(p1, x, o[d][2]);
        o[d][3] = fmaf(p1, y, o[d][3]);
      }
    }
  }
}

}  // namespace pagedattn::cuda
