// CUDA_MLA decode, more than 16 rows a request (R = tokens_per_request * H; the compute-bound
// shapes and speculative decodes; a 16-bit cache of the activation dtype or fp8): Hopper wgmma kernel.
//
// What it computes: exactly what mla_decode.cu's kernel computes (see there), per decode token b
// (token t of a request of q tokens and seq_len s) and query head h:
//   s_n = scale * (q[b, h, :576] . row_n[:576]),  o = sum_n softmax(s)_n row_n[:512],  LSE = log sum e^s
// over the request's latent cache rows n < s - q + 1 + t (values = the first 512 elements of the
// key rows), for one plan segment (mla_decode.h) at a time; split segments write the same f32
// partials (o, LSE) that mla_decode.cu's combine kernel merges, uncut ones the output (and LSE)
// directly.
//
// Tiling. A CTA owns 64 (token, head) rows of one part's segments and walks each segment in
// 64-key tiles. Shared memory: Q 64 x 576 (73.7 KB, loaded once a segment), two K/V stages of 64
// keys x 576 (2 x 73.7 KB), P 64 x 64 (activation type, 8 KB), the per-row rescale factors and
// (16-bit caches) a FULL and an EMPTY mbarrier a stage: 230,176 bytes. Roles (16-bit caches, three
// warpgroups, setmaxnreg 232 / 232 / 40):
//   WG0  S = Q . K^T for the whole tile (wgmma m64n64k16 x 36, K = 576, both operands from shared
//        memory, f32 accumulators: 32 registers a thread); the online softmax (running max and
//        sum, in registers); P and alpha (the O rescale factor) to shared memory; then its half
//        of O: O[:, 0:256) = alpha * O + P . V[:, 0:256) (wgmma m64n256k16 x 4, 128 registers).
//   WG1  the other half of O: O[:, 256:512) with WG0's P and alpha.
//   WG2  the copier: tile g of the part (its segments' tiles in order) into stage g % 2 with
//        cp.async (16-byte copies, 8 threads a row; zero-filled past the segment / for a page id
//        outside the cache), page lookups before it waits for the stage; it runs ahead across
//        segment boundaries, so the next segment's first tiles load during this one's epilogue.
// V is read in place from the K tile (the B operand N-major: the tile's rows are keys).
// Hand-offs: FULL(s) (mbarrier, the copier's 128 threads through cp.async.mbarrier.arrive.noinc)
// -> WG0 starts S(t); named barriers over WG0 + WG1 (256 threads): P_READY(t) WG0 wrote P(t) and
// alpha(t) -> WG1 starts its P . V(t) (while WG0's own P . V(t) and then S(t + 1) run: the tensor
// core switches between the warpgroups); P_FREE(t) WG1's P . V(t) finished -> WG0 overwrites P
// and alpha with t + 1; EMPTY(s) (mbarrier, a lane of each of the 8 MMA warps once its P . V(t)
// is done) -> the copier refills stage s. The copier is not a consumer: the probe
// (bench/mla_wgmma_probe.cu, docs/perf/mla.md) measured the old hand-off, where the warpgroup
// that copied also ran half of P . V and refilled a stage only after a round trip through WG0, at
// ~0.3 us a tile over free-running copies.
// Shared layout: every 64-row tile (Q, each stage, P) is stored as 9 (P: 1) column blocks of 64
// elements; block c holds its 64 rows of 128 bytes with the 16-byte chunks XOR-swizzled by
// (row & 7): the wgmma 128-byte swizzle (blocks 1024-byte aligned). Q . K^T reads both operands
// K-major (k step = +32 bytes inside a block); P . V reads P K-major and V N-major (column blocks
// = the 8192-byte leading stride, 8-key groups = the 1024-byte stride).
//
// fp8 caches (e4m3 / e5m2; k_scale folded into the logit scale and the output): a kernel of two
// warpgroups (WG1 copies and runs its half of P . V); the bytes of the two stages hold one 16-bit
// tile (the MMAs' operand) and two raw fp8 stages of 36.9 KB, so as many bytes are in flight as
// with two 16-bit stages. Per tile: WG1 waits for the raw copies, all 256 threads convert them
// (exact) into the 16-bit tile, WG1 refills the raw stage with tile + 2, then S, softmax and both
// halves of P . V run as above; the one converted tile serializes the tiles (S(t + 1) waits for
// P . V(t) and the conversion), which the halved traffic pays for.
// Memory traffic and floor: per 64-key tile 73.7 KB of latent rows (the second head tile of
// H = 128 is the adjacent CTA and mostly reads them from L2), 8.9 MFLOP: 242 FLOP per byte at
// H = 128, so the floor is the tensor rate: 2 * H * seq * 1088 FLOP / the dense GEMM rate.
// Shared-memory reads per tile: S 36 x (2 KB Q + 2 KB K), the tensor core's own rate for n = 64;
// P . V 8 x (2 KB P + 8 KB V).
// Prediction: the tensor core is idle only while WG0 computes the softmax (~15% of a tile), so
// ~60-70% of the tensor rate, about twice the mma.sync kernel's. Measured, with the profile and a
// first version (both warpgroups computing S, n = 32 each: 1.5x the shared-memory reads of the
// tensor rate, every phase behind a CTA barrier) that ran a fifth slower: docs/perf/mla.md.
// racecheck reports the alpha hand-off (WG0 st.shared, bar.arrive; WG1 bar.sync, ld.shared, and
// back through P_FREE) as hazards: it does not credit bar.arrive's release ordering (PTX memory
// model: bar.arrive synchronizes with bar.sync on the same barrier); memcheck is clean.
//
// Precision points: as mla_decode.cu: logits, the softmax state and o in f32 (wgmma f32
// accumulation); P rounded to the activation type before P . V (the row sums use the f32 P);
// exp2 via ex2.approx; split partials f32; the output rounded once (RNE).
//
// Needs sm_90a (wgmma). Built for another target the kernel body is a trap with a static
// shared-memory marker, and wgmma_decode_available() (which reads the marker through
// cudaFuncGetAttributes) makes the builders choose the mma.sync kernel instead.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backends/cuda/common/async_primitives.cuh"
#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "backends/cuda/mla/mla_decode_rows.cuh"
#include "backends/cuda/mla/mla_decode_wgmma.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda::mla_decode {
namespace {

constexpr int kRows = 64;                               // query heads of a CTA
constexpr int kKeys = kKeysPerTile;                     // 64 keys a tile
constexpr int kThreads = 256;                           // the two MMA warpgroups
constexpr int kThreads16 = kThreads + 128;              // 16-bit caches: + the copier warpgroup
constexpr int kChunks = kLatent * 2 / 16;               // 72 16-byte chunks of a row
constexpr int kBlockBytes = kRows * 128;                // one 64-column block of a 64-row tile
constexpr int kTileBytes = kLatent / 64 * kBlockBytes;  // 73,728
constexpr int kPBytes = kBlockBytes;                    // P: 64 x 64
constexpr int kValueCols = kValue / 2;                  // O columns of a warpgroup (256)
// Q, 2 stages, P, alpha (64), the epilogue's row sums and maxima (2 x 64).
constexpr int kSmem = 3 * kTileBytes + kPBytes + 3 * kRows * 4;
static_assert(kKeys == 64 && kRows == 64 && kRows == rows_per_cta(DecodeKernel::wgmma) && kLatent % 64 == 0);
constexpr int kSmem16 = kSmem + 4 * 8;                 // 16-bit caches: + FULL and EMPTY mbarriers a stage
static_assert(kSmem16 <= 232448, "shared memory over the sm_90 limit");

// Named barriers (0 is __syncthreads) over the two MMA warpgroups (256 threads).
constexpr int kBarPReady = 1, kBarPFree = 2, kBarMma = 3;

// The copies of one tile by WG1: kTPR adjacent threads a row (a warp request covers whole 128-byte
// lines), kPasses passes of 128 / kTPR rows. 16-bit rows go to the swizzled stage, fp8 rows
// (576 bytes) unswizzled to a raw stage (convert_tile reads them).
template <bool kFp8>
struct Copy {
  static constexpr int kElem = kFp8 ? 1 : 2;
  static constexpr int kTPR = kFp8 ? 4 : 8;
  static constexpr int kRowChunks = kLatent * kElem / 16;  // 36 or 72
  static constexpr int kPassRows = 128 / kTPR;
  static constexpr int kPasses = kKeys / kPassRows;         // 2 or 4
  static_assert(kRowChunks % kTPR == 0);
};
constexpr int kCopyPasses = Copy<false>::kPasses;  // the most passes (a thread's row offsets)
static_assert(Copy<true>::kPasses <= kCopyPasses);
constexpr int kRawTileBytes = kKeys * kLatent;  // one fp8 tile (36,864 bytes)

// Byte offset in the cache of key `pos` of `request`, or -1 (past the segment's end, or a page
// id outside the cache: the row reads as zeros).
template <bool kFp8>
__device__ __forceinline__ int64_t row_offset(const DecodeParams& p, int request, int pos, int kv_end) {
  if (pos >= kv_end) return -1;
  const int blk_idx = pos / p.block_size;
  const int block = __ldg(p.block_table + static_cast<int64_t>(request) * p.bt_stride + blk_idx);
  if (block < 0 || block >= p.num_blocks) return -1;
  return (static_cast<int64_t>(block) * p.block_stride +
          static_cast<int64_t>(pos - blk_idx * p.block_size) * p.token_stride) * Copy<kFp8>::kElem;
}

// WG1 thread `t1` (0..127) copies rows t1 / kTPR + kPassRows * pass of a tile.
template <bool kFp8>
__device__ __forceinline__ void tile_offsets(const DecodeParams& p, const Segment& seg, int tile, int t1,
                                             int64_t (&offsets)[kCopyPasses]) {
  using C = Copy<kFp8>;
#pragma unroll
  for (int pass = 0; pass < C::kPasses; ++pass) {
    offsets[pass] = row_offset<kFp8>(p, seg.request, seg.kv_start + tile * kKeys + t1 / C::kTPR + pass * C::kPassRows,
                                     seg.kv_end);
  }
}
template <bool kFp8>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const int64_t (&offsets)[kCopyPasses], int t1,
                                          char* stage) {
  using C = Copy<kFp8>;
  const int sub = t1 % C::kTPR;
#pragma unroll
  for (int pass = 0; pass < C::kPasses; ++pass) {
    const int row = t1 / C::kTPR + pass * C::kPassRows;
    const bool valid = offsets[pass] >= 0;
    const char* src = static_cast<const char*>(p.cache) + (valid ? offsets[pass] : 0) + sub * 16;
#pragma unroll
    for (int j = 0; j < C::kRowChunks / C::kTPR; ++j) {
      const int chunk = sub + C::kTPR * j;
      char* dst = kFp8 ? stage + row * kLatent + chunk * 16 : stage + swizzled_offset(row, chunk);
      cp_async_16(dst, src + j * C::kTPR * 16, valid);
    }
  }
}

// fp8 raw tile -> the swizzled 16-bit tile the MMAs read (exact), by all 256 threads: one 16-byte
// chunk (8 values) a thread per step.
template <typename T>
__device__ __forceinline__ void convert_tile(const char* raw, char* tile, int fp8_format) {
  constexpr int kTileChunks = kKeys * kChunks;  // 4,608
  static_assert(kTileChunks % kThreads == 0);
#pragma unroll 6
  for (int idx = threadIdx.x; idx < kTileChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx - row * kChunks;
    const uint2 in = *reinterpret_cast<const uint2*>(raw + row * kLatent + chunk * 8);
    *reinterpret_cast<uint4*>(tile + swizzled_offset(row, chunk)) = fp8x8_to_16bit<T>(in, fp8_format);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Q of the CTA's 64 rows to shared memory (cp.async; idle rows read as zeros), by the two MMA
// warpgroups (threads 0-255); committed, not waited for.
__device__ __forceinline__ void load_q(const DecodeParams& p, const DecodeRequest& req, int r0, char* q_smem) {
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx - row * kChunks;
    bool valid;
    const char* src = q_row(p, req, r0 + row, valid) + chunk * 16;
    cp_async_16(q_smem + swizzled_offset(row, chunk), src, valid);
  }
  cp_async_commit();
}

// WG0: the final row sums and maxima of its rows, for both warpgroups' epilogue.
__device__ __forceinline__ void store_row_stats(const float (&m)[2], const float (&l)[2], float* row_sum,
                                                float* row_max, int r_lo, int quad_col) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    if (quad_col == 0) {
      row_sum[r_lo + 8 * h] = sum;
      row_max[r_lo + 8 * h] = m[h];
    }
  }
}

// Epilogue of a segment: normalizes and writes rows r_lo, r_lo + 8 of the warpgroup's 256 columns
// (split segments: the f32 partial and its LSE; uncut ones: the output and the LSE).
template <typename T>
__device__ __forceinline__ void store_rows(const DecodeParams& p, const DecodeRequest& req, const Segment& seg,
                                           const float (&o)[kValueCols / 2], const float* row_sum,
                                           const float* row_max, int r0, int r_lo, int quad_col, int wg) {
  const bool split = seg.partial_row >= 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    const RowPlace at = row_place(p, req, r0 + r);
    if (!at.valid) continue;
    const float lsum = row_sum[r];
    const float scale = lsum > 0.f ? p.out_scale / lsum : 0.f;
    const float lse = lse_base2(row_max[r], lsum);
    const int col0 = wg * kValueCols + 2 * quad_col;
    if (split) {
      const int64_t prow = partial_row(p, seg.partial_row, r0 + r);
      float* dst = p.partial_out + prow * kValue + col0;
#pragma unroll
      for (int j = 0; j < kValueCols / 8; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * h] * scale, o[4 * j + 2 * h + 1] * scale);
      if (wg == 0 && quad_col == 0) p.partial_lse[prow] = lse;
    } else {
      T* dst = static_cast<T*>(p.out) + at.token * p.o_token_stride + at.head * p.o_head_stride + col0;
#pragma unroll
      for (int j = 0; j < kValueCols / 8; ++j)
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            Mma<T>::pack(o[4 * j + 2 * h] * scale, o[4 * j + 2 * h + 1] * scale);
      if (wg == 0 && quad_col == 0 && p.lse != nullptr)
        p.lse[at.head * p.lse_head_stride + static_cast<int64_t>(at.token) * p.lse_token_stride] = lse;
    }
  }
}

// The segment's number of 64-key tiles.
__device__ __forceinline__ int tile_count(const Segment& seg) {
  return seg.kv_end > seg.kv_start ? (seg.kv_end - seg.kv_start + kKeys - 1) / kKeys : 0;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the wgmma helpers: sm_90a only (see the kernel's #else)
// WG0's S (64 x 64) = Q . K^T of the tile at kv, 36 k16 steps; waits for the result.
template <typename T>
__device__ __forceinline__ void scores(float (&s)[32], const char* q_smem, const char* kv) {
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  wgmma::reg_fence(s);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < kLatent / 16; ++kk) {
    const int off = (kk >> 2) * kBlockBytes + (kk & 3) * 32;
    wgmma::Ops<T>::ss_n64(s, wgmma::smem_desc(q_smem + off, 16, 1024), wgmma::smem_desc(kv + off, 16, 1024));
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::reg_fence(s);
}

// WG0: masks keys past each row's end (the segment's, or its token's causal end), then the online
// softmax of the tile: s becomes P (f32), m / l updated, alpha = the rescale of the old O.
__device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             const DecodeParams& p, const DecodeRequest& req, const Segment& seg,
                                             int tile, int mask_from, int row0, int quad_col) {
  const int key0 = seg.kv_start + tile * kKeys + 2 * quad_col;
  if (seg.kv_start + (tile + 1) * kKeys > mask_from) {
    const int end[2] = {row_key_end(p, req, seg.kv_end, row0), row_key_end(p, req, seg.kv_end, row0 + 8)};
#pragma unroll
    for (int e = 0; e < 32; ++e)
      if (key0 + 8 * (e >> 2) + (e & 1) >= end[(e >> 1) & 1]) s[e] = neg_inf();
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx = quad_max(mx);
    const float m_new = fmaxf(m[h], mx * p.scale_log2);
    const float base = m_new == neg_inf() ? 0.f : m_new;
    alpha[h] = fast_exp2(m[h] - base);
    m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[4 * j + 2 * h] = fast_exp2(fmaf(s[4 * j + 2 * h], p.scale_log2, -base));
      s[4 * j + 2 * h + 1] = fast_exp2(fmaf(s[4 * j + 2 * h + 1], p.scale_log2, -base));
      sum += s[4 * j + 2 * h] + s[4 * j + 2 * h + 1];
    }
    l[h] = l[h] * alpha[h] + sum;
  }
}

// WG0: P (activation type) and alpha to shared memory for both warpgroups' P . V.
template <typename T>
__device__ __forceinline__ void store_p(char* p_smem, float* alpha_smem, const float (&s)[32], const float (&alpha)[2],
                                        int r_lo, int quad_col) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      *reinterpret_cast<uint32_t*>(p_smem + r * 128 + ((j ^ (r & 7)) << 4) + quad_col * 4) =
          Mma<T>::pack(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
    }
    if (quad_col == 0) alpha_smem[r] = alpha[h];
  }
}

// O (this warpgroup's 256 columns, from column block v_block of the tile) = alpha * O + P . V;
// issued and committed, not waited for.
template <typename T>
__device__ __forceinline__ void rescale_and_pv(float (&o)[kValueCols / 2], float a0, float a1, const char* p_smem,
                                               const char* v) {
#pragma unroll
  for (int j = 0; j < kValueCols / 8; ++j) {
    o[4 * j] *= a0;
    o[4 * j + 1] *= a0;
    o[4 * j + 2] *= a1;
    o[4 * j + 3] *= a1;
  }
  wgmma::reg_fence(o);
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < kKeys / 16; ++ks) {
    wgmma::Ops<T>::ss_n256_tb(o, wgmma::smem_desc(p_smem + ks * 32, 16, 1024),
                              wgmma::smem_desc(v + ks * 16 * 128, kBlockBytes, 1024));
  }
  wgmma::commit();
}

#endif

// 16-bit caches: WG2 copies, WG0 / WG1 compute (see the top comment).
template <typename T>
__global__ void __launch_bounds__(kThreads16, 1) mla_decode_wgmma_kernel(const DecodeParams p, int row_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  char* q_smem = smem;                                             // Q tile
  char* stages = q_smem + kTileBytes;                              // 2 K/V tiles
  char* p_smem = stages + 2 * kTileBytes;                          // P (64 x 64)
  float* alpha_smem = reinterpret_cast<float*>(p_smem + kPBytes);  // (64,) O rescale factors
  float* row_sum = alpha_smem + kRows;                             // (64,) epilogue: final row sums
  float* row_max = row_sum + kRows;                                // (64,) epilogue: final maxima (log2)
  uint64_t* full = reinterpret_cast<uint64_t*>(row_max + kRows);   // (2,) a stage's copies landed
  uint64_t* empty = full + 2;                                      // (2,) a stage's last reader done

  pdl::launch_dependents();  // the combine's CTAs may be scheduled (they wait for this grid)
  const int part = blockIdx.x / row_tiles;
  const int r0 = (blockIdx.x - part * row_tiles) * kRows;  // the CTA's first row of a request
  const int wg = threadIdx.x >> 7;                         // 0: S + softmax + O[:, :256); 1: O[:, 256:); 2: copies
  const int t1 = threadIdx.x & 127;                        // thread within the warpgroup
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar::init(&full[s], 128);            // the copier's 128 threads (cp.async.mbarrier.arrive.noinc)
      mbar::init(&empty[s], kThreads / 32);  // a lane of each MMA warp
    }
    mbar::fence_init();
  }
  __syncthreads();
  const int seg_begin = p.part_begin[part], seg_end = p.part_begin[part + 1];

  if (wg == 2) {  // the copier: tile g of the part (across its segments) into stage g & 1
    warpgroup_regs_dec<40>();
    int g = 0;
    for (int seg_i = seg_begin; seg_i < seg_end; ++seg_i) {
      const Segment seg = p.segments[seg_i];
      const int num_tiles = tile_count(seg);
#pragma unroll 1
      for (int tile = 0; tile < num_tiles; ++tile, ++g) {
        int64_t offsets[kCopyPasses];
        tile_offsets<false>(p, seg, tile, t1, offsets);  // page lookups before the wait
        const int s = g & 1;
        if (g >= 2) mbar::wait(&empty[s], (static_cast<uint32_t>(g >> 1) & 1u) ^ 1u);
        load_tile<false>(p, offsets, t1, stages + s * kTileBytes);
        mbar::arrive_on_copies(&full[s]);
      }
    }
    cp_async_wait<0>();
    return;
  }
  warpgroup_regs_inc<232>();
  const int quad_col = lane & 3;
  const int r_lo = (t1 >> 5) * 16 + (lane >> 2);  // accumulator rows r_lo, r_lo + 8
  int g = 0;
  for (int seg_i = seg_begin; seg_i < seg_end; ++seg_i) {
    const Segment seg = p.segments[seg_i];
    const DecodeRequest req = p.requests[seg.request];
    const int num_tiles = tile_count(seg);
    // Keys from mask_from on are masked for some row (each row past its own causal end).
    const int mask_from = min(seg.kv_end, causal_end(req, 0));
    load_q(p, req, r0, q_smem);
    cp_async_wait<0>();
    wgmma::fence_async_smem();
    named_barrier::sync<kThreads>(kBarMma);  // Q visible to both MMA warpgroups

    float o[kValueCols / 2];  // 64 x 256 f32 over the warpgroup: n8 block j -> o[4j .. 4j + 3]
#pragma unroll
    for (int i = 0; i < kValueCols / 2; ++i) o[i] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // WG0: running max (log2 units) and sum
    if (wg == 0) {
#pragma unroll 1
      for (int tile = 0; tile < num_tiles; ++tile, ++g) {
        const int s = g & 1;
        const char* kv = stages + s * kTileBytes;
        mbar::wait(&full[s], static_cast<uint32_t>(g >> 1) & 1u);  // the tile's copies landed
        wgmma::fence_async_smem();
        float sc[32], alpha[2];
        scores<T>(sc, q_smem, kv);
        softmax_tile(sc, m, l, alpha, p, req, seg, tile, mask_from, r0 + r_lo, quad_col);
        if (tile > 0) named_barrier::sync<kThreads>(kBarPFree);  // WG1's P . V(tile - 1) no longer reads P / alpha
        store_p<T>(p_smem, alpha_smem, sc, alpha, r_lo, quad_col);
        wgmma::fence_async_smem();
        named_barrier::arrive<kThreads>(kBarPReady);
        rescale_and_pv<T>(o, alpha[0], alpha[1], p_smem, kv);  // O[:, 0:256) = alpha * O + P . V[:, 0:256)
        wgmma::wait<0>();
        wgmma::reg_fence(o);
        if (lane == 0) mbar::arrive(&empty[s]);  // this warp no longer reads the stage
      }
      store_row_stats(m, l, row_sum, row_max, r_lo, quad_col);
    } else {
#pragma unroll 1
      for (int tile = 0; tile < num_tiles; ++tile, ++g) {
        const int s = g & 1;
        const char* kv = stages + s * kTileBytes;
        named_barrier::sync<kThreads>(kBarPReady);  // P(tile) and alpha(tile) written
        mbar::wait(&full[s], static_cast<uint32_t>(g >> 1) & 1u);  // complete already (WG0 waited): acquire
        wgmma::fence_async_smem();
        rescale_and_pv<T>(o, alpha_smem[r_lo], alpha_smem[r_lo + 8], p_smem, kv + (kValueCols / 64) * kBlockBytes);
        wgmma::wait<0>();
        wgmma::reg_fence(o);
        if (tile + 1 < num_tiles) named_barrier::arrive<kThreads>(kBarPFree);  // WG0 may overwrite P and alpha
        if (lane == 0) mbar::arrive(&empty[s]);
      }
    }
    named_barrier::sync<kThreads>(kBarMma);  // WG0's row sums / maxima visible; every MMA of the segment done
    store_rows<T>(p, req, seg, o, row_sum, row_max, r0, r_lo, quad_col, wg);
    named_barrier::sync<kThreads>(kBarMma);  // Q and the row statistics are reused by the next segment
  }
#else
  // Not built for sm_90a: the static marker tells wgmma_decode_available() to keep this unused.
  __shared__ int not_sm90a_marker[32];
  reinterpret_cast<volatile int*>(not_sm90a_marker)[threadIdx.x & 31] = row_tiles;
  __trap();
#endif
}

// fp8 caches: 256 threads, one converted tile at a time (see the top comment).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_wgmma_fp8_kernel(const DecodeParams p, int row_tiles,
                                                                             int fp8_format) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  char* q_smem = smem;                                             // Q tile
  char* converted = q_smem + kTileBytes;                           // the 16-bit tile the MMAs read
  char* raw_stages = converted + kTileBytes;                       // 2 raw fp8 stages
  char* p_smem = converted + 2 * kTileBytes;                       // P (64 x 64)
  float* alpha_smem = reinterpret_cast<float*>(p_smem + kPBytes);  // (64,) O rescale factors
  float* row_sum = alpha_smem + kRows;                             // (64,) epilogue: final row sums
  float* row_max = row_sum + kRows;                                // (64,) epilogue: final maxima (log2)
  static_assert(2 * kRawTileBytes <= kTileBytes);

  pdl::launch_dependents();  // the combine's CTAs may be scheduled (they wait for this grid)
  const int part = blockIdx.x / row_tiles;
  const int r0 = (blockIdx.x - part * row_tiles) * kRows;  // the CTA's first row of a request
  const int wg = threadIdx.x >> 7;                         // 0: S + softmax + O[:, :256); 1: loads + O[:, 256:)
  const int t1 = threadIdx.x & 127;                        // thread within the warpgroup
  const int lane = threadIdx.x & 31;
  const int quad_col = lane & 3;
  const int r_lo = (t1 >> 5) * 16 + (lane >> 2);  // accumulator rows r_lo, r_lo + 8

  const int seg_end = p.part_begin[part + 1];
  for (int seg_i = p.part_begin[part]; seg_i < seg_end; ++seg_i) {
    const Segment seg = p.segments[seg_i];
    const DecodeRequest req = p.requests[seg.request];
    const int num_tiles = tile_count(seg);
    const int mask_from = min(seg.kv_end, causal_end(req, 0));
    // Prologue: Q by all threads, raw tiles 0 and 1 by WG1.
    load_q(p, req, r0, q_smem);
    int64_t offsets[kCopyPasses];
    if (wg == 1) {
      for (int t = 0; t < 2; ++t) {
        if (t < num_tiles) {
          tile_offsets<true>(p, seg, t, t1, offsets);
          load_tile<true>(p, offsets, t1, raw_stages + t * kRawTileBytes);
        }
        cp_async_commit();
      }
    } else {
      cp_async_wait<0>();
    }

    float o[kValueCols / 2];  // 64 x 256 f32 over the warpgroup: n8 block j -> o[4j .. 4j + 3]
#pragma unroll
    for (int i = 0; i < kValueCols / 2; ++i) o[i] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // WG0: running max (log2 units) and sum
    // Per tile, WG1 waits for its raw copies, all 256 threads convert them, WG1 refills the raw
    // stage with tile + 2 (the copies of tile + 1 and tile + 2 are in flight during the tile's
    // MMAs), then S, softmax and both halves of P . V with one hand-off (P_READY).
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
      if (wg == 1) {
        if (tile + 2 < num_tiles) tile_offsets<true>(p, seg, tile + 2, t1, offsets);
        cp_async_wait<1>();  // Q and raw tile `tile` landed; tile + 1 may be in flight
      }
      __syncthreads();  // Q and the raw tile visible; every MMA of tile - 1 done (converted tile, P, alpha free)
      convert_tile<T>(raw_stages + (tile & 1) * kRawTileBytes, converted, fp8_format);
      wgmma::fence_async_smem();
      __syncthreads();  // converted tile visible to the MMAs; the raw stage free
      if (wg == 1) {
        if (tile + 2 < num_tiles) load_tile<true>(p, offsets, t1, raw_stages + (tile & 1) * kRawTileBytes);
        cp_async_commit();
      }
      if (wg == 0) {
        float sc[32], alpha[2];
        scores<T>(sc, q_smem, converted);
        softmax_tile(sc, m, l, alpha, p, req, seg, tile, mask_from, r0 + r_lo, quad_col);
        store_p<T>(p_smem, alpha_smem, sc, alpha, r_lo, quad_col);
        wgmma::fence_async_smem();
        named_barrier::arrive<kThreads>(kBarPReady);
        rescale_and_pv<T>(o, alpha[0], alpha[1], p_smem, converted);
      } else {
        named_barrier::sync<kThreads>(kBarPReady);  // P(tile) and alpha(tile) written
        rescale_and_pv<T>(o, alpha_smem[r_lo], alpha_smem[r_lo + 8], p_smem,
                          converted + (kValueCols / 64) * kBlockBytes);
      }
      wgmma::wait<0>();
      wgmma::reg_fence(o);
    }
    if (wg == 0) store_row_stats(m, l, row_sum, row_max, r_lo, quad_col);
    __syncthreads();  // WG0's row sums / maxima visible; every MMA and copy of the segment done
    store_rows<T>(p, req, seg, o, row_sum, row_max, r0, r_lo, quad_col, wg);
    __syncthreads();  // Q, the tiles and the row statistics are reused by the next segment
  }
#else
  __shared__ int not_sm90a_marker[32];
  reinterpret_cast<volatile int*>(not_sm90a_marker)[threadIdx.x & 31] = row_tiles;
  __trap();
#endif
}

// Raises the kernel's shared-memory limit on the current device (once per device).
void configure_wgmma_decode() {
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured.load() & bit) != 0) return;
  for (auto* kernel : {mla_decode_wgmma_kernel<__nv_bfloat16>, mla_decode_wgmma_kernel<__half>}) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem16);
    check_launch("cudaFuncSetAttribute(mla_decode_wgmma_kernel)");
  }
  for (auto* kernel : {mla_decode_wgmma_fp8_kernel<__nv_bfloat16>, mla_decode_wgmma_fp8_kernel<__half>}) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    check_launch("cudaFuncSetAttribute(mla_decode_wgmma_fp8_kernel)");
  }
  configured.fetch_or(bit);
}

}  // namespace

bool wgmma_decode_available() {
  static std::atomic<uint64_t> known{0}, available{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((known.load() & bit) == 0) {
    cudaFuncAttributes attributes{};
    const bool ok = cudaFuncGetAttributes(&attributes, mla_decode_wgmma_kernel<__nv_bfloat16>) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    if (ok && attributes.sharedSizeBytes == 0) available.fetch_or(bit);
    known.fetch_or(bit);
  }
  return (available.load() & bit) != 0;
}

void launch_decode_wgmma(const DecodeParams& params, DType activation, int fp8_format, int num_parts, void* stream) {
  configure_wgmma_decode();
  const int tiles = row_tiles(DecodeKernel::wgmma, params.tokens_per_request * params.num_heads);
  const auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(num_parts * tiles));
  const bool bf16 = activation == DType::bf16;
  if (fp8_format != 0) {
    auto* kernel = bf16 ? mla_decode_wgmma_fp8_kernel<__nv_bfloat16> : mla_decode_wgmma_fp8_kernel<__half>;
    kernel<<<grid, kThreads, kSmem, s>>>(params, tiles, fp8_format);
  } else {
    auto* kernel = bf16 ? mla_decode_wgmma_kernel<__nv_bfloat16> : mla_decode_wgmma_kernel<__half>;
    kernel<<<grid, kThreads16, kSmem16, s>>>(params, tiles);
  }
  check_launch("mla_decode_wgmma_kernel");
}

}  // namespace pagedattn::cuda::mla_decode
