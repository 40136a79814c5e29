// CUDA MLA prefill attention (the "CUDA" MLA prefill backend): ragged multi-head attention with
// q/k head size 192 (qk_nope 128 + rope 64) and v head size 128, causal over a prefill's new
// tokens or non-causal over one context chunk, with the natural-log LSE for the merge.
//
// What it computes, per sequence i, head h, query t < q_len_i (offset = kv_len_i - q_len_i):
//   s_n = scale * (q[t] . k[n]),  n < kv_len_i  (causal: n <= t + offset)
//   o   = sum_n softmax(s)_n v[n];  LSE = log(sum_n e^{s_n});  no visible key: o = 0, LSE = -inf
//
// Tiling: a CTA of 4 warps owns 64 queries of one (sequence, head): grid (num_seqs *
// ceil(max_q_len / 64), H); CTAs past their sequence's queries exit at once. Keys stream in
// tiles of 64 through a 2-stage cp.async pipeline (16-byte copies, zero-filled past kv_len);
// warp w owns query rows [16w, 16w + 16) and sees every key of a tile: S (16 x 64) and O
// (16 x 128) in registers, mma.sync m16n8k16 with K via ldmatrix and V via ldmatrix.trans.
// Causal CTAs stop at the last tile their rows can see (the upper triangle is skipped).
// Shared rows padded by 16 bytes (400-byte Q/K rows, 272-byte V rows: conflict-free ldmatrix).
// Shared memory 109 KB: two CTAs per multiprocessor.
//
// Traffic and floor: K/V of a (sequence, head) are read once per 64-query tile (L2 serves the
// re-reads); the floor is the MMA work, 2 * q * k * (192 + 128) FLOPs (halved by causality)
// over the measured matrix rate.
// Precision points: logits, softmax state and o in f32; P rounded to the activation type before
// P.V (the row sum uses the f32 P); exp2 via ex2.approx; output rounded once (RNE); LSE f32.
// NaN isolation: a causal tile whose V rows past a warp's first row hold a non-finite value takes
// P . V key by key (value_isolation.cuh), so that it reaches only the rows that see its key.
#include <cuda_runtime.h>

#include "backends/cuda/common/async_primitives.cuh"
#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "backends/cuda/common/value_isolation.cuh"
#include "backends/cuda/mla/mla_prefill.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda::mla_prefill {
namespace {

constexpr int kRows = 64;
constexpr int kKeys = 64;
constexpr int kThreads = 128;
constexpr int kQkStride = kQkDim + 8;   // elements per padded shared row
constexpr int kVStride = kVDim + 8;
constexpr int kQkChunks = kQkDim / 8;   // 16-byte chunks per row
constexpr int kVChunks = kVDim / 8;
constexpr int kStageElems = kKeys * kQkStride + kKeys * kVStride;
constexpr int kSmemBytes = (kRows * kQkStride + 2 * kStageElems) * 2;

__device__ __forceinline__ float quad_reduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_reduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <typename T>
__device__ __forceinline__ void load_kv(const PrefillParams& p, int head, int kv_begin, int kv_len, int key0, T* stage) {
  T* k_s = stage;
  T* v_s = stage + kKeys * kQkStride;
  for (int idx = threadIdx.x; idx < kKeys * kQkChunks; idx += kThreads) {
    const int row = idx / kQkChunks, c = idx - row * kQkChunks;
    const bool valid = key0 + row < kv_len;
    const T* src = static_cast<const T*>(p.k) +
                   (valid ? (static_cast<int64_t>(kv_begin + key0 + row) * p.k_ts + head * p.k_hs + c * 8) : 0);
    cp_async_16(k_s + row * kQkStride + c * 8, src, valid);
  }
  for (int idx = threadIdx.x; idx < kKeys * kVChunks; idx += kThreads) {
    const int row = idx / kVChunks, c = idx - row * kVChunks;
    const bool valid = key0 + row < kv_len;
    const T* src = static_cast<const T*>(p.v) +
                   (valid ? (static_cast<int64_t>(kv_begin + key0 + row) * p.v_ts + head * p.v_hs + c * 8) : 0);
    cp_async_16(v_s + row * kVStride + c * 8, src, valid);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) mla_prefill_kernel(const PrefillParams p, int q_tiles) {
  extern __shared__ __align__(16) char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* stages = q_s + kRows * kQkStride;
  const int seq = blockIdx.x / q_tiles;
  const int q0 = (blockIdx.x - seq * q_tiles) * kRows;
  const int head = blockIdx.y;
  const int q_begin = p.q_cu[seq], q_len = p.q_cu[seq + 1] - q_begin;
  if (q0 >= q_len) return;
  const int kv_begin = p.kv_cu[seq], kv_len = p.kv_cu[seq + 1] - kv_begin;
  const int offset = kv_len - q_len;
  const int rows = min(kRows, q_len - q0);
  // Keys any row of this CTA can see.
  const int kv_hi = p.causal ? max(0, min(kv_len, q0 + rows - 1 + offset + 1)) : kv_len;
  const int num_tiles = (kv_hi + kKeys - 1) / kKeys;

  for (int idx = threadIdx.x; idx < kRows * kQkChunks; idx += kThreads) {
    const int row = idx / kQkChunks, c = idx - row * kQkChunks;
    const bool valid = row < rows;
    const T* src = static_cast<const T*>(p.q) +
                   (valid ? (static_cast<int64_t>(q_begin + q0 + row) * p.q_ts + head * p.q_hs + c * 8) : 0);
    cp_async_16(q_s + row * kQkStride + c * 8, src, valid);
  }
  cp_async_commit();
  if (num_tiles > 0) load_kv<T>(p, head, kv_begin, kv_len, 0, stages);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int r0 = warp * 16;
  // Last visible key of this thread's two rows (rows past q_len see nothing).
  int hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = q0 + r0 + quad_row + 8 * h;
    hi[h] = t >= q_len ? -1 : (p.causal ? min(kv_len - 1, t + offset) : kv_len - 1);
  }
  const int warp_hi = p.causal ? min(kv_len - 1, q0 + r0 + 15 + offset) : kv_len - 1;
  // The last key every live row of the warp sees (its first row's); whether it has live rows.
  const bool warp_live = q0 + r0 < q_len;
  const int warp_hi_min = p.causal ? min(kv_len - 1, q0 + r0 + offset) : kv_len - 1;
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  float o[kVDim / 8][4];
#pragma unroll
  for (int d = 0; d < kVDim / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

#pragma unroll 1
  for (int tile = 0; tile < num_tiles; ++tile) {
    __syncthreads();  // every warp is done with tile - 1's stage
    if (tile + 1 < num_tiles) load_kv<T>(p, head, kv_begin, kv_len, (tile + 1) * kKeys, stages + ((tile + 1) & 1) * kStageElems);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int key0 = tile * kKeys;
    if (key0 > warp_hi) continue;  // uniform per warp: no row of this warp sees the tile
    const T* k_s = stages + (tile & 1) * kStageElems;
    const T* v_s = k_s + kKeys * kQkStride;

    float s[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kQkDim / 16; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(qa, q_s + (r0 + (lane & 15)) * kQkStride + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nn = 0; nn < kKeys / 16; ++nn) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_s + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * kQkStride + kk * 16 + ((lane >> 3) & 1) * 8);
        Mma<T>::mma(s[2 * nn], qa, kb[0], kb[1]);
        Mma<T>::mma(s[2 * nn + 1], qa, kb[2], kb[3]);
      }
    }
    const bool masked = key0 + kKeys - 1 > min(hi[0], hi[1]);
    if (masked) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + j * 8 + 2 * quad_col + (e & 1) > hi[e >> 1]) s[j][e] = neg_inf();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = quad_reduce_max(mx);
      const float m_new = fmaxf(m[h], mx * p.scale_log2);
      const float base = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = fast_exp2(m[h] - base);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        s[j][2 * h] = fast_exp2(fmaf(s[j][2 * h], p.scale_log2, -base));
        s[j][2 * h + 1] = fast_exp2(fmaf(s[j][2 * h + 1], p.scale_log2, -base));
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int d = 0; d < kVDim / 8; ++d) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
    }
    // A tile whose V rows hold a non-finite value at a key some live row of the warp cannot see
    // (past the first row's last key: the causal diagonal) takes P . V key by key, each row over
    // the keys it sees (value_isolation.cuh; the scan runs on such tiles only).
    if (warp_live && key0 + kKeys - 1 > warp_hi_min) {
      const PartlyVisibleKeys pvk = partly_visible_keys(key0, kKeys, 0, kv_len, 0, warp_hi_min);
      const char* v_rows = reinterpret_cast<const char*>(v_s);
      const bool bad = any_nonfinite<2>(pvk.count() * kVChunks, kNonFinite16<T>, lane, 32, [&](int i) {
        return v_rows + (pvk.key(i / kVChunks) * kVStride + (i % kVChunks) * 8) * 2;
      });
      if (__any_sync(0xffffffffu, bad)) {
        pv_visible_keys<kKeys / 8, kVDim / 8>(
            o, s, key0, [&](int e, int key) { return key <= hi[e]; },
            [&](int key) {
              const T* v = v_s + (key - key0) * kVStride;
              return [v](int dim) { return to_f32(v[dim]); };
            });
        continue;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < kVDim / 16; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_s + (kk * 16 + (lane & 15)) * kVStride + dd * 16 + (lane >> 4) * 8);
        Mma<T>::mma(o[2 * dd], pa, vb[0], vb[1]);
        Mma<T>::mma(o[2 * dd + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = q0 + r0 + quad_row + 8 * h;
    if (t >= q_len) continue;
    const float lsum = quad_reduce_sum(l[h]);
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    T* dst = static_cast<T*>(p.out) + static_cast<int64_t>(q_begin + t) * p.o_ts + head * p.o_hs + 2 * quad_col;
#pragma unroll
    for (int d = 0; d < kVDim / 8; ++d) {
      *reinterpret_cast<uint32_t*>(dst + d * 8) = Mma<T>::pack(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    }
    if (quad_col == 0 && p.lse != nullptr) {
      p.lse[head * p.lse_hs + static_cast<int64_t>(q_begin + t) * p.lse_ts] =
          lse_base2(m[h], lsum);
    }
  }
}

template <typename T>
void launch_typed(const PrefillParams& p, int max_q_len, cudaStream_t stream) {
  static bool configured[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (!configured[device & 63]) {
    cudaFuncSetAttribute(mla_prefill_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    check_launch("cudaFuncSetAttribute(mla_prefill_kernel)");
    configured[device & 63] = true;
  }
  const int q_tiles = (max_q_len + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(p.num_seqs * q_tiles), static_cast<unsigned>(p.num_heads));
  mla_prefill_kernel<T><<<grid, kThreads, kSmemBytes, stream>>>(p, q_tiles);
  check_launch("mla_prefill_kernel");
}

}  // namespace

void launch_prefill(const PrefillParams& params, DType dtype, int max_q_len, void* stream) {
  if (params.num_seqs <= 0 || max_q_len <= 0 || params.num_heads <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::bf16) {
    launch_typed<__nv_bfloat16>(params, max_q_len, s);
  } else if (dtype == DType::f16) {
    launch_typed<__half>(params, max_q_len, s);
  } else {
    throw Error("dtype", detail::concat("CUDA MLA prefill: dtype ", dtype_name(dtype),
                                        " is not supported: expected float16 or bfloat16"));
  }
}

}  // namespace pagedattn::cuda::mla_prefill
