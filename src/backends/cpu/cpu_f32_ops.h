// The f32 compute Ops of the tile algorithm (cpu_attention_tile.h) for every ISA: f32 / f16
// activations everywhere, and bf16 ones on the ISAs without a bf16 dot product. Generic over a
// Vec (cpu_avx512f_ops.h, cpu_avx2_ops.h, the scalar Vec1).
#pragma once

#include "cpu_attention_tile.h"

namespace pagedattn::cpu {
namespace {

// ---- f32 compute (every ISA) ---------------------------------------------------------------------
// Q tile (rows, D) f32; K pack [D][64] f32 (transposed); V pack [64][Dv] f32; P (rows, 64) f32.
// Vec supplies: W, kMR/kNC register blocking, load_f32<DT>(src, index) (W elements of dtype DT as
// f32), transpose16(dst, dst_stride, rows, ncols) for 32-bit elements.
template <class VecT>
struct F32Ops {
  using Vec = VecT;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
  static constexpr int kMR = Vec::kMR;
  static constexpr int kNC = Vec::kNC;

  template <DType DT>
  static void convert_row(float* dst, const char* src, int n) {
    for (int d = 0; d < n; d += W) Vec::store(dst + d, Vec::template load_f32<DT>(src, d));
  }

  static void convert_row_any(float* dst, const char* src, DType dtype, int n) {
    with_dtype(dtype, [&]<DType DT>() { convert_row<DT>(dst, src, n); });
  }

  static void pack_q_row(void* q, int row, const char* src, DType dtype, int head_size) {
    convert_row_any(static_cast<float*>(q) + static_cast<size_t>(row) * head_size, src, dtype,
                    head_size);
  }

  static void pack_k_chunk(void* k, int j0, const char* const rows[16], DType dtype, int head_size,
                           float* temp) {
    const char* src[16];
    if (dtype == DType::f32) {
      for (int i = 0; i < 16; ++i) src[i] = rows[i];
    } else {
      for (int i = 0; i < 16; ++i) {
        float* dst = temp + static_cast<size_t>(i) * head_size;
        if (rows[i] == reinterpret_cast<const char*>(kZeroRow)) {
          src[i] = rows[i];
        } else {
          convert_row_any(dst, rows[i], dtype, head_size);
          src[i] = reinterpret_cast<const char*>(dst);
        }
      }
    }
    Vec::transpose16(static_cast<uint32_t*>(k) + j0, kKeyTile, src, head_size);
  }

  static void pack_v_chunk(void* v, int j0, const char* const rows[16], DType dtype,
                           int head_size_v, float* /*temp*/) {
    float* dst = static_cast<float*>(v) + static_cast<size_t>(j0) * head_size_v;
    for (int i = 0; i < 16; ++i) {
      float* row = dst + static_cast<size_t>(i) * head_size_v;
      if (rows[i] == reinterpret_cast<const char*>(kZeroRow)) {
        std::memset(row, 0, head_size_v * sizeof(float));
      } else {
        convert_row_any(row, rows[i], dtype, head_size_v);
      }
    }
  }

  static V store_p(void* p, int row, int j, V e) {
    Vec::store(static_cast<float*>(p) + static_cast<size_t>(row) * kKeyTile + j, e);
    return e;
  }

  static void zero_p_row(void* p, int row) {
    std::memset(static_cast<float*>(p) + static_cast<size_t>(row) * kKeyTile, 0,
                kKeyTile * sizeof(float));
  }

  // S[i][c0*W .. (c0+NC)*W) for MR rows.
  template <int MR, int NC>
  static void qk_block(float* s, const float* q, int head_size, const float* kt, int c0) {
    V acc[MR][NC];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NC; ++c) acc[i][c] = Vec::zero();
    for (int d = 0; d < head_size; ++d) {
      V kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = Vec::load(kt + static_cast<size_t>(d) * kKeyTile + (c0 + c) * W);
      for (int i = 0; i < MR; ++i) {
        const V qb = Vec::set1(q[static_cast<size_t>(i) * head_size + d]);
        for (int c = 0; c < NC; ++c) acc[i][c] = Vec::fma(qb, kv[c], acc[i][c]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NC; ++c) Vec::store(s + static_cast<size_t>(i) * kKeyTile + (c0 + c) * W, acc[i][c]);
  }

  // Skips the column blocks (kNC vectors) that no row of a register block sees (TileKeys).
  static void qk(float* s, const void* q_tile, const void* k, int r0, int r1, int head_size,
                 const TileKeys& keys) {
    const float* q = static_cast<const float*>(q_tile);
    const float* kt = static_cast<const float*>(k);
    for (int c0 = 0; c0 < kKeyTile / W; c0 += kNC) {
      for_blocks<kMR>(r0, r1, [&](int i, auto mr) {
        int begin, end;
        keys.columns(i, decltype(mr)::value, begin, end);
        if (end <= c0 * W || begin >= (c0 + kNC) * W) return;
        qk_block<decltype(mr)::value, kNC>(s + static_cast<size_t>(i) * kKeyTile,
                                           q + static_cast<size_t>(i) * head_size, head_size, kt, c0);
      });
    }
  }

  // O[i][d0 .. d0 + NC*W) = alpha_i * O + P[i] . V for MR rows.
  template <int MR, int NC>
  static void pv_block(float* o, int head_size_v, const float* p, const float* v, const float* alpha,
                       int d0, int j_begin, int j_end) {
    V acc[MR][NC];
    for (int i = 0; i < MR; ++i) {
      const V va = Vec::set1(alpha[i]);
      for (int c = 0; c < NC; ++c)
        acc[i][c] = Vec::mul(va, Vec::load(o + static_cast<size_t>(i) * head_size_v + d0 + c * W));
    }
    for (int j = j_begin; j < j_end; ++j) {
      V vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = Vec::load(v + static_cast<size_t>(j) * head_size_v + d0 + c * W);
      for (int i = 0; i < MR; ++i) {
        const V pb = Vec::set1(p[static_cast<size_t>(i) * kKeyTile + j]);
        for (int c = 0; c < NC; ++c) acc[i][c] = Vec::fma(pb, vv[c], acc[i][c]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NC; ++c) Vec::store(o + static_cast<size_t>(i) * head_size_v + d0 + c * W, acc[i][c]);
  }

  template <int NC>
  static void pv_columns(float* o, const float* p, const float* v, const float* alpha, int r0,
                         int r1, int head_size_v, int d0, const TileKeys& keys) {
    for_blocks<kMR>(r0, r1, [&](int i, auto mr) {
      int begin, end;
      keys.columns(i, decltype(mr)::value, begin, end);
      if (end < begin) end = begin;  // no key: O = alpha * O only
      pv_block<decltype(mr)::value, NC>(o + static_cast<size_t>(i) * head_size_v, head_size_v,
                                        p + static_cast<size_t>(i) * kKeyTile, v, alpha + i, d0,
                                        begin, end);
    });
  }

  // Runs only the keys some row of a register block sees (TileKeys): the others have P = 0.
  static void pv(float* o, const void* p_tile, const void* v_tile, const float* alpha, int r0,
                 int r1, int head_size_v, const TileKeys& keys) {
    const float* p = static_cast<const float*>(p_tile);
    const float* v = static_cast<const float*>(v_tile);
    for_blocks<kNC>(0, head_size_v / W, [&](int c, auto nc) {
      pv_columns<decltype(nc)::value>(o, p, v, alpha, r0, r1, head_size_v, c * W, keys);
    });
  }
};

}  // namespace
}  // namespace pagedattn::cpu
