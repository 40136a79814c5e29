// The direct decode driver of the CPU backend, shared by its ISA kernels (cpu_decode_avx512.h:
// AVX-512 BF16; cpu_decode_avx2.h: AVX2 f32). Internal linkage only (see cpu_kernels.h).
//
// A direct decode kernel computes the same as cpu_attention_tile.h for one head-fused decode item
// (all KV heads of one request, final output rows, no cascade prefix), on the cache rows in place:
// no K transpose, no V pack. The driver here walks the keys in chunks of 16 (one page, or a
// 16-key part of one), and per chunk the KV heads in turn, so consecutive reads walk whole pages;
// for each (chunk, head) the ISA kernel computes S = Q·Kᵀ for the head's rows, the online
// softmax, and O += P·V (Kernel::head_chunk). It owns what every ISA shares: which items apply
// (direct_decode_shape_applies), the chunk addresses, the prefetch plan (DirectPrefetch), the
// per-head fp8 scales and the finalisation of the rows.
//
// Kernel interface (a struct of static members):
//   setup(c)          the item's rows (Q in the kernel's layout, masks; m = -inf, O = 0).
//   head_chunk<kFull>(c, lsum, red, row0, rows, k, k_token, v, v_token, t0, live, pf)
//                     rows [row0, row0 + rows) of one KV head over the chunk at key t0 (live
//                     keys; kFull = all 16), prefetching what pf names once per head.
//   key_factor(a), value_factor(a)
//                     constant factors of the kernel's conversion (1, or a power of two where
//                     the kernel widens fp8 codes to a scaled value: AVX2 reads e4m3 as the f16
//                     of value / 256, AVX-512 e4m3 / e5m2 as the bf16 of value * 2^8 / 2^16),
//                     folded into the logit scale and the output normalisation.
//   unpermute(a, o, dst, dv)
//                     one O row in dimension order (the kernel may keep O dims permuted).
//   lane_sum(lanes)   l of a row from its 16 lane sums, in the order of the tile kernel's hsum
//                     of the same width.
// The kernels read a V row only for the rows that see its key (ragged keys row by row), so no
// item depends on what masked cache slots hold and none is handed to the tile kernel for it.
// Scratch the kernels use: lsum = c.s (rows x 16 lane sums of l), red = c.k (Q·Kᵀ partial sums),
// c.p (P rows), c.o (O rows).
#pragma once

#include <cstdint>

#include "cpu_attention_tile.h"

namespace pagedattn::cpu {
namespace {

constexpr int kDirectChunk = 16;            // keys per chunk
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

// The item conditions every direct kernel shares (see the file comment): head-fused, final rows, a
// paged cache with dense rows and a block size that is a multiple of 16, D = Dv; the ISA kernels
// add their dtype and head-size conditions.
inline bool direct_decode_shape_applies(const AttentionArgs& a, const WorkItem& it) {
  return a.direct_decode && it.num_kv_heads > 1 && it.partial_base < 0 && it.prefix_len == 0 &&
         it.req_end - it.req_begin == 1 && a.kv.paged && a.kv.block_size % kDirectChunk == 0 &&
         a.head_size == a.head_size_v &&
         direct_decode_dense(a.kv.k_token_stride, a.kv.k_head_stride, a.head_size,
                             it.num_kv_heads) &&
         direct_decode_dense(a.kv.v_token_stride, a.kv.v_head_stride, a.head_size, it.num_kv_heads);
}

// What one head's Q·Kᵀ loop prefetches, spread over its key pairs (16 rows per head):
//   L2 (prefetcht1; l2_k, l2_v): the head's 1/heads share of the chunk kDirectPrefetchChunks
//   ahead, DRAM -> L2: NHD = 16 consecutive rows of the chunk's single run (so the heads in turn
//   walk the whole chunk front to back), HND = the head's own 16 rows;
//   L1 (prefetcht0; l1_v, l1_k): this head's V rows of this chunk (read right after the loop) and
//   the next head's K rows (the next chunk's first head after the last one), L2 -> L1. Without
//   it the strided rows of one head were read from L2 with their latency exposed (measured +40%
//   single-thread with it).
// (That is the AVX-512 kernel's plan; the AVX2 kernel takes the L1 part only, with this head's K
// rows a few keys ahead instead: cpu_decode_avx2.h.)
// Every pointer is valid to prefetch (where there is nothing left to fetch it points at data that
// is already cached): prefetches never fault, and no branch is needed.
struct DirectPrefetch {
  const char* l2_k = nullptr;
  const char* l2_v = nullptr;
  const char* l1_v = nullptr;
  const char* l1_k = nullptr;
  int64_t k_stride = 0, v_stride = 0;  // bytes between keys (rows) for l1_k, l1_v
  int64_t row_bytes = 0;               // bytes of one K (= V) row
};

// 0, computed from the bits of x: an offset that makes a prefetch address wait for x (`and $0` is
// not one of x86's dependency-breaking zero idioms, and the compiler cannot see through the asm).
// Adding it to a key pair's prefetch addresses paces the prefetches: the core issues them as the
// pair's dot products complete instead of running ahead and issuing a whole head's prefetches at
// once, which measured ~10% slower on decode 16 x 4k (docs/perf/cpu.md).
inline int64_t zero_after_bits(int32_t bits) {
  int64_t v = bits;
  asm("and $0, %0" : "+r"(v));
  return v;
}

// The prefetches of key pair tp (rows 2tp, 2tp + 1) of a head's chunk; pace = zero_after_bits(...).
// kRowBytes: pf.row_bytes where the caller knows it at compile time (the loops then unrolled), or 0.
template <int64_t kRowBytes = 0>
__attribute__((always_inline)) inline void direct_prefetch_pair(const DirectPrefetch& pf, int tp,
                                                                int64_t pace) {
  const int64_t row_bytes = kRowBytes > 0 ? kRowBytes : pf.row_bytes;
  const int64_t lines = (row_bytes + 63) / 64;
  const char* l2_k = pf.l2_k + tp * 2 * row_bytes + pace;
  const char* l2_v = pf.l2_v + tp * 2 * row_bytes + pace;
  const char* l1_v = pf.l1_v + (2 * tp) * pf.v_stride + pace;
  const char* l1_k = pf.l1_k + (2 * tp) * pf.k_stride + pace;
  for (int64_t l = 0; l < 2 * row_bytes; l += 64) __builtin_prefetch(l2_k + l, 0, 2);
  for (int64_t l = 0; l < 2 * row_bytes; l += 64) __builtin_prefetch(l2_v + l, 0, 2);
  for (int64_t l = 0; l < lines; ++l) {
    __builtin_prefetch(l1_v + 64 * l, 0, 3);
    __builtin_prefetch(l1_v + pf.v_stride + 64 * l, 0, 3);
    __builtin_prefetch(l1_k + 64 * l, 0, 3);
    __builtin_prefetch(l1_k + pf.k_stride + 64 * l, 0, 3);
  }
}

// Key `key` of a chunk's rows (key t at k + t * k_stride) for Q·Kᵀ: the row, or from `live` on the
// zero row (a dead slot is never read; its logit is masked).
template <bool kFull>
__attribute__((always_inline)) inline const char* direct_key_row(const char* k, int64_t k_stride,
                                                                 int live, int key) {
  return kFull || key < live ? k + key * k_stride : reinterpret_cast<const char*>(kZeroRow);
}

// O rows [0, rows) (dv floats each) times their alpha: the lazy max's rescale, rare (plain loops,
// vectorised by the compiler at each kernel's width).
inline void direct_rescale_rows(float* o, int dv, const float* alpha, int rows) {
  for (int r = 0; r < rows; ++r) {
    float* row = o + static_cast<size_t>(r) * dv;
    const float a = alpha[r];
    for (int j = 0; j < dv; ++j) row[j] *= a;
  }
}

// The keys [0, n) of a chunk (relative to its first key t0) that the rows of a register block see
// (row r: [lo[r], hi[r]) in absolute keys): every row sees [all_lo, all_hi), some row sees
// [any_lo, any_hi), and all_lo <= all_hi always (both = any_hi when no key is seen by every row),
// so the keys only some rows see ("ragged": a causal end between the tokens of a multi-token
// decode, a window start) are [any_lo, all_lo) and [all_hi, any_hi).
struct ChunkKeys {
  int all_lo, all_hi, any_lo, any_hi;
};

inline ChunkKeys chunk_keys_seen(const int32_t* lo, const int32_t* hi, int rows, int t0, int n) {
  ChunkKeys k{0, n, n, 0};
  for (int r = 0; r < rows; ++r) {
    k.all_lo = imax(k.all_lo, lo[r] - t0);
    k.all_hi = imin(k.all_hi, hi[r] - t0);
    k.any_lo = imin(k.any_lo, lo[r] - t0);
    k.any_hi = imax(k.any_hi, hi[r] - t0);
  }
  k.any_lo = imax(k.any_lo, 0);
  k.any_hi = imin(k.any_hi, n);
  if (k.all_hi <= k.all_lo) k.all_lo = k.all_hi = k.any_hi;
  return k;
}

// The lazy running max of row i over one chunk (kDirectRescaleSlack): when some logit exceeds
// m + slack (`exceeds`; always so for the first visible chunk, m = -inf), m becomes the chunk's
// max (chunk_max(), evaluated only then) and alpha = e^{m_old - m_new}; otherwise m is kept and
// alpha = 1 (exact: O and l stay relative to the same m). alpha is also 1 while m_old = -inf (O and
// l are still 0). Stores m and alpha; sets *rescale when O must be rescaled. NaN logits: the
// compare behind `exceeds` is false for NaN and chunk_max() may drop one, so m can stay -inf
// over a chunk whose only visible logits are NaN; the kernels' "nothing visible yet" branch
// checks the chunk for NaN and makes m NaN then (the row NaN, as REFERENCE). Once m is finite a
// NaN logit gives P = e^{NaN - m} = NaN; once m is NaN it stays NaN (`exceeds` false).
template <class ChunkMax>
inline float direct_lazy_max(const ItemContext& c, int i, bool exceeds, ChunkMax&& chunk_max,
                             bool* rescale) {
  const float m_old = c.m[i];
  float alpha = 1.f;
  if (exceeds) {
    const float m_new = chunk_max();
    if (m_old != kNegInf) {
      alpha = std::exp(m_old - m_new);
      *rescale = true;
    }
    c.m[i] = m_new;
  }
  c.alpha[i] = alpha;
  return alpha;
}

// Runs one item that direct_decode_shape_applies() and the Kernel's own conditions accept.
template <class Kernel>
inline void run_direct_decode(const AttentionArgs& a, const WorkItem& it, char* scratch) {
  ItemContext c = make_item_context(a, it, scratch);
  Kernel::setup(c);
  float* lsum = c.s;                      // (rows, 16) lane sums of l
  float* red = static_cast<float*>(c.k);  // Q·Kᵀ partial sums
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
  const int64_t eb = static_cast<int64_t>(elem_bytes(kv.dtype));
  const int64_t k_token = kv.k_token_stride * eb, k_head = kv.k_head_stride * eb;
  const int64_t k_block = kv.k_block_stride * eb;
  const int64_t v_token = kv.v_token_stride * eb, v_head = kv.v_head_stride * eb;
  const int64_t v_block = kv.v_block_stride * eb;
  const char* k_base = static_cast<const char*>(kv.key) + it.kv_head * k_head;
  const char* v_base = static_cast<const char*>(kv.value) + it.kv_head * v_head;
  const int32_t* blocks =
      kv.block_table + static_cast<int64_t>(it.req_begin) * kv.block_table_stride;
  const int bs = kv.block_size;
  const int64_t row_bytes = static_cast<int64_t>(c.head_size) * eb;
  // Bytes between the L2-prefetch shares of consecutive heads (see DirectPrefetch).
  const int64_t k_share = k_token > k_head ? kDirectChunk * row_bytes : k_head;
  const int64_t v_share = v_token > v_head ? kDirectChunk * row_bytes : v_head;
  auto chunk_k = [&](int t0) {
    return k_base + static_cast<int64_t>(blocks[t0 / bs]) * k_block + (t0 % bs) * k_token;
  };
  auto chunk_v = [&](int t0) {
    return v_base + static_cast<int64_t>(blocks[t0 / bs]) * v_block + (t0 % bs) * v_token;
  };
  // Per KV head: the logit scale (scale * k_scale; fp8 caches may scale per head).
  const float key_factor = Kernel::key_factor(a);
  // Whether the kernel walks each chunk key-major over all heads (Kernel::chunk_major; the AVX2
  // kernel on NHD caches, where that reads the chunk front to back) instead of head by head.
  bool chunk_major = false;
  if constexpr (requires { Kernel::kHasChunkMajor; }) {
    chunk_major = Kernel::takes_chunk_major(c, rows_per_head, k_token, k_head, v_token, v_head);
  }

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
    pf.row_bytes = row_bytes;
    for (int t0 = first; t0 < end; t0 += kDirectChunk) {
      const int live = imin(kDirectChunk, end - t0);
      const char* k = chunk_k(t0);
      const char* v = chunk_v(t0);
      const int ahead = t0 + kDirectPrefetchChunks * kDirectChunk;
      const char* k_ahead = ahead < end ? chunk_k(ahead) : k;  // nothing left: refetch this one
      const char* v_ahead = ahead < end ? chunk_v(ahead) : v;
      const char* k_next = t0 + kDirectChunk < end ? chunk_k(t0 + kDirectChunk) : k;
      if constexpr (requires { Kernel::kHasChunkMajor; }) {
        // The kernel's key-major step over all heads of the chunk, where it takes this item.
        if (chunk_major) {
          Kernel::chunk_major(c, lsum, red, heads, rows_per_head, k, k_token, k_head, v, v_token,
                              v_head, t0, live, key_factor, k_ahead, v_ahead);
          continue;
        }
      }
      for (int b = 0; b < heads; ++b) {
        pf.l2_k = k_ahead + b * k_share;
        pf.l2_v = v_ahead + b * v_share;
        pf.l1_v = v + b * v_head;
        pf.l1_k = b + 1 < heads ? k + (b + 1) * k_head : k_next;
        c.logit_scale = a.scale * kv_key_scale(a, it.kv_head + b) * key_factor;
        if (live == kDirectChunk) {
          Kernel::template head_chunk<true>(c, lsum, red, b * rows_per_head, rows_per_head,
                                            k + b * k_head, k_token, v + b * v_head, v_token, t0,
                                            live, pf);
        } else {  // the last chunk of the keys: dead rows are not read
          Kernel::template head_chunk<false>(c, lsum, red, b * rows_per_head, rows_per_head,
                                             k + b * k_head, k_token, v + b * v_head, v_token, t0,
                                             live, pf);
        }
      }
    }
  }

  // Finalize: O in dimension order, l from its lane sums, the fp8 value scale of its head.
  const int dv = c.head_size_v;
  const float value_factor = Kernel::value_factor(a);
  for (int row = 0; row < c.rows; ++row) {
    Kernel::unpermute(a, c.o + static_cast<size_t>(row) * dv, c.temp, dv);
    const float l = Kernel::lane_sum(lsum + static_cast<size_t>(row) * kDirectChunk);
    const int block = row / rows_per_head, local = row % rows_per_head;
    const int kv_head = it.kv_head + block;
    finalize_row(a, c.temp, c.m[row], l, it.tok_begin + local / G, kv_head * G + local % G,
                 kv_value_scale(a, kv_head) * value_factor);
  }
}

}  // namespace
}  // namespace pagedattn::cpu
