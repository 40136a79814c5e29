// Direct decode kernel (AVX-512 BF16) of the CPU backend: the per-(chunk, KV head) compute of the
// direct decode driver (cpu_decode_direct.h: head-fused decode items computed on the cache rows in
// place, no K transpose, no V pack). Included by the AVX-512 translation units
// (cpu_kernels_avx512.cpp, cpu_kernels_amx.cpp); internal linkage only.
//
// Items (direct_decode_applies): the driver's shape conditions, D = Dv a multiple of 32, and a bf16
// cache with bf16 activations or an fp8 (e4m3 / e5m2) cache with any activations (both
// Precision::bf16_dot: Q rounded to bf16, as the tile kernel does). Everything else on the AVX-512
// and AMX paths (f16 caches, f32 / f16 activations over a bf16 cache, split-KV and cascade items)
// runs the tile kernel. PAGEDATTN_CPU_DECODE_KERNEL=tile turns it off (cpu_dispatch.cpp).
//
// fp8 caches are widened to bf16 in registers (widen32), exactly (every e4m3 / e5m2 value is a
// bf16), NaN and inf codes included, so no check pass is needed; the rest of the kernel is the
// bf16 one. bf16 rather than f32: each widened K or V vector then feeds vdpbf16ps (32 products
// per instruction, half the dot-product instructions of f32 FMA) and the widening is 7 integer
// instructions per 32 elements, which run beside the dot products (an f32 widening costs twice
// that per element, and twice the FMAs).
//
// Tiling: per (chunk of 16 keys, KV head) its rows (query heads of the group x query tokens) in
// register blocks of R <= 4:
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
//   O += P·V  per key pair (2i, 2i+1) that the rows can see (direct_pv_dims) and 32 dims: vpunpck{l,h}wd of the two V rows gives 2 zmm
//             of (v[2i][d], v[2i+1][d]) dword pairs, times the broadcast (p[2i], p[2i+1]) pair
//             with vdpbf16ps; dims are taken 64 at a time (R x 4 accumulators). The unpacks
//             leave the dims of each 32-dim chunk permuted (lo: d = 8k + j, hi: d = 8k + 4 + j for
//             lane 4k + j); O stays in that order in scratch and is put back once per row at the
//             end (two vpermt2ps per 32 dims).
//   Instructions (measured, D = Dv = 128, G = 4, one 16-key chunk of 8 KV heads = 64 KiB of K + V):
//   ~19k (the tile kernel: ~33k), of which 4096 vdpbf16ps and 2048 prefetches; ~6.5k cycles when
//   the data is cached, i.e. ~45 GB/s per core of compute rate.
//
// Memory traffic: each K/V byte of the request is read once (the decode floor); the prefetches
// (the driver's DirectPrefetch plan) are issued inside the Q·Kᵀ loop, two rows per key pair,
// paced by its dot products (zero_after). Floor and measurements: docs/perf/cpu.md ("Direct
// decode kernel").
//
// Precision points (the same as the tile kernel's bf16_dot path): Q rounded to bf16 (as stored for
// bf16 activations); K/V bf16 as stored, or fp8 widened exactly (times a power of two); products
// summed in f32 by vdpbf16ps; P rounded to bf16 once (l sums the rounded values); O
// accumulated in f32; the output rounded once at the store.
#pragma once

#include "cpu_avx512_ops.h"
#include "cpu_decode_direct.h"

// GCC 12's avx512fintrin.h starts unpack/shuffle/min/max from `__m512 __Y = __Y` (undefined); once
// those are inlined into the templates below it reports a false -Wuninitialized in the header.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace pagedattn::cpu {
namespace {

// Whether the AVX-512 direct kernel runs this item (see the file comment).
inline bool direct_decode_applies(const AttentionArgs& a, const WorkItem& it) {
  const DType dt = a.kv.dtype;
  const bool cache = (dt == DType::bf16 && a.q_dtype == DType::bf16) || dt == DType::fp8_e4m3 ||
                     dt == DType::fp8_e5m2;
  return cache && a.precision == Precision::bf16_dot && a.head_size % 32 == 0 &&
         direct_decode_shape_applies(a, it);
}

template <DType DT>
constexpr int64_t kDirectElemBytes = DT == DType::bf16 ? 2 : 1;

// Magnitude tables of the fp8 widening (bf16 bit patterns, vpermw: 32 words; see widen32).
// e4m3, index (code + 1) & 0x7F for the codes 0x7F (index 0: NaN) and 0x00 .. 0x0E: the
// subnormals M * 2^-9 and the first normals, times 256.
alignas(64) constexpr uint16_t kE4m3Specials[32] = {
    0x7FC0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4020, 0x4040,
    0x4060, 0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0};
// e5m2, index (code + 4) & 0x7F for the codes 0x7C .. 0x7F (inf, NaN x 3) and 0x00 .. 0x03 (the
// subnormals M * 2^-16), times 2^16.
alignas(64) constexpr uint16_t kE5m2Specials[32] = {0x7F80, 0x7FC0, 0x7FC0, 0x7FC0,
                                                    0x0000, 0x3F80, 0x4000, 0x4040};

// 32 cache elements of type DT at src as bf16 (one zmm of words, in element order). bf16: the
// row itself. fp8: exact, every code (NaN and, for e5m2, inf included), scaled by a power of two
// (e4m3: 2^8, e5m2: 2^16; DirectAvx512::key_factor / value_factor divide it out again). The byte
// sign-extended to a word s (bit 15 = the sign); s << 4 (e4m3) or << 5 (e5m2) puts the code's
// exponent and mantissa at the bf16's, and OR 0x4000 adds 128 to the exponent: the bf16 of a
// normal code's value times 2^(128 - 120) = 2^8 (e4m3, exponent bias 7) or 2^(128 - 112) = 2^16
// (e5m2, bias 15). The codes this cannot give (subnormals, NaN; e5m2 inf) take their magnitude
// from a table (vpermw, masked to them: one test finds them, as the codes whose magnitude plus 1
// (e4m3; 127 + 1 wraps to 0) or plus 4 (e5m2; 124 .. 127 wrap to 0 .. 3) is below 16 or 8; the
// e4m3 table also holds the first normals, 8 .. 14), and the sign goes back on last. 7
// instructions per 32 elements; the values are those of the tile kernel's conversion
// (Bf16Ops::convert_row) times the power of two.
template <DType DT>
__attribute__((always_inline)) inline __m512i widen32(const char* src) {
  if constexpr (DT == DType::bf16) {
    return _mm512_loadu_si512(src);
  } else {
    static_assert(DT == DType::fp8_e4m3 || DT == DType::fp8_e5m2);
    constexpr bool e4m3 = DT == DType::fp8_e4m3;
    const __m512i s =
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    // (a & exponent/mantissa bits) | 0x4000; the destination operand first (a, then magnitude:
    // both dead after), so that no register copy is needed.
    const __m512i normal =
        _mm512_ternarylogic_epi32(_mm512_slli_epi16(s, e4m3 ? 4 : 5),
                                  _mm512_set1_epi16(e4m3 ? 0x07F0 : 0x0FE0),
                                  _mm512_set1_epi16(0x4000), 0xEA);
    const __m512i idx = _mm512_add_epi16(s, _mm512_set1_epi16(e4m3 ? 1 : 4));
    const __mmask32 special = _mm512_testn_epi16_mask(idx, _mm512_set1_epi16(e4m3 ? 0x70 : 0x78));
    const __m512i magnitude = _mm512_mask_permutexvar_epi16(
        normal, special, idx, _mm512_load_si512(e4m3 ? kE4m3Specials : kE5m2Specials));
    // bit 15 from s (the sign), the rest from magnitude: C ? B : A
    return _mm512_ternarylogic_epi32(magnitude, s, _mm512_set1_epi16(static_cast<short>(0x8000)),
                                     0xD8);
  }
}

inline __m512bh as_bh(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}

// 0, computed from x (see zero_after_bits).
inline int64_t zero_after(__m512 x) {
  return zero_after_bits(_mm_cvtsi128_si32(_mm_castps_si128(_mm512_castps512_ps128(x))));
}

// Logits of R rows (q: R rows of D bf16, row stride D) for the 16 keys of a chunk (key t at
// k + t * k_stride, or the zero row from `live` on): logits[r] lane t = q_r . k_t.
// red: scratch of R x 8 x 16 f32 (the key pairs folded once). prefetch_into: nullptr or what to
// prefetch (DirectPrefetch).
template <DType DT, int R, int NC, bool kFull>
__attribute__((always_inline)) inline void direct_qk(const uint16_t* q, int head_size,
                                                     const char* k, int64_t k_stride, int live,
                                                     float* red, __m512* logits,
                                                     const DirectPrefetch* prefetch_into) {
  // A local copy (scalar fields): the vector stores below may alias any memory, so fields read
  // through the pointer would be reloaded after each of them.
  const bool prefetch = prefetch_into != nullptr;
  DirectPrefetch pf;
  if (prefetch) pf = *prefetch_into;
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
      const __m512bh kc = as_bh(widen32<DT>(ka + 32 * kDirectElemBytes<DT> * c));
      for (int r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], qv[r][c], kc);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512bh kc = as_bh(widen32<DT>(kb + 32 * kDirectElemBytes<DT> * c));
      for (int r = 0; r < R; ++r) b[r] = _mm512_dpbf16_ps(b[r], qv[r][c], kc);
    }
    // 128-bit lane k of the fold: [a(4k)+a(4k+2), b(4k)+b(4k+2), a(4k+1)+a(4k+3), b(..)].
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(red + (r * 8 + tp) * 16, _mm512_add_ps(_mm512_unpacklo_ps(a[r], b[r]),
                                                              _mm512_unpackhi_ps(a[r], b[r])));
    }
    // Rows 2tp, 2tp + 1. The prefetch loops are unrolled for fp8 rows (fewer instructions in a
    // compute-bound loop); bf16 keeps them (unrolled, its prefetches issued ahead of the pacing
    // and the memory-bound decode was slower: docs/perf/cpu.md, fp8 section).
    if (prefetch) direct_prefetch_pair<DT == DType::bf16 ? 0 : 32 * NC>(pf, tp, zero_after(b[0]));
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

// O[r] (permuted dims, see the file comment) += P[r] · V over the chunk's keys (keys t0 + j), for
// dims [d0, d0 + 32 * NCG). p: R rows of 16 bf16; v: key t at v + t * v_stride. Each V row is read
// only for the rows that can see its key (lo[r] <= key < hi[r], key < t0 + live): key pairs every
// row of the block sees run for all rows at once; the few "ragged" pairs (a causal end between the
// tokens of a multi-token decode, a window start, the chunk's last live key) row by row with the
// keys a row cannot see replaced by zeros; pairs no row sees are not read. So a row never
// multiplies a V row it cannot see (P = 0 would keep a NaN or an infinity there: 0 * NaN = NaN),
// and the output does not depend on what masked slots hold.
template <DType DT, int R, int NCG, bool kFull>
__attribute__((always_inline)) inline void direct_pv_dims(float* o, int head_size_v,
                                                          const uint16_t* p, const char* v,
                                                          int64_t v_stride, int live, int d0,
                                                          const int32_t* lo, const int32_t* hi,
                                                          int t0, const ChunkKeys& keys) {
  const int n = kFull ? kDirectChunk : live;
  // Pairs with both keys in [all_lo, all_hi); the pairs that overlap [any_lo, any_hi) besides.
  const int full_begin = (keys.all_lo + 1) / 2;
  const int full_end = imax(full_begin, keys.all_hi / 2);
  __m512 acc[R][2 * NCG];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NCG; ++j)
      acc[r][j] = _mm512_loadu_ps(o + static_cast<size_t>(r) * head_size_v + d0 + 16 * j);
  const auto pair = [&](int tp, int r_first, int r_last, bool sees_a, bool sees_b) {
    constexpr int64_t eb = kDirectElemBytes<DT>;
    const char* va = v + (2 * tp) * v_stride + eb * d0;
    const char* vb = va + v_stride;
    __m512bh lo_v[NCG], hi_v[NCG];
    for (int c = 0; c < NCG; ++c) {
      const __m512i x = sees_a ? widen32<DT>(va + 32 * eb * c) : _mm512_setzero_si512();
      const __m512i y = sees_b ? widen32<DT>(vb + 32 * eb * c) : _mm512_setzero_si512();
      lo_v[c] = as_bh(_mm512_unpacklo_epi16(x, y));
      hi_v[c] = as_bh(_mm512_unpackhi_epi16(x, y));
    }
    for (int r = 0; r < R; ++r) {
      if (r < r_first || r > r_last) continue;
      const __m512bh pb = as_bh(broadcast_dword(p + r * kDirectChunk + 2 * tp));
      for (int c = 0; c < NCG; ++c) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], pb, lo_v[c]);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], pb, hi_v[c]);
      }
    }
  };
#pragma GCC unroll 2
  for (int tp = full_begin; tp < full_end; ++tp) pair(tp, 0, R - 1, true, true);
  const auto ragged = [&](int tp_begin, int tp_end) {  // the rows that see each pair's keys
    for (int tp = tp_begin; tp < tp_end; ++tp) {
      const int ka = t0 + 2 * tp, kb = ka + 1;
      for (int r = 0; r < R; ++r) {
        const bool sees_a = ka >= lo[r] && ka < hi[r] && 2 * tp < n;
        const bool sees_b = kb >= lo[r] && kb < hi[r] && 2 * tp + 1 < n;
        if (sees_a || sees_b) pair(tp, r, r, sees_a, sees_b);
      }
    }
  };
  ragged(keys.any_lo / 2, full_begin);
  ragged(full_end, (keys.any_hi + 1) / 2);
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
    const bool exceeds =
        _mm512_cmp_ps_mask(x, _mm512_set1_ps(c.m[i] + kDirectRescaleSlack), _CMP_GT_OQ) != 0;
    const float alpha =
        direct_lazy_max(c, i, exceeds, [&] { return _mm512_reduce_max_ps(x); }, &rescale);
    float m_new = c.m[i];
    uint16_t* prow = p + r * kDirectChunk;
    if (m_new == kNegInf) {
      // Every visible logit so far is -inf or NaN: `exceeds` is false for NaN, so a row whose
      // only visible logits here are NaN lands here too, and must become NaN (REFERENCE:
      // e^{NaN - m}), not give the key weight 0. x: masked lanes are -inf.
      if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) == 0) {  // nothing visible yet
        std::memset(prow, 0, kDirectChunk * sizeof(uint16_t));
        continue;
      }
      m_new = c.m[i] = __builtin_nanf("");  // P, l, O and the LSE of the row NaN from here on
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
template <DType DT, int R, int NC, bool kFull>
inline void direct_rows(const ItemContext& c, float* lsum, float* red, int row0, const char* k,
                        int64_t k_stride, const char* v, int64_t v_stride, int t0, int live,
                        const DirectPrefetch* pf) {
  __m512 logits[R];
  direct_qk<DT, R, NC, kFull>(
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
  const int32_t* lo = c.lo + row0;
  const int32_t* hi = c.hi + row0;
  const ChunkKeys keys = chunk_keys_seen(lo, hi, R, t0, kFull ? kDirectChunk : live);
  for (; d0 + 64 <= dv; d0 += 64) {
    direct_pv_dims<DT, R, 2, kFull>(o, dv, p, v, v_stride, live, d0, lo, hi, t0, keys);
  }
  if (d0 < dv) direct_pv_dims<DT, R, 1, kFull>(o, dv, p, v, v_stride, live, d0, lo, hi, t0, keys);
}

// The AVX-512 BF16 kernel of the direct decode driver (cpu_decode_direct.h).
struct DirectAvx512 {
  static void setup(ItemContext& c) { setup_item_rows<Bf16Ops>(c); }  // Q rows as bf16
  // The powers of two widen32 scales fp8 codes by (exact).
  static float key_factor(const AttentionArgs& a) {
    switch (a.kv.dtype) {
      case DType::fp8_e4m3: return 1.f / 256.f;
      case DType::fp8_e5m2: return 1.f / 65536.f;
      default: return 1.f;
    }
  }
  static float value_factor(const AttentionArgs& a) { return key_factor(a); }

  template <DType DT, bool kFull>
  static void rows_of(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                      const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                      int live, const DirectPrefetch& pf) {
    for (int rb = 0; rb < rows; rb += kDirectRowBlock) {
      const DirectPrefetch* prefetch = rb == 0 ? &pf : nullptr;  // once per head
      with_static_int<kDirectRowBlock>(imin(kDirectRowBlock, rows - rb), [&](auto rr) {
        with_static_int<kMaxHeadSize / 32>(c.head_size / 32, [&](auto nc) {
          constexpr int R = decltype(rr)::value, NC = decltype(nc)::value;
          direct_rows<DT, R, NC, kFull>(c, lsum, red, row0 + rb, k, k_stride, v, v_stride, t0,
                                        live, prefetch);
        });
      });
    }
  }

  template <bool kFull>
  static void head_chunk(const ItemContext& c, float* lsum, float* red, int row0, int rows,
                         const char* k, int64_t k_stride, const char* v, int64_t v_stride, int t0,
                         int live, const DirectPrefetch& pf) {
    switch (c.args->kv.dtype) {
      case DType::fp8_e4m3:
        rows_of<DType::fp8_e4m3, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0,
                                        live, pf);
        break;
      case DType::fp8_e5m2:
        rows_of<DType::fp8_e5m2, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0,
                                        live, pf);
        break;
      default:  // bf16 (direct_decode_applies)
        rows_of<DType::bf16, kFull>(c, lsum, red, row0, rows, k, k_stride, v, v_stride, t0, live,
                                    pf);
        break;
    }
  }

  static float lane_sum(const float* lanes) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes)); }

  // O rows are kept with the dims of each 32-dim chunk permuted (see the file comment).
  static void unpermute(const AttentionArgs&, const float* o, float* dst, int dv) {
    const __m512i lo_idx =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int d = 0; d < dv; d += 32) {
      const __m512 lo = _mm512_loadu_ps(o + d);
      const __m512 hi = _mm512_loadu_ps(o + d + 16);
      _mm512_storeu_ps(dst + d, _mm512_permutex2var_ps(lo, lo_idx, hi));
      _mm512_storeu_ps(dst + d + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
    }
  }
};

}  // namespace
}  // namespace pagedattn::cpu

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic pop
#endif
