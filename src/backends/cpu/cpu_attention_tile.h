// Flash-style paged attention for one work item, generic over an ISA's vector operations.
// Included by each ISA translation unit (cpu_kernels_{scalar,avx2,avx512,amx}.cpp), which supplies
// `Vec` (f32 vector ops) and `Ops` (packing + the two matrix microkernels: F32Ops in cpu_f32_ops.h
// for f32 compute on every ISA, Bf16Ops / AmxOps per ISA); everything here has internal linkage
// (see cpu_kernels.h for why).
//
// What it computes, for the rows of one work item (all query heads h of KV head g for a token
// range; row = (token - tok_begin) * G + h_in_group):
//     s_j   = scale * k_scale * (q . k_j)            keys j of the item's key range(s)
//     s_j   = cap * tanh(s_j / cap)                  (soft-cap, when set)
//     s_j  -= slope_h * |q_pos - j|                  (ALiBi, canonical form)
//     s_j   = -inf outside [lo, hi)                  (causal / sliding window / sequence end;
//                                                     selected, and the K/V of keys no row of a
//                                                     tile sees are never read: see chunk_rows)
//     out   = v_scale * sum_j e^{s_j - m} v_j / (sum_j e^{s_j - m} + e^{sink_h - m}),
//     lse   = m + log(denominator)                   (natural log)
// with an online softmax (running max m, running sum l, O rescaled by e^{m_old - m_new}; Ops
// that define kRescaleSlack (AMX) keep m while a tile exceeds it by at most that slack, so
// alpha = 1 and O is not touched: exact, P <= e^slack). A NaN logit of a visible key makes its
// row NaN, as in REFERENCE (the exponential and the soft-cap's tanh pass NaN through, and P is
// zeroed only for -inf logits).
//
// Tiling: keys in tiles of kKeyTile = 64 (four 16-key chunks; a chunk lies in one page when the
// block size is a multiple of 16, else each key looks its page up). Per tile: K is packed once (transposed: [D][64] f32, or
// [D/2][64] bf16 pairs for vdpbf16ps) and V once ([64][Dv] f32, or [32][Dv] bf16 key pairs),
// then S = Q·Kᵀ (rows x 64) and O = alpha*O + P·V run as register-blocked microkernels over all
// rows of the item: one KV tile serves every query head of the GQA group and every token of the
// q tile. Q (rows x D), S, P and O (rows x Dv, f32) live in per-thread scratch (L2).
// Head-fused items (decode batches, see cpu_plan.cpp) hold the rows of every KV head of one
// request: each key tile is packed and applied for the KV heads in turn (the rows of head block b
// sit at b * rows_per_head), so the item walks every head of a page before the next page. (Where a
// direct decode kernel applies, head-fused items run it instead: cpu_decode_direct.h.)
//
// Memory traffic: each K/V element of the item's key range is read once from the cache per item
// (decode: once per (request, kv head) — the floor; prefill: once per q tile of kMaxItemRows/G
// tokens). Q is read once, O written once. Compute: 2*rows*keys*(D + Dv) FLOPs per item. Pages
// are scattered by the block table, so the rows of the next tile are software-prefetched while
// the current one is packed (hardware prefetchers stop at every page). Floors and measurements:
// docs/perf/cpu.md.
//
// Precision points: (1) K/V converted to the compute type at pack (f32: exact for every input
// type; bf16: exact for bf16 and fp8 caches, f16/f32 values rounded to nearest even);
// (2) Q converted likewise; (3) products accumulated in f32 (FMA, or vdpbf16ps's f32 sums);
// (4) P rounded to bf16 in bf16_dot mode (l sums the rounded values, so the normalisation
// matches what was multiplied); (5) the output rounded once at the store. k_scale folds into
// the logit scale and v_scale into the final normalisation (exact fp8 dequantisation).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_convert.h"
#include "cpu_kernels.h"
#include "cpu_kv_rows.h"

namespace pagedattn::cpu {
namespace {

constexpr float kNegInf = -__builtin_inff();
constexpr float kLowestFinite = -3.40282347e+38f;

template <int N>
struct Int {
  static constexpr int value = N;
};

// Calls f(Int<n>{}) for a runtime n in [1, N] (n outside: nothing).
template <int N, class F>
inline void with_static_int(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) {
      f(Int<N>{});
      return;
    }
    with_static_int<N - 1>(n, f);
  }
}

// Register-blocked loops: f(i, Int<N>{}) for i = begin, begin + N, .. while a whole block of N
// fits before end, then f(i, Int<end - i>{}) for the rest (none if it is empty).
template <int N, class F>
inline void for_blocks(int begin, int end, F&& f) {
  int i = begin;
  for (; i + N <= end; i += N) f(i, Int<N>{});
  with_static_int<N - 1>(end - i, [&](auto n) { f(i, n); });
}

// Calls f.template operator()<DT>() for a runtime element dtype (f32, f16, bf16, e4m3; any other
// e5m2): the row conversions of every Ops dispatch through it.
template <class F>
inline void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f.template operator()<DType::f32>(); break;
    case DType::f16: f.template operator()<DType::f16>(); break;
    case DType::bf16: f.template operator()<DType::bf16>(); break;
    case DType::fp8_e4m3: f.template operator()<DType::fp8_e4m3>(); break;
    default: f.template operator()<DType::fp8_e5m2>(); break;
  }
}

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline float fmax_nan_free(float a, float b) { return a > b ? a : b; }

inline size_t align64(size_t bytes) { return (bytes + 63) & ~static_cast<size_t>(63); }

alignas(64) const unsigned char kZeroRow[kMaxKernelHeadSize * 4] = {};

// Per-thread scratch, carved in this order (every part 64-byte aligned).
struct ScratchLayout {
  size_t q, k, v, s, p, o, m, l, alpha, slope, lo, hi, pos, temp, total;
};

inline ScratchLayout scratch_layout(int head_size, int head_size_v, int max_rows) {
  ScratchLayout layout{};
  size_t offset = 0;
  auto take = [&offset](size_t bytes) {
    const size_t at = offset;
    offset += align64(bytes);
    return at;
  };
  const size_t rows = static_cast<size_t>(max_rows);
  const size_t d = static_cast<size_t>(head_size);
  const size_t dv = static_cast<size_t>(head_size_v);
  layout.q = take(rows * d * 4);                  // (rows, D) f32 or bf16
  layout.k = take(kKeyTile * d * 4);              // [D][64] f32 or [D/2][64] bf16 pairs
  layout.v = take(kKeyTile * dv * 4);             // [64][Dv] f32 or [32][Dv] bf16 pairs
  layout.s = take(rows * kKeyTile * 4);           // (rows, 64) f32 logits
  layout.p = take(rows * kKeyTile * 4);           // (rows, 64) f32 or bf16 probabilities
  layout.o = take(rows * dv * 4);                 // (rows, Dv) f32 accumulators
  layout.m = take(rows * 4);
  layout.l = take(rows * 4);
  layout.alpha = take(rows * 4);
  layout.slope = take(rows * 4);
  layout.lo = take(rows * 4);
  layout.hi = take(rows * 4);
  layout.pos = take(rows * 4);
  layout.temp = take(16 * (d > dv ? d : dv) * 4);  // one 16-row chunk converted
  layout.total = offset;
  return layout;
}

// ---- the keys each row of a tile sees -------------------------------------------------------------
// Rows i see keys [lo[i], hi[i]) (absolute positions); the tile holds keys t0 .. t0 + 64. The
// matrix kernels (Ops::qk / Ops::pv) may skip the tile columns that no row of a register block
// sees: their S is never read (the softmax masks it to -inf) and their P is 0, so skipping them is
// exact. On the causal diagonal of a prefill that is up to half of a tile.
struct TileKeys {
  const int32_t* lo;
  const int32_t* hi;
  int t0;
  // Columns [begin, end) (within [0, 64)) that some row of [i, i + n) sees; begin >= end: none.
  void columns(int i, int n, int& begin, int& end) const {
    int a = lo[i], b = hi[i];
    for (int r = i + 1; r < i + n; ++r) {
      a = imin(a, lo[r]);
      b = imax(b, hi[r]);
    }
    begin = imax(0, a - t0);
    end = imin(kKeyTile, b - t0);
  }
};

// ---- shared context of one work item ---------------------------------------------------------
struct ItemContext {
  const AttentionArgs* args;
  const WorkItem* item;
  int group, head_size, head_size_v, rows, kv_head;
  float logit_scale;  // scale * k_scale (fp8 caches)
  float value_scale;  // v_scale (fp8 caches) or 1
  bool prefetch_to_l2;  // head-fused item: prefetch the next tile into L2 (see prefetch_rows)
  size_t kv_elem_bytes;
  // scratch
  void* q;
  void* k;
  void* v;
  float* s;
  void* p;
  float* o;
  float* m;
  float* l;
  float* alpha;
  float* slope;
  int32_t* lo;
  int32_t* hi;
  int32_t* pos;
  float* temp;
};

inline const char* kv_row(const ItemContext& c, bool value, int req, int key) {
  return kv_row_of(*c.args, c.kv_head, value, req, key);
}

// Rows of chunk `chunk` (keys t0 + 16*chunk ...) of a tile with n live keys; dead rows -> zeros.
// Keys outside [key_lo, key_hi) are dead too: keys that none of the tile's rows can see are never
// read, so whatever their slots hold (NaN included) cannot reach the output (P = 0 would not
// stop it: 0 * NaN = NaN). With a block size that is a multiple of 16 the chunk lies in one page
// (one block lookup); otherwise every row looks its block up.
inline void chunk_rows(const ItemContext& c, bool value, int req, int t0, int n, int chunk,
                       const char* rows[16], int key_lo = 0, int key_hi = 0x7FFFFFFF) {
  const int j0 = chunk * 16;
  const int k0 = t0 + j0;
  const int lead = imax(0, imin(16, key_lo - k0));
  const int live = imin(imin(16, n - j0), key_hi - k0);
  const char* zero = reinterpret_cast<const char*>(kZeroRow);
  if (live <= lead) {
    for (int i = 0; i < 16; ++i) rows[i] = zero;
    return;
  }
  const KvSource& kv = c.args->kv;
  if (kv.paged && kv.block_size % 16 != 0) {
    for (int i = 0; i < 16; ++i) {
      rows[i] = i >= lead && i < live ? kv_row(c, value, req, k0 + i) : zero;
    }
    return;
  }
  // k0 shares its page with the live keys (the chunk is 16-aligned, so it lies in one page).
  const char* first = kv_row(c, value, req, k0);
  const int64_t stride =
      (value ? kv.v_token_stride : kv.k_token_stride) * static_cast<int64_t>(c.kv_elem_bytes);
  for (int i = 0; i < 16; ++i) rows[i] = i >= lead && i < live ? first + i * stride : zero;
}

// ---- output ------------------------------------------------------------------------------------
inline void store_output_row(const AttentionArgs& a, const float* values, float factor, int token,
                             int head) {
  const int dv = a.head_size_v;
  const int64_t offset = static_cast<int64_t>(token) * a.o_stride_t +
                         static_cast<int64_t>(head) * a.o_stride_h;
  switch (a.o_dtype) {
    case DType::f32: {
      float* out = static_cast<float*>(a.output) + offset;
      for (int d = 0; d < dv; ++d) out[d] = values[d] * factor;
      break;
    }
    case DType::f16: {
      uint16_t* out = static_cast<uint16_t*>(a.output) + offset;
      for (int d = 0; d < dv; ++d) out[d] = f32_to_f16(values[d] * factor);
      break;
    }
    case DType::bf16: {
      uint16_t* out = static_cast<uint16_t*>(a.output) + offset;
      for (int d = 0; d < dv; ++d) out[d] = f32_to_bf16(values[d] * factor);
      break;
    }
    default: {  // fp8_e4m3: saturate(o / output_scale)
      uint8_t* out = static_cast<uint8_t*>(a.output) + offset;
      for (int d = 0; d < dv; ++d) out[d] = f32_to_fp8_e4m3((values[d] * factor) / a.output_scale);
      break;
    }
  }
}

// Normalises one row (unnormalised O relative to max m, sum l), adds the sink, writes the output
// row and its LSE. A row without any visible key (m = -inf) and without a sink outputs 0 and LSE
// -inf; with a sink it outputs 0 and LSE = sink (the softmax is all on the sink).
inline void finalize_row(const AttentionArgs& a, const float* o, float m, float l, int token,
                         int head, float value_scale) {
  float max_all = m;
  const bool has_sink = a.sinks != nullptr;
  const float sink = has_sink ? a.sinks[head] : kNegInf;
  if (sink > max_all) max_all = sink;
  float factor = 0.f;
  float lse = kNegInf;
  if (max_all != kNegInf) {
    // Without a sink above m (the common case) the exponent is 0 and the weight 1: no call
    // (m = +inf gives inf - inf = NaN, which still takes the call: a NaN weight, as before).
    const float shift = m - max_all;
    const float keys_weight = m == kNegInf ? 0.f : shift == 0.f ? 1.f : std::exp(shift);
    const float total = l * keys_weight + (has_sink ? std::exp(sink - max_all) : 0.f);
    factor = keys_weight / total;
    if (a.lse != nullptr) lse = max_all + std::log(total);
  }
  store_output_row(a, o, factor * value_scale, token, head);
  if (a.lse != nullptr) {
    a.lse[static_cast<int64_t>(head) * a.lse_stride_h + static_cast<int64_t>(token) * a.lse_stride_t] =
        lse;
  }
}

inline float kv_value_scale(const AttentionArgs& a, int kv_head) {
  if (a.kv.dtype != DType::fp8_e4m3 && a.kv.dtype != DType::fp8_e5m2) return 1.f;
  return a.v_scale_per_head != nullptr ? a.v_scale_per_head[kv_head * a.v_scale_per_head_stride]
                                        : a.v_scale;
}

inline float kv_key_scale(const AttentionArgs& a, int kv_head) {
  if (a.kv.dtype != DType::fp8_e4m3 && a.kv.dtype != DType::fp8_e5m2) return 1.f;
  return a.k_scale_per_head != nullptr ? a.k_scale_per_head[kv_head * a.k_scale_per_head_stride]
                                        : a.k_scale;
}

// ---- softmax of one tile -----------------------------------------------------------------------
// tanh for the soft-cap: odd Taylor series below 0.3 (|error| < 1e-10), 1 - 2/(e^{2|y|}+1) above
// (absolute error ~ 1 ulp of 1, relative < 4e-7 there).
template <class Vec>
inline typename Vec::V vec_tanh(typename Vec::V y) {
  using V = typename Vec::V;
  const V ay = Vec::abs(y);
  const V y2 = Vec::mul(ay, ay);
  V poly = Vec::set1(21844.f / 6081075.f);
  poly = Vec::fma(poly, y2, Vec::set1(-1382.f / 155925.f));
  poly = Vec::fma(poly, y2, Vec::set1(62.f / 2835.f));
  poly = Vec::fma(poly, y2, Vec::set1(-17.f / 315.f));
  poly = Vec::fma(poly, y2, Vec::set1(2.f / 15.f));
  poly = Vec::fma(poly, y2, Vec::set1(-1.f / 3.f));
  const V small = Vec::fma(Vec::mul(poly, y2), ay, ay);
  const V e = Vec::exp(Vec::min(Vec::set1(80.f), Vec::add(ay, ay)));  // NaN stays NaN
  const V big = Vec::sub(Vec::set1(1.f), Vec::div(Vec::set1(2.f), Vec::add(e, Vec::set1(1.f))));
  const V t = Vec::select(Vec::lt(ay, Vec::set1(0.3f)), small, big);
  return Vec::select(Vec::lt(y, Vec::zero()), Vec::sub(Vec::zero(), t), t);
}

// Transforms the logits of rows [ra, rb) for keys [t0, t0 + n) (restricted to [kb, ke)), updates
// the running max/sum, writes P (via Ops::store_p) and alpha = e^{m_old - m_new} per row.
template <class Ops>
inline void softmax_tile(const ItemContext& c, int ra, int rb, int t0, int n, int kb, int ke) {
  using Vec = typename Ops::Vec;
  using V = typename Vec::V;
  constexpr int W = Vec::W;
  const AttentionArgs& a = *c.args;
  const V iota = Vec::iota();
  const V vscale = Vec::set1(c.logit_scale);
  const bool capped = a.soft_cap > 0.f;
  const V vcap = Vec::set1(a.soft_cap);
  const V vinv_cap = Vec::set1(capped ? 1.f / a.soft_cap : 0.f);
  const bool alibi = a.alibi_slopes != nullptr;
  for (int i = ra; i < rb; ++i) {
    const int lo = imax(imax(c.lo[i], kb), t0);
    const int hi = imin(imin(c.hi[i], ke), t0 + n);
    if (hi <= lo) {
      c.alpha[i] = 1.f;
      Ops::zero_p_row(c.p, i);
      continue;
    }
    float* srow = c.s + static_cast<size_t>(i) * kKeyTile;
    const V vlo = Vec::set1(static_cast<float>(lo));
    const V vhi = Vec::set1(static_cast<float>(hi));
    const V vpos = Vec::set1(static_cast<float>(c.pos[i]));
    const V vslope = Vec::set1(c.slope[i]);
    V vmax = Vec::set1(kNegInf);
    // The second pass computes P from srow * p_scale - m: p_scale is the logit scale where srow
    // still holds the raw Q·Kᵀ (fast path), 1 where the first pass stored the final logits.
    float p_scale = 1.f;
    float tile_max;
    if (lo == t0 && hi == t0 + kKeyTile && !capped && !alibi && c.logit_scale > 0.f) {
      // Every key of the tile visible, plain logits (most tiles of a prefill): no mask to apply,
      // and S is left raw: max(s * scale) = scale * max(s) for scale > 0 (rounding is monotonic),
      // and the second pass folds the scale into its subtraction of m (one FMA).
      for (int j = 0; j < kKeyTile; j += W) vmax = Vec::max(vmax, Vec::load(srow + j));
      p_scale = c.logit_scale;
      tile_max = Vec::hmax(vmax) * p_scale;
    } else {
      for (int j = 0; j < kKeyTile; j += W) {
        const V kpos = Vec::add(Vec::set1(static_cast<float>(t0 + j)), iota);
        V x = Vec::mul(Vec::load(srow + j), vscale);
        if (capped) x = Vec::mul(vcap, vec_tanh<Vec>(Vec::mul(x, vinv_cap)));
        if (alibi) x = Vec::sub(x, Vec::mul(vslope, Vec::abs(Vec::sub(vpos, kpos))));
        x = Vec::select(Vec::and_mask(Vec::ge(kpos, vlo), Vec::lt(kpos, vhi)), x,
                        Vec::set1(kNegInf));
        Vec::store(srow + j, x);
        vmax = Vec::max(vmax, x);
      }
      tile_max = Vec::hmax(vmax);
    }
    const float m_old = c.m[i];
    float m_new = fmax_nan_free(m_old, tile_max);
    if constexpr (requires { Ops::kRescaleSlack; }) {
      // Lazy rescale (Ops that pay for every O rescale, i.e. AMX): the running max m is kept while
      // the tile's logits exceed it by at most the slack, so P = e^{s - m} <= e^slack and
      // alpha = 1 exactly; O and l stay relative to the same m, so the result is unchanged
      // (the normalisation and the LSE use m and l together). Only a larger jump rescales.
      if (m_old != kNegInf && tile_max <= m_old + Ops::kRescaleSlack) m_new = m_old;
    }
    if (m_new == kNegInf) {
      // Every visible logit is -inf or NaN (rare: never with finite logits). The max reductions
      // drop a NaN (Vec::max / hmax return their second operand when either is NaN), so a row
      // whose only visible logits here are NaN lands here too: it must become NaN (REFERENCE:
      // e^{NaN - m}), not get weight 0. Its logits are in srow, masked ones already -inf.
      bool nan = false;
      for (int j = lo - t0; j < hi - t0; ++j) nan |= srow[j] != srow[j];
      if (!nan) {  // every visible logit is -inf: nothing to add yet
        c.alpha[i] = 1.f;
        Ops::zero_p_row(c.p, i);
        continue;
      }
      m_new = __builtin_nanf("");  // P, l, O and the LSE of the row NaN from here on
    }
    // m unchanged (the common case with a lazy max): alpha = e^0 = 1 without the call.
    const float alpha = m_old == kNegInf ? 0.f : m_new == m_old ? 1.f : std::exp(m_old - m_new);
    const V vneg_m = Vec::set1(-m_new);
    const V vp_scale = Vec::set1(p_scale);
    const V lowest = Vec::set1(kLowestFinite);
    // P = e^{x}, x = s * p_scale - m: -inf (masked, or below the range) gives 0, NaN gives NaN.
    // Vec::exp of -inf is 0 already where Vec says so (kExpOfNegInfIsZero); else it is selected.
    auto p_of = [&](const float* src) {
      const V x = Vec::fma(Vec::load(src), vp_scale, vneg_m);
      const V e = Vec::exp(x);
      if constexpr (requires { Vec::kExpOfNegInfIsZero; }) {
        return e;
      } else {
        return Vec::select(Vec::lt(x, lowest), Vec::zero(), e);
      }
    };
    // Vectors wholly outside the row's keys [lo, hi) are P = 0 without the exponential (the
    // causal diagonal, window edges; their S may be stale: Ops::qk skips what no row sees).
    const int live_lo = lo - t0, live_hi = hi - t0;
    auto p_at = [&](int j) {
      return j + W <= live_lo || j >= live_hi ? Vec::zero() : p_of(srow + j);
    };
    V vsum = Vec::zero();
    if constexpr (requires { Ops::store_p_pair; }) {
      // Two vectors of P at a time (Ops rounds, stores and sums them in one go).
      for (int j = 0; j < kKeyTile; j += 2 * W) {
        vsum = Ops::store_p_pair(c.p, i, j, p_at(j), p_at(j + W), vsum);
      }
    } else {
      for (int j = 0; j < kKeyTile; j += W) vsum = Vec::add(vsum, Ops::store_p(c.p, i, j, p_at(j)));
    }
    c.l[i] = c.l[i] * alpha + Vec::hsum(vsum);
    c.m[i] = m_new;
    c.alpha[i] = alpha;
  }
}

// ---- the item driver ---------------------------------------------------------------------------
// Software prefetch of the rows of one chunk: pages are scattered (block table), so the hardware
// prefetchers cannot run ahead across them and a lone thread would be bound by DRAM latency.
// to_l2 (head-fused items, which stream every head of their pages from DRAM): locality 1
// (prefetcht2 with GCC), so the misses are tracked by the L2 rather than the few L1 fill buffers,
// which lets more of them be in flight (measured +10% on decode 16x4k); the other items keep
// prefetcht0 (their tiles are often cache-resident, where an L2-only prefetch leaves the L1
// misses exposed).
// Always inlined: GCC treats a function whose only effect is prefetching as const and deletes
// its calls once it is not inlined (observed with GCC 12 -O1..-O3: no prefetch left at all).
__attribute__((always_inline)) inline void prefetch_rows(const char* const rows[16],
                                                         size_t row_bytes, bool to_l2) {
  for (int i = 0; i < 16; ++i) {
    if (rows[i] == reinterpret_cast<const char*>(kZeroRow)) continue;
    if (to_l2) {
      for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(rows[i] + b, 0, 1);
    } else {
      for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(rows[i] + b, 0, 3);
    }
  }
}

// Packs the K (value=false) or V tile of keys [t0, t0 + n) (keys outside [key_lo, key_hi) as
// zeros) and prefetches the same chunk of the next tile [t0 + 64, t0 + 64 + next_n) meanwhile.
template <class Ops>
inline void pack_kv_tile(const ItemContext& c, bool value, int req, int t0, int n, int next_n,
                         int key_lo, int key_hi) {
  const char* rows[16];
  const char* next_rows[16];
  const size_t row_bytes =
      static_cast<size_t>(value ? c.head_size_v : c.head_size) * c.kv_elem_bytes;
  for (int chunk = 0; chunk < kKeyTile / 16; ++chunk) {
    if (next_n > chunk * 16) {
      chunk_rows(c, value, req, t0 + kKeyTile, next_n, chunk, next_rows);
      prefetch_rows(next_rows, row_bytes, c.prefetch_to_l2);
    }
    chunk_rows(c, value, req, t0, n, chunk, rows, key_lo, key_hi);
    if (value) {
      Ops::pack_v_chunk(c.v, chunk * 16, rows, c.args->kv.dtype, c.head_size_v, c.temp);
    } else {
      Ops::pack_k_chunk(c.k, chunk * 16, rows, c.args->kv.dtype, c.head_size, c.temp);
    }
  }
}

// Attends rows [ra, rb) to keys [kb, ke) of request `req` (its block table / token range).
// Head-fused items (head_blocks > 1): rows [ra, rb) + b * rows_per_head belong to KV head
// first_kv_head + b and share the masks of block 0; every key tile is processed for all blocks
// before the next tile, so consecutive reads walk whole pages.
template <class Ops>
inline void attend_range(ItemContext& c, int req, int kb, int ke, int ra, int rb,
                         int first_kv_head = 0, int head_blocks = 1, int rows_per_head = 0) {
  if (ra >= rb) return;
  int vis_lo = c.lo[ra], vis_hi = c.hi[ra];
  for (int i = ra + 1; i < rb; ++i) {
    vis_lo = imin(vis_lo, c.lo[i]);
    vis_hi = imax(vis_hi, c.hi[i]);
  }
  const int begin = imax(kb, vis_lo);
  const int end = imin(ke, vis_hi);
  if (begin >= end) return;
  for (int t0 = begin & ~15; t0 < end; t0 += kKeyTile) {
    const int n = imin(kKeyTile, end - t0);
    // Rows that see a key of this tile form a contiguous run (positions grow with the row).
    int r0 = ra, r1 = rb;
    const int tile_lo = imax(t0, begin);
    while (r0 < r1 && (c.hi[r0] <= tile_lo || c.lo[r0] >= t0 + n)) ++r0;
    while (r1 > r0 && (c.hi[r1 - 1] <= tile_lo || c.lo[r1 - 1] >= t0 + n)) --r1;
    if (r0 >= r1) continue;
    const int next_n = imin(kKeyTile, end - (t0 + kKeyTile));
    // Keys of the tile that some row of [r0, r1) sees: [any_lo, any_hi); that every row sees:
    // [all_lo, all_hi). Only the first are read; the others ("ragged": the causal diagonal of a
    // prefill or spec decode, the per-token window edge) are checked for NaN / inf values below.
    const int key_lo = imax(t0, begin), key_hi = imin(t0 + n, end);
    int any_lo = c.lo[r0], any_hi = c.hi[r0], all_lo = c.lo[r0], all_hi = c.hi[r0];
    for (int i = r0 + 1; i < r1; ++i) {
      any_lo = imin(any_lo, c.lo[i]);
      any_hi = imax(any_hi, c.hi[i]);
      all_lo = imax(all_lo, c.lo[i]);
      all_hi = imin(all_hi, c.hi[i]);
    }
    any_lo = imax(any_lo, key_lo);
    any_hi = imin(any_hi, key_hi);
    all_lo = imax(all_lo, any_lo);
    all_hi = imin(all_hi, any_hi);
    if (all_hi <= all_lo) all_lo = all_hi = any_hi;  // no key seen by every row
    for (int b = 0; b < head_blocks; ++b) {
      if (head_blocks > 1) {
        c.kv_head = first_kv_head + b;
        c.logit_scale = c.args->scale * kv_key_scale(*c.args, c.kv_head);
      }
      const int b0 = r0 + b * rows_per_head, b1 = r1 + b * rows_per_head;
      pack_kv_tile<Ops>(c, false, req, t0, n, next_n, any_lo, any_hi);
      const TileKeys keys{c.lo, c.hi, t0};
      Ops::qk(c.s, c.q, c.k, b0, b1, c.head_size, keys);
      softmax_tile<Ops>(c, b0, b1, t0, n, begin, end);
      pack_kv_tile<Ops>(c, true, req, t0, n, next_n, any_lo, any_hi);
      const bool ragged_non_finite =
          values_non_finite(*c.args, req, c.kv_head, 1, any_lo, all_lo) ||
          values_non_finite(*c.args, req, c.kv_head, 1, all_hi, any_hi);
      if (!ragged_non_finite) {
        Ops::pv(c.o, c.p, c.v, c.alpha, b0, b1, c.head_size_v, keys);
        continue;
      }
      // Rare: a key that only some rows see has a NaN / inf value. P·V one token at a time (rows
      // with the same mask are consecutive), each with a V tile of the keys it sees only.
      for (int g0 = b0; g0 < b1;) {
        int g1 = g0 + 1;
        while (g1 < b1 && c.lo[g1] == c.lo[g0] && c.hi[g1] == c.hi[g0]) ++g1;
        pack_kv_tile<Ops>(c, true, req, t0, n, 0, imax(c.lo[g0], any_lo), imin(c.hi[g0], any_hi));
        Ops::pv(c.o, c.p, c.v, c.alpha, g0, g1, c.head_size_v, keys);
        g0 = g1;
      }
    }
  }
}

// Per-item constants and the scratch pointers of one work item (scratch: thread_scratch_bytes).
inline ItemContext make_item_context(const AttentionArgs& a, const WorkItem& it, char* scratch) {
  const ScratchLayout layout = scratch_layout(a.head_size, a.head_size_v, a.max_rows);
  ItemContext c;
  c.args = &a;
  c.item = &it;
  c.group = a.group_size;
  c.head_size = a.head_size;
  c.head_size_v = a.head_size_v;
  c.kv_head = it.kv_head;
  c.rows = (it.tok_end - it.tok_begin) * c.group * it.num_kv_heads;
  c.prefetch_to_l2 = it.num_kv_heads > 1;
  c.logit_scale = a.scale * kv_key_scale(a, it.kv_head);
  c.value_scale = kv_value_scale(a, it.kv_head);
  c.kv_elem_bytes = elem_bytes(a.kv.dtype);
  c.q = scratch + layout.q;
  c.k = scratch + layout.k;
  c.v = scratch + layout.v;
  c.s = reinterpret_cast<float*>(scratch + layout.s);
  c.p = scratch + layout.p;
  c.o = reinterpret_cast<float*>(scratch + layout.o);
  c.m = reinterpret_cast<float*>(scratch + layout.m);
  c.l = reinterpret_cast<float*>(scratch + layout.l);
  c.alpha = reinterpret_cast<float*>(scratch + layout.alpha);
  c.slope = reinterpret_cast<float*>(scratch + layout.slope);
  c.lo = reinterpret_cast<int32_t*>(scratch + layout.lo);
  c.hi = reinterpret_cast<int32_t*>(scratch + layout.hi);
  c.pos = reinterpret_cast<int32_t*>(scratch + layout.pos);
  c.temp = reinterpret_cast<float*>(scratch + layout.temp);
  return c;
}

// Row setup: positions, visible key ranges, slopes, packed Q (Ops::pack_q_row); m = -inf, l = 0,
// O = 0.
template <class Ops>
inline void setup_item_rows(ItemContext& c) {
  const AttentionArgs& a = *c.args;
  const WorkItem& it = *c.item;
  const int G = c.group;
  const int head_blocks = it.num_kv_heads;
  const int rows_per_head = (it.tok_end - it.tok_begin) * G;
  const size_t q_elem = elem_bytes(a.q_dtype);
  for (int r = it.req_begin; r < it.req_end; ++r) {
    const int q_first = a.query_start_loc[r];
    const int t_lo = imax(q_first, it.tok_begin);
    const int t_hi = imin(a.query_start_loc[r + 1], it.tok_end);
    const int kv_len = a.seq_lens[r];
    for (int t = t_lo; t < t_hi; ++t) {
      const int pos = a.first_query_pos[r] + (t - q_first);
      int lo = 0;
      int hi = a.causal ? imin(kv_len, pos + 1) : kv_len;
      if (a.window > 0) {
        lo = imax(0, pos - (a.window - 1));
        if (a.window_symmetric) hi = imin(hi, pos + a.window);
      }
      for (int hg = 0; hg < head_blocks * G; ++hg) {
        const int h = hg % G;
        const int row = (hg / G) * rows_per_head + (t - it.tok_begin) * G + h;
        const int head = it.kv_head * G + hg;
        c.pos[row] = pos;
        c.lo[row] = lo;
        c.hi[row] = hi;
        c.slope[row] = a.alibi_slopes != nullptr ? a.alibi_slopes[head] : 0.f;
        c.m[row] = kNegInf;
        c.l[row] = 0.f;
        const char* q_src = static_cast<const char*>(a.query) +
                            (static_cast<int64_t>(t) * a.q_stride_t +
                             static_cast<int64_t>(head) * a.q_stride_h) * static_cast<int64_t>(q_elem);
        Ops::pack_q_row(c.q, row, q_src, a.q_dtype, a.head_size);
      }
    }
  }
  std::memset(c.o, 0, static_cast<size_t>(c.rows) * a.head_size_v * sizeof(float));
}

template <class Ops>
void run_item_impl(const AttentionArgs& a, const WorkItem& it, char* scratch) {
  ItemContext c = make_item_context(a, it, scratch);
  const int G = c.group;
  const int head_blocks = it.num_kv_heads;
  const int rows_per_head = (it.tok_end - it.tok_begin) * G;
  setup_item_rows<Ops>(c);

  // Cascade prefix: keys [0, prefix_len) shared by every request of the item.
  if (it.prefix_len > 0) attend_range<Ops>(c, it.req_begin, 0, it.prefix_len, 0, c.rows);
  // Each request's own keys.
  for (int r = it.req_begin; r < it.req_end; ++r) {
    const int t_lo = imax(a.query_start_loc[r], it.tok_begin);
    const int t_hi = imin(a.query_start_loc[r + 1], it.tok_end);
    if (t_lo >= t_hi) continue;
    const bool single = it.req_end - it.req_begin == 1;
    const int kb = imax(single ? it.kv_begin : 0, it.prefix_len);
    const int ke = single ? it.kv_end : a.seq_lens[r];
    attend_range<Ops>(c, r, kb, ke, (t_lo - it.tok_begin) * G, (t_hi - it.tok_begin) * G,
                      it.kv_head, head_blocks, rows_per_head);
  }

  // Finalize: output rows, or partial rows of a split-KV group.
  const int dv = a.head_size_v;
  for (int row = 0; row < c.rows; ++row) {
    const float* o_row = c.o + static_cast<size_t>(row) * dv;
    if (it.partial_base >= 0) {
      const int64_t slot = static_cast<int64_t>(it.partial_base) +
                           static_cast<int64_t>(it.split_index) * c.rows + row;
      std::memcpy(a.partial_o + slot * a.partial_o_stride, o_row, dv * sizeof(float));
      a.partial_ml[2 * slot] = c.m[row];
      a.partial_ml[2 * slot + 1] = c.l[row];
    } else {
      const int block = row / rows_per_head, local = row % rows_per_head;
      const int kv_head = it.kv_head + block;
      const float value_scale = head_blocks > 1 ? kv_value_scale(a, kv_head) : c.value_scale;
      finalize_row(a, o_row, c.m[row], c.l[row], it.tok_begin + local / G,
                   kv_head * G + local % G, value_scale);
    }
  }
}

// Combines the partial rows of a split-KV group: M = max m_s, O = sum e^{m_s - M} O_s,
// L = sum e^{m_s - M} l_s, then finalize_row. M is NaN when any m_s is (the row then NaN, output
// and LSE, whatever the split order).
template <class Vec>
void merge_impl(const AttentionArgs& a, const MergeTask& task) {
  using V = typename Vec::V;
  constexpr int W = Vec::W;
  const int G = a.group_size;
  const int dv = a.head_size_v;
  const int rows = (task.tok_end - task.tok_begin) * G;
  alignas(64) float merged[kMaxKernelHeadSize];
  const float value_scale = kv_value_scale(a, task.kv_head);
  for (int row = 0; row < rows; ++row) {
    float m_all = kNegInf;
    for (int s = 0; s < task.num_splits; ++s) {
      const int64_t slot = static_cast<int64_t>(task.partial_base) + static_cast<int64_t>(s) * rows + row;
      const float m_s = a.partial_ml[2 * slot];
      // NaN-sticky: a split whose row saw a NaN logit (m_s NaN) makes the row NaN (finalize_row:
      // e^{NaN - NaN}); `a > b ? a : b` would drop it for a later fully masked split (m_s = -inf).
      m_all = (std::isnan(m_s) || m_s > m_all) ? m_s : m_all;
    }
    float l_all = 0.f;
    for (int d = 0; d < dv; d += W) Vec::store(merged + d, Vec::zero());
    if (m_all != kNegInf) {
      for (int s = 0; s < task.num_splits; ++s) {
        const int64_t slot = static_cast<int64_t>(task.partial_base) + static_cast<int64_t>(s) * rows + row;
        const float m_s = a.partial_ml[2 * slot];
        if (m_s == kNegInf) continue;
        const float w = std::exp(m_s - m_all);
        l_all += w * a.partial_ml[2 * slot + 1];
        const float* o_s = a.partial_o + slot * a.partial_o_stride;
        const V vw = Vec::set1(w);
        for (int d = 0; d < dv; d += W) {
          Vec::store(merged + d, Vec::fma(vw, Vec::load(o_s + d), Vec::load(merged + d)));
        }
      }
    }
    finalize_row(a, merged, m_all, l_all, task.tok_begin + row / G, task.kv_head * G + row % G,
                 value_scale);
  }
}

}  // namespace
}  // namespace pagedattn::cpu
