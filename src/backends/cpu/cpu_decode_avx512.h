// Direct decode kernel (AVX-512 BF16) of the CPU backend: head-fused decode items over a bf16
// paged KV cache, computed on the cache rows in place (no K transpose, no V pack). Included by the
// AVX-512 translation units (cpu_kernels_avx512.cpp, cpu_kernels_amx.cpp); internal linkage only.
//
// What it computes: the same as cpu_attention_tile.h for one work item (logit order, soft-cap,
// ALiBi, causal / window masks, sinks, LSE, the online softmax), for the items that
// direct_decode_applies() accepts: head-fused (all KV heads of one request, final output rows, no
// cascade prefix), a paged bf16 cache with dense rows (NHD or HND) and a block size that is a
// multiple of 16, bf16 activations (Precision::bf16_dot), D = Dv a multiple of 32. Everything
// else (f16 / fp8 caches, f32 / f16 activations, D != Dv, split-KV and cascade items) runs the
// tile kernel. PAGEDATTN_CPU_DECODE_KERNEL=tile turns it off (cpu_dispatch.cpp).
//
// Tiling: the keys in chunks of 16 (one block, or a 16-key part of one); per chunk the KV heads in
// turn; per head its rows (query heads of the group x query tokens) in register blocks of R <= 4:
//   S = Q·Kᵀ  per key t: the D/32 zmm of its K row (32 bf16 each) x the R query rows (held in
//             registers as bf16 pairs) with vdpbf16ps -> R accumulators of 16 partial sums. Keys
//             2i, 2i+1 are folded at once (unpack lo/hi + add); the 8 folded pairs per row go
//             through a 3-level transposed reduction (unpack pd, two shuffle_f32x4 levels) to one
//             zmm = the 16 logits of the chunk, lane j = key t0 + j.
//   softmax   per row on that zmm: scale, soft-cap, ALiBi, mask, exp, P rounded to bf16 (16
//             values), l kept as 16 lane sums. Lazy max (as the AMX path): the running max m is
//             kept while no logit of the chunk exceeds it by more than kDirectRescaleSlack, so
//             alpha = 1 and O is not rescaled (exact: P <= e^8, O and l stay relative to the same
//             m); the common case costs one compare instead of a horizontal max.
//   O += P·V  per key pair (2i, 2i+1) and 32 dims: vpunpck{l,h}wd of the two V rows gives 2 zmm
//             of (v[2i][d], v[2i+1][d]) dword pairs, times the broadcast (p[2i], p[2i+1]) pair
//             with vdpbf16ps; dims are taken 64 at a time (R x 4 accumulators). The unpacks
//             leave the dims of each 32-dim chunk permuted (lo: d = 8k + j, hi: d = 8k + 4 + j for
//             lane 4k + j); O stays in that order in scratch and is put back once per row at the
//             end (two vpermt2ps per 32 dims).
//   Instructions (measured, D = Dv = 128, G = 4, one 16-key chunk of 8 KV heads = 64 KiB of K + V):
//   ~19k (the tile kernel: ~33k), of which 4096 vdpbf16ps and 2048 prefetches; ~6.5k cycles when
//   the data is cached, i.e. ~45 GB/s per core of compute rate.
//
// Memory traffic: each K/V byte of the request is read once (the decode floor); Q once, O written
// once. Prefetch (DirectPrefetch, issued inside the Q·Kᵀ loop, two rows per key pair): the chunk
// kDirectPrefetchChunks ahead into L2 in address order (the heads in turn walk it front to back:
// whole pages, which the hardware prefetchers do not cross), and this head's V rows and the next
// head's K rows from L2 into L1 (reading a head's 2 KiB-strided rows straight from L2 left the
// latency exposed). Each key pair's prefetch addresses depend on its dot products (zero_after), so
// they are issued at the pace of the computation. Floor and measurements: docs/perf/cpu.md
// ("Direct decode kernel").
//
// Precision points (the same as the tile kernel's bf16_dot path): Q and K/V bf16 as stored;
// products summed in f32 by vdpbf16ps; P rounded to bf16 once (l sums the rounded values); O
// accumulated in f32; the output rounded once at the store.
#pragma once

#include "cpu_avx512_ops.h"

// GCC 12's avx512fintrin.h starts unpack/shuffle/min/max from `__m512 __Y = __Y` (undefined); once
// those are inlined into the templates below it reports a false -Wuninitialized in the header.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace pagedattn::cpu {
namespace {

constexpr int kDirectChunk = 16;            // keys per chunk (lanes of one logit zmm)
constexpr int kDirectRowBlock = 4;          // rows per register block
constexpr int kDirectPrefetchChunks = 2;    // L2 prefetch distance, in chunks
constexpr float kDirectRescaleSlack = 8.f;  // lazy max: keep m while a chunk exceeds it by <= 8

// A chunk of the cache (16 keys x `heads` KV heads of D elements) is one contiguous run (NHD
// with dense rows: head stride D, token stride heads * D) or one run of 16 rows per head (HND with
// dense rows: token stride D). Other strides (views of a larger cache, or D != Dv, whose rows are
// padded to max(D, Dv)) take the tile kernel.
inline bool direct_decode_dense(int64_t token_stride, int64_t head_stride, int d, int heads) {
  return (head_stride == d && token_stride == static_cast<int64_t>(heads) * d) || token_stride == d;
}

// Whether the keys this item reads but some of its rows cannot see hold a NaN or infinite value:
// the keys of the first 16-key chunk before the first visible one (a sliding window's start) and,
// for several query tokens, the keys seen by some tokens only (causal ends, window starts). The
// kernel multiplies their V rows by P = 0, which keeps NaN (0 * NaN); such items (rare) take the
// tile kernel, which gives those rows V tiles without them (cpu_attention_tile.h).
inline bool direct_decode_reads_masked_non_finite(const AttentionArgs& a, const WorkItem& it) {
  const int r = it.req_begin;
  const int q_first = a.query_start_loc[r];
  const int kv_len = a.seq_lens[r];
  int min_lo = kv_len, max_lo = 0, min_hi = kv_len, max_hi = 0;
  for (int t = it.tok_begin; t < it.tok_end; ++t) {  // as setup_item_rows
    const int pos = a.first_query_pos[r] + (t - q_first);
    int lo = 0;
    int hi = a.causal ? imin(kv_len, pos + 1) : kv_len;
    if (a.window > 0) {
      lo = imax(0, pos - (a.window - 1));
      if (a.window_symmetric) hi = imin(hi, pos + a.window);
    }
    min_lo = imin(min_lo, lo);
    max_lo = imax(max_lo, lo);
    min_hi = imin(min_hi, hi);
    max_hi = imax(max_hi, hi);
  }
  const int begin = imax(it.kv_begin, min_lo), end = imin(it.kv_end, max_hi);
  if (begin >= end) return false;
  const int first = begin & ~(kDirectChunk - 1);
  const int heads = it.num_kv_heads;
  return values_non_finite(a, r, it.kv_head, heads, first, imin(imax(max_lo, begin), end)) ||
         values_non_finite(a, r, it.kv_head, heads, imax(min_hi, begin), end);
}

// Whether the direct decode kernel runs this item (see the file comment).
inline bool direct_decode_applies(const AttentionArgs& a, const WorkItem& it) {
  return a.direct_decode && it.num_kv_heads > 1 && it.partial_base < 0 && it.prefix_len == 0 &&
         it.req_end - it.req_begin == 1 && a.kv.paged && a.kv.block_size % kDirectChunk == 0 &&
         a.kv.dtype == DType::bf16 && a.q_dtype == DType::bf16 &&
         a.precision == Precision::bf16_dot && a.head_size == a.head_size_v &&
         a.head_size % 32 == 0 &&
         direct_decode_dense(a.kv.k_token_stride, a.kv.k_head_stride, a.head_size,
                             it.num_kv_heads) &&
         direct_decode_dense(a.kv.v_token_stride, a.kv.v_head_stride, a.head_size, it.num_kv_heads) &&
         !direct_decode_reads_masked_non_finite(a, it);
}

inline __m512bh as_bh(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}

// What one head's Q·Kᵀ loop prefetches, two rows' worth per key pair (16 rows per head):
//   L2 (prefetcht1; l2_k, l2_v): the head's 1/heads share of the chunk kDirectPrefetchChunks
//   ahead, DRAM -> L2: NHD = 16 consecutive rows of the chunk's single run (so the heads in turn
//   walk the whole chunk front to back), HND = the head's own 16 rows;
//   L1 (prefetcht0; l1_v, l1_k): this head's V rows of this chunk (read right after the loop) and
//   the next head's K rows (the next chunk's first head after the last one), L2 -> L1. Without
//   it the strided rows of one head were read from L2 with their latency exposed (measured +40%
//   single-thread with it).
// Every pointer is valid to prefetch (where there is nothing left to fetch it points at data that
// is already cached): prefetches never fault, and no branch is needed.
struct DirectPrefetch {
  const char* l2_k = nullptr;
  const char* l2_v = nullptr;
  const char* l1_v = nullptr;
  const char* l1_k = nullptr;
  int64_t k_stride = 0, v_stride = 0;  // bytes between keys (rows) for l1_k, l1_v
};

// 0, computed from x: an offset that makes a prefetch address wait for x (`and $0` is not one of
// x86's dependency-breaking zero idioms, and the compiler cannot see through the asm). Adding it to
// a key pair's prefetch addresses paces the prefetches: the core issues them as the pair's dot
// products complete instead of running ahead and issuing a whole head's prefetches at once, which
// measured ~10% slower on decode 16 x 4k (docs/perf/cpu.md).
inline int64_t zero_after(__m512 x) {
  int64_t v = _mm_cvtsi128_si32(_mm_castps_si128(_mm512_castps512_ps128(x)));
  asm("and $0, %0" : "+r"(v));
  return v;
}

// Logits of R rows (q: R rows of D bf16, row stride D) for the 16 keys of a chunk (key t at
// k + t * k_stride, or the zero row from `live` on): logits[r] lane t = q_r . k_t.
// red: scratch of R x 8 x 16 f32 (the key pairs folded once). prefetch_into: nullptr or what to
// prefetch (DirectPrefetch).
template <int R, int NC, bool kFull>
__attribute__((always_inline)) inline void direct_qk(const uint16_t* q, int head_size,
                                                     const char* k, int64_t k_stride, int live,
                                                     float* red, __m512* logits,
                                                     const DirectPrefetch* prefetch_into) {
  // A local copy (scalar fields): the vector stores below may alias any memory, so fields read
  // through the pointer would be reloaded after each of them.
  const bool prefetch = prefetch_into != nullptr;
  DirectPrefetch pf;
  if (prefetch) {
    pf.l2_k = prefetch_into->l2_k;
    pf.l2_v = prefetch_into->l2_v;
    pf.l1_v = prefetch_into->l1_v;
    pf.l1_k = prefetch_into->l1_k;
    pf.k_stride = prefetch_into->k_stride;
    pf.v_stride = prefetch_into->v_stride;
  }
  __m512bh qv[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c)
      qv[r][c] = as_bh(_mm512_loadu_si512(q + static_cast<size_t>(r) * head_size + 32 * c));
  const char* zero = reinterpret_cast<const char*>(kZeroRow);
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {
    const char* ka = kFull || 2 * tp < live ? k + (2 * tp) * k_stride : zero;
    const char* kb = kFull || 2 * tp + 1 < live ? k + (2 * tp + 1) * k_stride : zero;
    __m512 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm512_setzero_ps();
      b[r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < NC; ++c) {
      const __m512bh kc = as_bh(_mm512_loadu_si512(ka + 64 * c));
      for (int r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], qv[r][c], kc);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512bh kc = as_bh(_mm512_loadu_si512(kb + 64 * c));
      for (int r = 0; r < R; ++r) b[r] = _mm512_dpbf16_ps(b[r], qv[r][c], kc);
    }
    // 128-bit lane k of the fold: [a(4k)+a(4k+2), b(4k)+b(4k+2), a(4k+1)+a(4k+3), b(..)].
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(red + (r * 8 + tp) * 16, _mm512_add_ps(_mm512_unpacklo_ps(a[r], b[r]),
                                                              _mm512_unpackhi_ps(a[r], b[r])));
    }
    if (prefetch) {  // rows 2tp, 2tp + 1 (a row = D bf16 = NC lines)
      const int64_t pace = zero_after(b[0]);
      const char* l2_k = pf.l2_k + tp * 128 * NC + pace;
      const char* l2_v = pf.l2_v + tp * 128 * NC + pace;
      const char* l1_v = pf.l1_v + (2 * tp) * pf.v_stride + pace;
      const char* l1_k = pf.l1_k + (2 * tp) * pf.k_stride + pace;
      for (int l = 0; l < 2 * NC; ++l) __builtin_prefetch(l2_k + 64 * l, 0, 2);
      for (int l = 0; l < 2 * NC; ++l) __builtin_prefetch(l2_v + 64 * l, 0, 2);
      for (int l = 0; l < NC; ++l) __builtin_prefetch(l1_v + 64 * l, 0, 3);
      for (int l = 0; l < NC; ++l) __builtin_prefetch(l1_v + pf.v_stride + 64 * l, 0, 3);
      for (int l = 0; l < NC; ++l) __builtin_prefetch(l1_k + 64 * l, 0, 3);
      for (int l = 0; l < NC; ++l) __builtin_prefetch(l1_k + pf.k_stride + 64 * l, 0, 3);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* x = red + r * 8 * 16;
    __m512 quad[4];  // 128-bit lane k: keys 4i .. 4i+3 (partial sums)
    for (int i = 0; i < 4; ++i) {
      const __m512d p0 = _mm512_castps_pd(_mm512_loadu_ps(x + (2 * i) * 16));
      const __m512d p1 = _mm512_castps_pd(_mm512_loadu_ps(x + (2 * i + 1) * 16));
      quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
    }
    __m512 oct[2];  // 128-bit lanes: keys [8i, 8i+4) twice, then [8i+4, 8i+8) twice
    for (int i = 0; i < 2; ++i) {
      oct[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0xDD));
    }
    logits[r] = _mm512_add_ps(_mm512_shuffle_f32x4(oct[0], oct[1], 0x88),
                              _mm512_shuffle_f32x4(oct[0], oct[1], 0xDD));
  }
}

// O[r] (permuted dims, see the file comment) += P[r] · V over the chunk's keys, for dims
// [d0, d0 + 32 * NCG). p: R rows of 16 bf16; v: key t at v + t * v_stride.
template <int R, int NCG, bool kFull>
__attribute__((always_inline)) inline void direct_pv_dims(float* o, int head_size_v,
                                                          const uint16_t* p, const char* v,
                                                          int64_t v_stride, int live, int d0) {
  __m512 acc[R][2 * NCG];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NCG; ++j)
      acc[r][j] = _mm512_loadu_ps(o + static_cast<size_t>(r) * head_size_v + d0 + 16 * j);
  const char* zero = reinterpret_cast<const char*>(kZeroRow);
#pragma GCC unroll 2
  for (int tp = 0; tp < kDirectChunk / 2; ++tp) {  // keys from `live` on: the zero row (P = 0)
    const char* va = kFull || 2 * tp < live ? v + (2 * tp) * v_stride + 2 * d0 : zero;
    const char* vb = kFull || 2 * tp + 1 < live ? v + (2 * tp + 1) * v_stride + 2 * d0 : zero;
    __m512bh lo[NCG], hi[NCG];
    for (int c = 0; c < NCG; ++c) {
      const __m512i x = _mm512_loadu_si512(va + 64 * c);
      const __m512i y = _mm512_loadu_si512(vb + 64 * c);
      lo[c] = as_bh(_mm512_unpacklo_epi16(x, y));
      hi[c] = as_bh(_mm512_unpackhi_epi16(x, y));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = as_bh(broadcast_dword(p + r * kDirectChunk + 2 * tp));
      for (int c = 0; c < NCG; ++c) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], pb, lo[c]);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], pb, hi[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NCG; ++j)
      _mm512_storeu_ps(o + static_cast<size_t>(r) * head_size_v + d0 + 16 * j, acc[r][j]);
}

// Online softmax of rows [row0, row0 + rows) over one chunk (logits[r] lane j = key t0 + j): P
// rounded to bf16 into the P scratch, m, l (lane sums) and alpha updated. Returns whether any row's
// O needs rescaling (alpha != 1). Not a template: one copy for every register block shape.
// Common path (a row's running max already within kDirectRescaleSlack of every logit of the
// chunk): one compare instead of a horizontal max, alpha = 1.
inline bool direct_softmax(const ItemContext& c, float* lsum, int row0, int rows,
                           const __m512* logits, int t0) {
  const AttentionArgs& a = *c.args;
  const __m512i kpos =
      _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(t0));
  const __m512 vscale = _mm512_set1_ps(c.logit_scale);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const bool capped = a.soft_cap > 0.f;
  const bool alibi = a.alibi_slopes != nullptr;
  uint16_t* p = static_cast<uint16_t*>(c.p) + static_cast<size_t>(row0) * kDirectChunk;
  bool rescale = false;
  int lo = -1, hi = -1;  // the visible range `valid` was computed for (rows often share it)
  __mmask16 valid = 0;
  for (int r = 0; r < rows; ++r) {
    const int i = row0 + r;
    __m512 x = _mm512_mul_ps(logits[r], vscale);
    if (capped) {
      x = _mm512_mul_ps(_mm512_set1_ps(a.soft_cap),
                        vec_tanh<Vec512>(_mm512_mul_ps(x, _mm512_set1_ps(1.f / a.soft_cap))));
    }
    if (alibi) {
      const __m512 dist =
          _mm512_abs_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_set1_epi32(c.pos[i]), kpos)));
      x = _mm512_fnmadd_ps(_mm512_set1_ps(c.slope[i]), dist, x);
    }
    if (c.lo[i] != lo || c.hi[i] != hi) {
      lo = c.lo[i];
      hi = c.hi[i];
      valid = _mm512_cmpge_epi32_mask(kpos, _mm512_set1_epi32(lo)) &
              _mm512_cmplt_epi32_mask(kpos, _mm512_set1_epi32(hi));
    }
    x = _mm512_mask_mov_ps(neg_inf, valid, x);
    const float m_old = c.m[i];
    float m_new = m_old;
    float alpha = 1.f;  // O and l are 0 while m_old = -inf: nothing to rescale then either
    // Some logit above m_old + slack (always the case for the first visible chunk, m_old = -inf).
    if (_mm512_cmp_ps_mask(x, _mm512_set1_ps(m_old + kDirectRescaleSlack), _CMP_GT_OQ) != 0) {
      m_new = _mm512_reduce_max_ps(x);
      if (m_old != kNegInf) {
        alpha = std::exp(m_old - m_new);
        rescale = true;
      }
      c.m[i] = m_new;
    }
    c.alpha[i] = alpha;
    uint16_t* prow = p + r * kDirectChunk;
    if (m_new == kNegInf) {  // nothing visible yet
      std::memset(prow, 0, kDirectChunk * sizeof(uint16_t));
      continue;
    }
    const __m512 e =
        _mm512_maskz_mov_ps(valid, Vec512::exp(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
    const __m256bh eb = _mm512_cvtneps_pbh(e);
    __m256i bits;
    std::memcpy(&bits, &eb, sizeof(bits));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow), bits);
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    float* l = lsum + static_cast<size_t>(i) * kDirectChunk;
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha), rounded));
  }
  return rescale;
}

// One register block of R rows (global rows row0 ..) of one KV head over one chunk: Q·Kᵀ, the
// online softmax, O += P·V.
template <int R, int NC, bool kFull>
inline void direct_rows(const ItemContext& c, float* lsum, float* red, int row0, const char* k,
                        int64_t k_stride, const char* v, int64_t v_stride, int t0, int live,
                        const DirectPrefetch* pf) {
  __m512 logits[R];
  direct_qk<R, NC, kFull>(
      static_cast<const uint16_t*>(c.q) + static_cast<size_t>(row0) * c.head_size, c.head_size, k,
      k_stride, live, red, logits, pf);
  const int dv = c.head_size_v;
  float* o = c.o + static_cast<size_t>(row0) * dv;
  if (direct_softmax(c, lsum, row0, R, logits, t0)) {  // rare (lazy max): O *= alpha
    for (int r = 0; r < R; ++r) {
      const __m512 alpha = _mm512_set1_ps(c.alpha[row0 + r]);
      float* row = o + static_cast<size_t>(r) * dv;
      for (int d = 0; d < dv; d += 16)
        _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), alpha));
    }
  }
  const uint16_t* p = static_cast<const uint16_t*>(c.p) + static_cast<size_t>(row0) * kDirectChunk;
  int d0 = 0;
  for (; d0 + 64 <= dv; d0 += 64) direct_pv_dims<R, 2, kFull>(o, dv, p, v, v_stride, live, d0);
  if (d0 < dv) direct_pv_dims<R, 1, kFull>(o, dv, p, v, v_stride, live, d0);
}

// Runs one item accepted by direct_decode_applies().
inline void run_direct_decode(const AttentionArgs& a, const WorkItem& it, char* scratch) {
  ItemContext c = make_item_context(a, it, scratch);
  setup_item_rows<Bf16Ops>(c);            // Q rows as bf16, positions, masks; m = -inf, O = 0
  float* lsum = c.s;                      // (rows, 16) lane sums of l
  float* red = static_cast<float*>(c.k);  // (4, 8, 16) folded key pairs of Q·Kᵀ
  std::memset(lsum, 0, static_cast<size_t>(c.rows) * kDirectChunk * sizeof(float));
  const int G = c.group;
  const int heads = it.num_kv_heads;
  const int rows_per_head = (it.tok_end - it.tok_begin) * G;

  int vis_lo = c.lo[0], vis_hi = c.hi[0];
  for (int i = 1; i < c.rows; ++i) {
    vis_lo = imin(vis_lo, c.lo[i]);
    vis_hi = imax(vis_hi, c.hi[i]);
  }
  const int begin = imax(it.kv_begin, vis_lo);
  const int end = imin(it.kv_end, vis_hi);

  const KvSource& kv = a.kv;
  const int64_t k_token = kv.k_token_stride * 2, k_head = kv.k_head_stride * 2;
  const int64_t k_block = kv.k_block_stride * 2;
  const int64_t v_token = kv.v_token_stride * 2, v_head = kv.v_head_stride * 2;
  const int64_t v_block = kv.v_block_stride * 2;
  const char* k_base = static_cast<const char*>(kv.key) + it.kv_head * k_head;
  const char* v_base = static_cast<const char*>(kv.value) + it.kv_head * v_head;
  const int32_t* blocks =
      kv.block_table + static_cast<int64_t>(it.req_begin) * kv.block_table_stride;
  const int bs = kv.block_size;
  const int64_t row_bytes = static_cast<int64_t>(c.head_size) * 2;
  // Bytes between the L2-prefetch shares of consecutive heads (see DirectPrefetch).
  const int64_t k_share = k_token > k_head ? kDirectChunk * row_bytes : k_head;
  const int64_t v_share = v_token > v_head ? kDirectChunk * row_bytes : v_head;
  auto chunk_k = [&](int t0) {
    return k_base + static_cast<int64_t>(blocks[t0 / bs]) * k_block + (t0 % bs) * k_token;
  };
  auto chunk_v = [&](int t0) {
    return v_base + static_cast<int64_t>(blocks[t0 / bs]) * v_block + (t0 % bs) * v_token;
  };

  if (begin < end) {
    const int first = begin & ~(kDirectChunk - 1);
    // The first chunks into L2 (the loop fetches kDirectPrefetchChunks ahead).
    for (int j = 0; j < kDirectPrefetchChunks && first + j * kDirectChunk < end; ++j) {
      const char* k = chunk_k(first + j * kDirectChunk);
      const char* v = chunk_v(first + j * kDirectChunk);
      for (int b = 0; b < heads; ++b) {
        for (int64_t line = 0; line < kDirectChunk * row_bytes; line += 64) {
          __builtin_prefetch(k + b * k_share + line, 0, 2);
          __builtin_prefetch(v + b * v_share + line, 0, 2);
        }
      }
    }
    DirectPrefetch pf;
    pf.k_stride = k_token;
    pf.v_stride = v_token;
    for (int t0 = first; t0 < end; t0 += kDirectChunk) {
      const int live = imin(kDirectChunk, end - t0);
      const char* k = chunk_k(t0);
      const char* v = chunk_v(t0);
      const int ahead = t0 + kDirectPrefetchChunks * kDirectChunk;
      const char* k_ahead = ahead < end ? chunk_k(ahead) : k;  // nothing left: refetch this one
      const char* v_ahead = ahead < end ? chunk_v(ahead) : v;
      const char* k_next = t0 + kDirectChunk < end ? chunk_k(t0 + kDirectChunk) : k;
      for (int b = 0; b < heads; ++b) {
        pf.l2_k = k_ahead + b * k_share;
        pf.l2_v = v_ahead + b * v_share;
        pf.l1_v = v + b * v_head;
        pf.l1_k = b + 1 < heads ? k + (b + 1) * k_head : k_next;
        for (int rb = 0; rb < rows_per_head; rb += kDirectRowBlock) {
          const DirectPrefetch* prefetch = rb == 0 ? &pf : nullptr;  // once per head
          with_static_int<kDirectRowBlock>(imin(kDirectRowBlock, rows_per_head - rb), [&](auto rr) {
            with_static_int<kMaxHeadSize / 32>(c.head_size / 32, [&](auto nc) {
              constexpr int R = decltype(rr)::value, NC = decltype(nc)::value;
              if (live == kDirectChunk) {
                direct_rows<R, NC, true>(c, lsum, red, b * rows_per_head + rb, k + b * k_head,
                                         k_token, v + b * v_head, v_token, t0, live, prefetch);
              } else {  // the last chunk of the keys: dead rows read as zeros
                direct_rows<R, NC, false>(c, lsum, red, b * rows_per_head + rb, k + b * k_head,
                                          k_token, v + b * v_head, v_token, t0, live, prefetch);
              }
            });
          });
        }
      }
    }
  }

  // Finalize: O back in dim order, l from its lane sums.
  const int dv = c.head_size_v;
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int row = 0; row < c.rows; ++row) {
    const float* o_row = c.o + static_cast<size_t>(row) * dv;
    for (int d = 0; d < dv; d += 32) {
      const __m512 lo = _mm512_loadu_ps(o_row + d);
      const __m512 hi = _mm512_loadu_ps(o_row + d + 16);
      _mm512_storeu_ps(c.temp + d, _mm512_permutex2var_ps(lo, lo_idx, hi));
      _mm512_storeu_ps(c.temp + d + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
    }
    const float l =
        _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + static_cast<size_t>(row) * kDirectChunk));
    const int block = row / rows_per_head, local = row % rows_per_head;
    finalize_row(a, c.temp, c.m[row], l, it.tok_begin + local / G,
                 (it.kv_head + block) * G + local % G, 1.f);
  }
}

}  // namespace
}  // namespace pagedattn::cpu

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic pop
#endif
