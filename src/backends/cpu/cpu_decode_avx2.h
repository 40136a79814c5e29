// Direct decode kernel (AVX2, f32 FMA) of the CPU backend: the per-(chunk, KV head) compute of the
// direct decode driver (cpu_decode_direct.h: head-fused decode items computed on the cache rows in
// place, no K transpose, no V pack). Included by the AVX2 translation unit
// (cpu_kernels_avx2.cpp); internal linkage only.
//
// Items (direct_decode_avx2_applies): the driver's shape conditions and a bf16, f16, fp8 e4m3 or
// fp8 e5m2 cache; any activation dtype (Q is converted to f32, as by the tile kernel). Everything
// else on the AVX2 path (f32 caches, split-KV and cascade items) runs the tile kernel.
// PAGEDATTN_CPU_DECODE_KERNEL=tile turns it off (cpu_dispatch.cpp).
//
// Cache rows are widened to f32 in registers, 16 elements (one group) at a time (widen16):
//   bf16   one 32-byte load, vpunpck{l,h}wd with zero -> 2 ymm in a permuted dim order (lo = dims
//          0-3, 8-11 of the group, hi = 4-7, 12-15): Q rows are stored in that order at setup and
//          O rows are kept in it, put back once per row at the end (unpermute).
//   f16    vcvtph2ps; e5m2: the byte is the high half of an f16 (vpunpck{l,h}bw, vcvtph2ps).
//   e4m3   the sign-extended byte << 7 with bits 15, 13..7 kept is the f16 of value / 256
//          (normal and subnormal codes alike; the 256 folds into the logit scale and the output
//          normalisation: key_factor, value_factor). Its NaN code S.1111.111 would read as a finite
//          f16, so each (chunk, head) checks its K and V rows for it after the first row block's
//          Q·Kᵀ (rows_of: the rows are in L1 or on their way then) and, when one is there, is
//          computed again from the start with the NaN-exact conversion (a blend).
// Order: per chunk, on AMD CPUs over NHD caches with at most 4 rows a KV head (one register block:
// decode with G <= 4), key-major (avx2_chunk_major): Q·Kᵀ of every head with the key pairs outer
// and the heads inner, which reads the chunk's K run front to back (head by head it is read in a
// token-row stride, which the hardware prefetchers follow worse), then per head the softmax and
// P·V below; otherwise head by head (fma_rows_of), each head's steps as below.
// Tiling per (chunk of 16 keys, KV head), rows (query heads x query tokens) in blocks of R <= 4:
//   S = Q·Kᵀ  key pairs (2i, 2i+1): per group, the two K rows widened once, times the R query rows
//             (f32, loaded from L1) into 2R ymm accumulators; vhaddps folds each pair into scratch,
//             and a second hadd level + a 128-bit lane swap gives 2 ymm of 8 logits per row.
//   softmax   per row: scale, soft-cap, ALiBi, mask, exp, P (f32, 16 values); l kept as 16 lane
//             sums. Lazy max as cpu_decode_avx512.h (m kept while no logit exceeds it by more than
//             kDirectRescaleSlack: alpha = 1, O not rescaled; exact).
//   O += P·V  per group of 16 dims: R x 2 accumulators over the chunk's live keys, each V row
//             widened once and multiplied by the broadcast P of every row.
// Per key and row: D + Dv FMAs (8 lanes) and one widening of the key's K and V rows per row
// block. At G = 4 that is 2 x 8 FMAs per 16 cache elements of K or V (32 bytes of bf16):
// 8 B/cycle/core with both FMA ports busy, 4 B/cycle for fp8. A core's share of DRAM bandwidth
// is a few B/cycle, so the kernel keeps up with it only while the FMAs are busy most of the
// time, the softmax, the widening, the folds and the prefetches included (docs/perf/cpu.md).
//
// Precision: exact conversions to f32 (as the AVX2 tile kernel), f32 FMA accumulation, P in f32,
// one rounding at the output.
#pragma once

#include <cstring>

#include "cpu_avx2_ops.h"
#include "cpu_decode_direct.h"

namespace pagedattn::cpu {
namespace {

// Whether the AVX2 direct kernel runs this item (see the file comment).
inline bool direct_decode_avx2_applies(const AttentionArgs& a, const WorkItem& it) {
  const DType dt = a.kv.dtype;
  return (dt == DType::bf16 || dt == DType::f16 || dt == DType::fp8_e4m3 ||
          dt == DType::fp8_e5m2) &&
         direct_decode_shape_applies(a, it);
}

// 16 elements of a cache row (type DT) at src, as f32: lo, hi (see the file comment for the
// order). kNanSafe (e4m3 only): the NaN code reads as NaN.
template <DType DT, bool kNanSafe>
__attribute__((always_inline)) inline void widen16(const char* src, __m256& lo, __m256& hi) {
  if constexpr (DT == DType::bf16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i z = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
  } else if constexpr (DT == DType::f16 || DT == DType::fp8_e5m2) {
    lo = Vec256::load_f32<DT>(src, 0);
    hi = Vec256::load_f32<DT>(src, 8);
  } else {
    static_assert(DT == DType::fp8_e4m3);
    // All 16 bytes sign-extended to words in one ymm; the f16 bit patterns (value / 256) are
    // built on the ymm, then each half converted.
    const __m256i s =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7),
                                 _mm256_set1_epi16(static_cast<short>(0xBF80)));
    if constexpr (kNanSafe) {  // the NaN code's words become an f16 NaN
      const __m256i m7f = _mm256_set1_epi16(0x7F);
      h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00),
                             _mm256_cmpeq_epi16(_mm256_and_si256(s, m7f), m7f));
    }
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
}

// Whether one of the n K rows or n V rows (k_stride, v_stride bytes apart) of d fp8 e4m3 values
// (d a multiple of 16) holds the NaN code S.1111.111: the largest value of x & 0x7F, so a running
// unsigned byte max of x & 0x7F reaches 0x7F exactly when one is there. kD: d when known at
// compile time (the loop then unrolled), else 0.
template <int kD>
__attribute__((always_inline)) inline bool e4m3_rows_have_nan_d(const char* k, int64_t k_stride,
                                                                const char* v, int64_t v_stride,
                                                                int n, int d_runtime) {
  const int d = kD > 0 ? kD : d_runtime;
  const __m256i m7f = _mm256_set1_epi8(0x7F);
  __m256i mk = _mm256_setzero_si256(), mv = _mm256_setzero_si256();
  const auto load = [&](const char* p, int bytes) {  // 32 or 16 bytes, the rest zero
    return bytes == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                       : _mm256_inserti128_si256(
                             _mm256_setzero_si256(),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), 0);
  };
  for (int t = 0; t < n; ++t) {
    const char* kr = k + t * k_stride;
    const char* vr = v + t * v_stride;
#pragma GCC unroll 8
    for (int j = 0; j < d; j += 32) {
      const int bytes = d - j >= 32 ? 32 : 16;
      mk = _mm256_max_epu8(mk, _mm256_and_si256(load(kr + j, bytes), m7f));
      mv = _mm256_max_epu8(mv, _mm256_and_si256(load(vr + j, bytes), m7f));
    }
  }
  const __m256i hit = _mm256_cmpeq_epi8(_mm256_max_epu8(mk, mv), m7f);
  return !_mm256_testz_si256(hit, hit);
}

inline bool e4m3_rows_have_nan(const char* k, int64_t k_stride, const char* v, int64_t v_stride,
                               int n, int d) {
  if (d == 128) return e4m3_rows_have_nan_d<128>(k, k_stride, v, v_stride, n, d);
  return e4m3_rows_have_nan_d<0>(k, k_stride, v, v_stride, n, d);
}

// 0, computed from x (see zero_after_bits).
inline int64_t zero_after(__m256 x) {
  return zero_after_bits(_mm_cvtsi128_si32(_mm_castps_si128(_mm256_castps256_ps128(x))));
}

// The prefetches of key pair tp (Avx2PrefetchPlan), into L1: this head's V rows 2tp, 2tp + 1 (read
// by P·V right after the loop) and the K rows key_lookahead keys ahead, running on into the next
// head's rows. A head's K rows sit a token stride apart (2 KiB in an NHD page), which the L1
// streamer does not follow: without the lookahead Q·Kᵀ waited on each of them from L2 (the loop
// alone on L2-resident rows: 1489 -> 853 cycles per (chunk, head)). Into L2, where the plan says
// so: the pair's part of the head's share of the chunk kDirectPrefetchChunks ahead (the driver's
// plan, as the AVX-512 kernel).
struct Avx2PrefetchPlan {
  bool l2 = false;        // the L2 prefetches of the chunks ahead
  int key_lookahead = 4;  // keys between a K row's L1 prefetch and its use (<= kDirectChunk)
};

// The plan for this CPU, from its vendor (cpu_vendor). Measured (docs/perf/cpu.md):
// on the Intel AVX2 machine the hardware prefetchers kept up without L2 prefetches (decode was
// faster without them) and a 4-key lookahead was enough; on the AMD machine, without them Q·Kᵀ
// waited on its K rows from DRAM, and an 8-key lookahead was faster than 4.
inline Avx2PrefetchPlan avx2_prefetch_plan() {
  // (read per Q·Kᵀ call, outside its loop; cpu_vendor is an atomic load, so that tests can
  // switch the vendor: set_cpu_vendor_override)
  return cpu_vendor() == CpuVendor::amd ? Avx2PrefetchPlan{true, 8} : Avx2PrefetchPlan{};
}

// k: this head's K rows of the chunk; l2_bytes: 2 rows where the plan prefetches into L2, else 0.
__attribute__((always_inline)) inline void avx2_prefetch_pair(const DirectPrefetch& pf,
                                                              const char* k, int tp, int64_t pace,
                                                              int64_t l2_bytes, int lookahead) {
  const char* l1_v = pf.l1_v + (2 * tp) * pf.v_stride + pace;
  const int j = 2 * tp + lookahead;  // the next K rows: this head's, then the next head's
  const char* l1_k = (j < kDirectChunk ? k + j * pf.k_stride
                                       : pf.l1_k + (j - kDirectChunk) * pf.k_stride) + pace;
  const char* l2_k = pf.l2_k + tp * 2 * pf.row_bytes + pace;
  const char* l2_v = pf.l2_v + tp * 2 * pf.row_bytes + pace;
  for (int64_t l = 0; l < l2_bytes; l += 64) __builtin_prefetch(l2_k + l, 0, 2);
  for (int64_t l = 0; l < l2_bytes; l += 64) __builtin_prefetch(l2_v + l, 0, 2);
  for (int64_t l = 0; l < pf.row_bytes; l += 64) {
    __builtin_prefetch(l1_v + l, 0, 3);
    __builtin_prefetch(l1_v + pf.v_stride + l, 0, 3);
    __builtin_prefetch(l1_k + l, 0, 3);
    __builtin_prefetch(l1_k + pf.k_stride + l, 0, 3);
  }
}

template <DType DT>
constexpr int64_t kElemBytes = DT == DType::bf16 || DT == DType::f16 ? 2 : 1;

// One key pair of Q·Kᵀ: R rows (q: R rows of D f32 in the kernel's order, row stride D) times the
// K rows ka, kb; red_pair[r * 64] (r < R) = the pair's 8 partial sums of row r,
// [a01, a23, b01, b23 | a45, a67, b45, b67] (sums of adjacent lanes; avx2_fold finishes them).
// kD: D where known at compile time (the group loop then unrolled), else 0. Returns b[0]'s
// accumulator (for the prefetch pacing of the caller).
template <DType DT, bool kNanSafe, int R, int kD>
__attribute__((always_inline)) inline __m256 avx2_qk_pair(const float* q, int d_runtime,
                                                          const char* ka, const char* kb,
                                                          float* red_pair) {
  const int d = kD > 0 ? kD : d_runtime;
  __m256 a[R], b[R];
  for (int r = 0; r < R; ++r) {
    a[r] = _mm256_setzero_ps();
    b[r] = _mm256_setzero_ps();
  }
#pragma GCC unroll 8
  for (int g = 0; g < d; g += 16) {
    __m256 al, ah, bl, bh;
    widen16<DT, kNanSafe>(ka + g * kElemBytes<DT>, al, ah);
    widen16<DT, kNanSafe>(kb + g * kElemBytes<DT>, bl, bh);
    for (int r = 0; r < R; ++r) {
      const float* qr = q + static_cast<size_t>(r) * d + g;
      __m256 q0 = _mm256_loadu_ps(qr), q1 = _mm256_loadu_ps(qr + 8);
      // In registers: as memory operands of both keys' FMAs each Q vector would be loaded
      // twice, and the loop would be bound by its loads (20 per 16 FMAs) instead of its FMAs.
      asm("" : "+x"(q0), "+x"(q1));
      a[r] = _mm256_fmadd_ps(q0, al, a[r]);
      b[r] = _mm256_fmadd_ps(q0, bl, b[r]);
      a[r] = _mm256_fmadd_ps(q1, ah, a[r]);
      b[r] = _mm256_fmadd_ps(q1, bh, b[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(red_pair + r * 64, _mm256_hadd_ps(a[r], b[r]));
  return b[0];
}

// The logits of R rows from their 8 pairs' partial sums (red: row r's pair tp at r * 64 + tp * 8):
// logits[r][0] lane j = key j, logits[r][1] lane j = key 8 + j.
template <int R>
__attribute__((always_inline)) inline void avx2_fold(const float* red, __m256 (*logits)[2]) {
  for (int r = 0; r < R; ++r) {
    const float* x = red + r * 64;
    for (int half = 0; half < 2; ++half) {
      const float* h = x + half * 32;
      // keys 4i .. 4i+3 of the half: lower 128 bits the sums of dims' first half, upper the second
      const __m256 g0 = _mm256_hadd_ps(_mm256_loadu_ps(h), _mm256_loadu_ps(h + 8));
      const __m256 g1 = _mm256_hadd_ps(_mm256_loadu_ps(h + 16), _mm256_loadu_ps(h + 24));
      logits[r][half] = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                      _mm256_permute2f128_ps(g0, g1, 0x31));
    }
  }
}

// Logits of R rows (q: R rows of D f32 in the kernel's order, row stride D) for the 16 keys of a
// chunk (key t at k + t * k_stride; from `live` on, the zero row): logits[r][0] lane j = key j,
// logits[r][1] lane j = key 8 + j. red: scratch of R x 8 x 8 f32. prefetch_into: nullptr or the
// head's prefetch plan.
template <DType DT, bool kNanSafe, int R, bool kFull>
__attribute__((always_inline)) inline void avx2_qk(const float* q, int d, const char* k,
                                                   int64_t k_stride, int live, float* red,
                                                   __m256 (*logits)[2],
                                                   const DirectPrefetch* prefetch_into) {
  // A local copy: the vector stores below may alias any memory.
  const bool prefetch = prefetch_into != nullptr;
  DirectPrefetch pf;
  if (prefetch) pf = *prefetch_into;
  const Avx2PrefetchPlan plan = avx2_prefetch_plan();
  const int64_t l2_bytes = plan.l2 ? 2 * pf.row_bytes : 0;
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {
    const char* ka = direct_key_row<kFull>(k, k_stride, live, 2 * tp);
    const char* kb = direct_key_row<kFull>(k, k_stride, live, 2 * tp + 1);
    const __m256 b0 = avx2_qk_pair<DT, kNanSafe, R, 0>(q, d, ka, kb, red + tp * 8);
    if (prefetch) avx2_prefetch_pair(pf, k, tp, zero_after(b0), l2_bytes, plan.key_lookahead);
  }
  avx2_fold<R>(red, logits);
}

// Online softmax of rows [row0, row0 + rows) over one chunk (logits as avx2_qk; keys t0 ..): P (f32)
// into the P scratch, m, l (lane sums) and alpha updated. Returns whether any row's O needs
// rescaling (alpha != 1). Not a template: one copy for every register block shape.
inline bool avx2_direct_softmax(const ItemContext& c, float* lsum, int row0, int rows,
                                const __m256 (*logits)[2], int t0) {
  const AttentionArgs& a = *c.args;
  const __m256i kpos0 =
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(t0));
  const __m256i kpos[2] = {kpos0, _mm256_add_epi32(kpos0, _mm256_set1_epi32(8))};
  const __m256 vscale = _mm256_set1_ps(c.logit_scale);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256 lowest = _mm256_set1_ps(kLowestFinite);
  const bool capped = a.soft_cap > 0.f;
  const bool alibi = a.alibi_slopes != nullptr;
  float* p = static_cast<float*>(c.p) + static_cast<size_t>(row0) * kDirectChunk;
  bool rescale = false;
  for (int r = 0; r < rows; ++r) {
    const int i = row0 + r;
    const __m256i lo = _mm256_set1_epi32(c.lo[i] - 1), hi = _mm256_set1_epi32(c.hi[i]);
    __m256 x[2];
    for (int h = 0; h < 2; ++h) {
      x[h] = _mm256_mul_ps(logits[r][h], vscale);
      if (capped) {
        x[h] = _mm256_mul_ps(_mm256_set1_ps(a.soft_cap),
                             vec_tanh<Vec256>(_mm256_mul_ps(x[h], _mm256_set1_ps(1.f / a.soft_cap))));
      }
      if (alibi) {
        const __m256 dist = Vec256::abs(
            _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_set1_epi32(c.pos[i]), kpos[h])));
        x[h] = _mm256_fnmadd_ps(_mm256_set1_ps(c.slope[i]), dist, x[h]);
      }
      const __m256i valid =
          _mm256_and_si256(_mm256_cmpgt_epi32(kpos[h], lo), _mm256_cmpgt_epi32(hi, kpos[h]));
      x[h] = _mm256_blendv_ps(neg_inf, x[h], _mm256_castsi256_ps(valid));
    }
    const __m256 threshold = _mm256_set1_ps(c.m[i] + kDirectRescaleSlack);
    const bool exceeds = _mm256_movemask_ps(_mm256_or_ps(
                             _mm256_cmp_ps(x[0], threshold, _CMP_GT_OQ),
                             _mm256_cmp_ps(x[1], threshold, _CMP_GT_OQ))) != 0;
    const float alpha = direct_lazy_max(
        c, i, exceeds, [&] { return Vec256::hmax(_mm256_max_ps(x[0], x[1])); }, &rescale);
    float m_new = c.m[i];
    float* prow = p + r * kDirectChunk;
    if (m_new == kNegInf) {
      // As cpu_decode_avx512.h: a row whose only visible logits so far are NaN lands here too
      // (`exceeds` is false for NaN) and must become NaN, not give the key weight 0.
      const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(x[0], x[0], _CMP_UNORD_Q),
                                      _mm256_cmp_ps(x[1], x[1], _CMP_UNORD_Q));
      if (_mm256_movemask_ps(nan) == 0) {  // nothing visible yet
        std::memset(prow, 0, kDirectChunk * sizeof(float));
        continue;
      }
      m_new = c.m[i] = __builtin_nanf("");  // P, l, O and the LSE of the row NaN from here on
    }
    const __m256 vm = _mm256_set1_ps(m_new), valpha = _mm256_set1_ps(alpha);
    float* l = lsum + static_cast<size_t>(i) * kDirectChunk;
    for (int h = 0; h < 2; ++h) {
      // masked (-inf) lanes give 0 and NaN logits NaN, as the tile kernel's softmax
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x[h], lowest, _CMP_LT_OQ),
                                        Vec256::exp(_mm256_sub_ps(x[h], vm)));
      _mm256_storeu_ps(prow + 8 * h, e);
      _mm256_storeu_ps(l + 8 * h, _mm256_fmadd_ps(_mm256_loadu_ps(l + 8 * h), valpha, e));
    }
  }
  return rescale;
}

// O[r] += P[r] · V over the chunk's keys (keys t0 + j). Each V row is read only for the rows that
// can see its key (lo[r] <= key < hi[r], key < t0 + live): keys every row of the block sees run
// for all rows at once; the few "ragged" ones (a causal end between the tokens of a multi-token
// decode, a window start) row by row; keys no row sees are not read. So a row never multiplies a V
// row it cannot see (P = 0 would keep a NaN or an infinity there: 0 * NaN = NaN), and the output
// does not depend on what masked slots hold.
template <DType DT, bool kNanSafe, int R, bool kFull>
__attribute__((always_inline)) inline void avx2_pv(float* o, int dv, const float* p, const char* v,
                                                   int64_t v_stride, int live, const int32_t* lo,
                                                   const int32_t* hi, int t0,
                                                   const char* l2_ahead = nullptr,
                                                   int64_t l2_bytes = 0) {
  const ChunkKeys keys = chunk_keys_seen(lo, hi, R, t0, kFull ? kDirectChunk : live);
  // l2_ahead: l2_bytes (a multiple of 64 per group) prefetched into L2, spread over the groups
  const int64_t l2_group = l2_ahead != nullptr ? l2_bytes / (dv / 16) : 0;
  for (int g = 0; g < dv; g += 16) {
    for (int64_t l = 0; l < l2_group; l += 64) __builtin_prefetch(l2_ahead + (g / 16) * l2_group + l, 0, 2);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + static_cast<size_t>(r) * dv + g);
      acc[r][1] = _mm256_loadu_ps(o + static_cast<size_t>(r) * dv + g + 8);
    }
    const char* vg = v + g * kElemBytes<DT>;
#pragma GCC unroll 4
    for (int t = keys.all_lo; t < keys.all_hi; ++t) {
      __m256 vl, vh;
      widen16<DT, kNanSafe>(vg + t * v_stride, vl, vh);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * kDirectChunk + t);
        acc[r][0] = _mm256_fmadd_ps(pb, vl, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, vh, acc[r][1]);
      }
    }
    const auto ragged = [&](int t_begin, int t_end) {  // the rows that see each key
      for (int t = t_begin; t < t_end; ++t) {
        __m256 vl, vh;
        widen16<DT, kNanSafe>(vg + t * v_stride, vl, vh);
        for (int r = 0; r < R; ++r) {
          if (t0 + t < lo[r] || t0 + t >= hi[r]) continue;
          const __m256 pb = _mm256_broadcast_ss(p + r * kDirectChunk + t);
          acc[r][0] = _mm256_fmadd_ps(pb, vl, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pb, vh, acc[r][1]);
        }
      }
    };
    ragged(keys.any_lo, keys.all_lo);
    ragged(keys.all_hi, keys.any_hi);
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + static_cast<size_t>(r) * dv + g, acc[r][0]);
      _mm256_storeu_ps(o + static_cast<size_t>(r) * dv + g + 8, acc[r][1]);
    }
  }
}

// The rows [row0, row0 + rows) of one KV head over a chunk, for the f32 FMA kernels (DirectAvx2
// here, DirectAvx512Fma in cpu_decode_avx512_fma.h), in register blocks of up to kDirectRowBlock
// rows: K::qk (Q·Kᵀ into K::Logits<R>; the head's prefetches with the first block), K::softmax
// (the online softmax: P, m, l, alpha; O rescaled when it says so), K::pv (O += P·V). Returns false, having
// changed nothing but scratch, when kCheckNan and one of the chunk's live K or V rows holds the
// e4m3 NaN code: checked after the first block's Q·Kᵀ, before anything but scratch is written
// (the K rows are in L1, just read, and the V rows on their way, prefetched by the loop, so the
// check costs no wait of its own for K, where a pass ahead of Q·Kᵀ took the misses of both).
template <class K, DType DT, bool kNanSafe, bool kFull, bool kCheckNan = false>
inline bool fma_rows_of(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                        const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                        int live, const DirectPrefetch& pf) {
  const int d = c.head_size;
  bool nan_code = false;
  for (int rb = 0; rb < rows && !nan_code; rb += kDirectRowBlock) {
    const int i = row0 + rb;
    with_static_int<kDirectRowBlock>(imin(kDirectRowBlock, rows - rb), [&](auto rr) {
      constexpr int R = decltype(rr)::value;
      typename K::template Logits<R> logits;
      K::template qk<DT, kNanSafe, R, kFull>(static_cast<const float*>(c.q) + static_cast<size_t>(i) * d,
                                              d, k, k_stride, live, red, logits,
                                              rb == 0 ? &pf : nullptr);  // prefetch once per head
      if constexpr (kCheckNan) {
        if (rb == 0 && e4m3_rows_have_nan(k, k_stride, v, v_stride, live, d)) {
          nan_code = true;
          return;
        }
      }
      const int dv = c.head_size_v;
      float* o = c.o + static_cast<size_t>(i) * dv;
      if (K::softmax(c, lsum, i, R, logits, t0)) direct_rescale_rows(o, dv, c.alpha + i, R);
      K::template pv<DT, kNanSafe, R, kFull>(
          o, dv, static_cast<const float*>(c.p) + static_cast<size_t>(i) * kDirectChunk, v, v_stride,
          live, c.lo + i, c.hi + i, t0);
    });
  }
  return !nan_code;
}

// An f32 FMA kernel's head_chunk (cpu_decode_direct.h): the cache dtype's fma_rows_of; e4m3 with
// the fast widening and its check, and again with the NaN-exact widening where the check finds
// the NaN code.
template <class K, bool kFull>
inline void fma_head_chunk(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                           const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                           int live, const DirectPrefetch& pf) {
  switch (c.args->kv.dtype) {
    case DType::bf16:
      fma_rows_of<K, DType::bf16, false, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride,
                                                t0, live, pf);
      break;
    case DType::f16:
      fma_rows_of<K, DType::f16, false, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride,
                                               t0, live, pf);
      break;
    case DType::fp8_e5m2:
      fma_rows_of<K, DType::fp8_e5m2, false, kFull>(c, lsum, red, row0, rows, k, k_stride, v,
                                                    v_stride, t0, live, pf);
      break;
    default:  // fp8_e4m3 (the kernels' applies conditions)
      if (!fma_rows_of<K, DType::fp8_e4m3, false, kFull, true>(c, lsum, red, row0, rows, k,
                                                               k_stride, v, v_stride, t0, live, pf)) {
        fma_rows_of<K, DType::fp8_e4m3, true, kFull>(c, lsum, red, row0, rows, k, k_stride, v,
                                                     v_stride, t0, live, pf);
      }
      break;
  }
}

// One chunk of all KV heads, key-major (DirectAvx2::chunk_major). On an NHD cache a chunk is one
// run of 16 token rows, each the rows of every head side by side, and head_chunk's order (head by
// head, a head's 16 rows a token stride apart) walks it in a stride; here Q·Kᵀ runs the key pairs
// outer and the heads inner, so K is read front to back, then per head the fold, the online
// softmax and O += P·V (head_chunk's steps, V rows a token stride apart). Rows: R per head, head
// b's at b * R. red: rows x 64 f32 (each row's 8 pairs of partial sums).
// Prefetches (the AMD plan measured in docs/perf/cpu.md, session 29): into L2 the chunk
// kDirectPrefetchChunks ahead, its K run front to back over Q·Kᵀ and each head's share of its V
// run over that head's P·V, so that the fills are spread over the whole chunk's work instead of
// Q·Kᵀ alone; into L1 the V rows of the next head (head 0's over the last key pair of Q·Kᵀ), read
// by its P·V. K needs no L1 prefetch here: it is read in address order.
// e4m3 (kCheckNan): a head whose K or V rows hold the NaN code has its Q·Kᵀ redone with the
// NaN-exact widening (red is scratch) and its P·V done with it.
template <DType DT, int R, int kD, bool kFull, bool kCheckNan>
inline void avx2_chunk_major(ItemContext& c, float* lsum, float* red, int heads, const char* k,
                             int64_t k_token, int64_t k_head, const char* v, int64_t v_token,
                             int64_t v_head, int t0, int live, float key_factor,
                             const char* k_ahead, const char* v_ahead) {
  const AttentionArgs& a = *c.args;
  const int d = kD > 0 ? kD : c.head_size;
  const int dv = c.head_size_v;
  const float* q = static_cast<const float*>(c.q);
  const char* zero = reinterpret_cast<const char*>(kZeroRow);
  const int64_t row_bytes = static_cast<int64_t>(d) * kElemBytes<DT>;
  const auto qk_head = [&]<bool kNanSafe>(int b, int tp) {
    const char* ka = kFull || 2 * tp < live ? k + 2 * tp * k_token + b * k_head : zero;
    const char* kb = kFull || 2 * tp + 1 < live ? k + (2 * tp + 1) * k_token + b * k_head : zero;
    return avx2_qk_pair<DT, kNanSafe, R, kD>(q + static_cast<size_t>(b) * R * d, d, ka, kb,
                                            red + static_cast<size_t>(b) * R * 64 + tp * 8);
  };
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {
    for (int b = 0; b < heads; ++b) {
      const int64_t pace = zero_after(qk_head.template operator()<false>(b, tp));
      // K of the chunk ahead: rows 2tp, 2tp + 1 of the run, head b's part
      const char* l2 = k_ahead + (static_cast<int64_t>(tp) * heads + b) * 2 * row_bytes + pace;
      for (int64_t l = 0; l < 2 * row_bytes; l += 64) __builtin_prefetch(l2 + l, 0, 2);
      if (tp == kDirectChunk / 2 - 1) {  // head 0's V rows, spread over the heads
        for (int t = 2 * b; t < kDirectChunk; t += 2 * heads) {
          const char* vr = v + t * v_token + pace;
          for (int64_t l = 0; l < row_bytes; l += 64) {
            __builtin_prefetch(vr + l, 0, 3);
            __builtin_prefetch(vr + v_token + l, 0, 3);
          }
        }
      }
    }
  }
  for (int b = 0; b < heads; ++b) {
    bool nan_code = false;
    if constexpr (kCheckNan) {
      nan_code = e4m3_rows_have_nan(k + b * k_head, k_token, v + b * v_head, v_token, live, d);
      if (nan_code) {
        for (int tp = 0; tp < kDirectChunk / 2; ++tp) qk_head.template operator()<true>(b, tp);
      }
    }
    if (b + 1 < heads) {  // the next head's V rows into L1
      const char* vn = v + (b + 1) * v_head;
      for (int t = 0; t < kDirectChunk; ++t) {
        for (int64_t l = 0; l < row_bytes; l += 64) __builtin_prefetch(vn + t * v_token + l, 0, 3);
      }
    }
    const int i = b * R;
    __m256 logits[R][2];
    avx2_fold<R>(red + static_cast<size_t>(i) * 64, logits);
    c.logit_scale = a.scale * kv_key_scale(a, c.kv_head + b) * key_factor;
    float* o = c.o + static_cast<size_t>(i) * dv;
    if (avx2_direct_softmax(c, lsum, i, R, logits, t0)) direct_rescale_rows(o, dv, c.alpha + i, R);
    const float* p = static_cast<const float*>(c.p) + static_cast<size_t>(i) * kDirectChunk;
    // V of the chunk ahead: head b's share of the run (the heads in turn walk it front to back)
    const char* l2_v = v_ahead + b * kDirectChunk * row_bytes;
    if (nan_code) {
      avx2_pv<DT, true, R, kFull>(o, dv, p, v + b * v_head, v_token, live, c.lo + i, c.hi + i, t0,
                                  l2_v, kDirectChunk * row_bytes);
    } else {
      avx2_pv<DT, false, R, kFull>(o, dv, p, v + b * v_head, v_token, live, c.lo + i, c.hi + i, t0,
                                   l2_v, kDirectChunk * row_bytes);
    }
  }
}

// The AVX2 kernel of the direct decode driver (cpu_decode_direct.h).
struct DirectAvx2 {
  // Swaps the middle 128-bit quarters of each 16-float group: the bf16 widening order, and back.
  static void swap_quarters(const float* src, float* dst, int n) {
    for (int g = 0; g < n; g += 16) {
      const __m256 x = _mm256_loadu_ps(src + g), y = _mm256_loadu_ps(src + g + 8);
      _mm256_storeu_ps(dst + g, _mm256_permute2f128_ps(x, y, 0x20));
      _mm256_storeu_ps(dst + g + 8, _mm256_permute2f128_ps(x, y, 0x31));
    }
  }

  static void setup(ItemContext& c) {
    setup_item_rows<F32Ops<Vec256>>(c);  // Q rows as f32 (dimension order), masks; O = 0
    if (c.args->kv.dtype == DType::bf16) {
      float* q = static_cast<float*>(c.q);
      for (int row = 0; row < c.rows; ++row) {
        float* qr = q + static_cast<size_t>(row) * c.head_size;
        swap_quarters(qr, qr, c.head_size);
      }
    }
  }

  static float key_factor(const AttentionArgs& a) {
    return a.kv.dtype == DType::fp8_e4m3 ? 256.f : 1.f;
  }
  static float value_factor(const AttentionArgs& a) { return key_factor(a); }

  static float lane_sum(const float* lanes) {
    return Vec256::hsum(_mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8)));
  }

  static void unpermute(const AttentionArgs& a, const float* o, float* dst, int dv) {
    if (a.kv.dtype == DType::bf16) {
      swap_quarters(o, dst, dv);
    } else {
      std::memcpy(dst, o, static_cast<size_t>(dv) * sizeof(float));
    }
  }

  // The block steps of fma_rows_of (below).
  template <int R>
  using Logits = __m256[R][2];
  template <DType DT, bool kNanSafe, int R, bool kFull>
  static void qk(const float* q, int d, const char* k, int64_t k_stride, int live, float* red,
                 Logits<R>& logits, const DirectPrefetch* pf) {
    avx2_qk<DT, kNanSafe, R, kFull>(q, d, k, k_stride, live, red, logits, pf);
  }
  static bool softmax(const ItemContext& c, float* lsum, int i, int rows, const __m256 (*logits)[2],
                      int t0) {
    return avx2_direct_softmax(c, lsum, i, rows, logits, t0);
  }
  template <DType DT, bool kNanSafe, int R, bool kFull>
  static void pv(float* o, int dv, const float* p, const char* v, int64_t v_stride, int live,
                 const int32_t* lo, const int32_t* hi, int t0) {
    avx2_pv<DT, kNanSafe, R, kFull>(o, dv, p, v, v_stride, live, lo, hi, t0);
  }

  // The key-major step of the driver (cpu_decode_direct.h), avx2_chunk_major: for items whose
  // rows per head fit one register block, whose rows' partial sums fit red (rows x 64 f32 in c.k,
  // 64 x D f32), on NHD caches (a chunk is one run of token rows; HND chunks are runs per head,
  // which head_chunk already reads front to back), on CPUs with the L2-prefetch plan (AMD: where
  // it was measured; the others keep head_chunk and the plan measured with it).
  static constexpr bool kHasChunkMajor = true;
  static bool takes_chunk_major(const ItemContext& c, int rows_per_head,
                                int64_t k_token, int64_t k_head, int64_t v_token, int64_t v_head) {
    return rows_per_head <= kDirectRowBlock && c.rows <= c.head_size && k_token > k_head &&
           v_token > v_head && avx2_prefetch_plan().l2;
  }
  static void chunk_major(ItemContext& c, float* lsum, float* red, int heads, int rows_per_head,
                          const char* k, int64_t k_token, int64_t k_head, const char* v,
                          int64_t v_token, int64_t v_head, int t0, int live, float key_factor,
                          const char* k_ahead, const char* v_ahead) {
    with_static_int<kDirectRowBlock>(rows_per_head, [&](auto rr) {
      constexpr int R = decltype(rr)::value;
      const auto run = [&]<DType DT, bool kCheckNan>() {
        const auto go = [&]<int kD>() {
          if (live == kDirectChunk) {
            avx2_chunk_major<DT, R, kD, true, kCheckNan>(c, lsum, red, heads, k, k_token, k_head, v,
                                                         v_token, v_head, t0, live, key_factor,
                                                         k_ahead, v_ahead);
          } else {
            avx2_chunk_major<DT, R, kD, false, kCheckNan>(c, lsum, red, heads, k, k_token, k_head,
                                                          v, v_token, v_head, t0, live, key_factor,
                                                          k_ahead, v_ahead);
          }
        };
        if (c.head_size == 128) {
          go.template operator()<128>();
        } else {
          go.template operator()<0>();
        }
      };
      switch (c.args->kv.dtype) {
        case DType::bf16: run.template operator()<DType::bf16, false>(); break;
        case DType::f16: run.template operator()<DType::f16, false>(); break;
        case DType::fp8_e5m2: run.template operator()<DType::fp8_e5m2, false>(); break;
        default: run.template operator()<DType::fp8_e4m3, true>(); break;
      }
    });
  }

  template <bool kFull>
  static void head_chunk(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                         const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                         int live, const DirectPrefetch& pf) {
    fma_head_chunk<DirectAvx2, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0, live, pf);
  }
};

}  // namespace
}  // namespace pagedattn::cpu
