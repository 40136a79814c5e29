// Where the K/V rows of a key are (paged cache or the current tokens) and whether a row holds a
// NaN or an infinity: shared by the tile kernel (cpu_attention_tile.h) and the direct decode
// kernels (cpu_decode_direct.h). Internal linkage only, as everything the ISA translation units
// include (see cpu_kernels.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace pagedattn::cpu {
namespace {

inline size_t elem_bytes(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    default: return 1;
  }
}

// Address of key `key` (position within request `req`) of KV head `kv_head` in the K
// (value=false) or V source.
inline const char* kv_row_of(const AttentionArgs& a, int kv_head, bool value, int req, int key) {
  const KvSource& kv = a.kv;
  const char* base = static_cast<const char*>(value ? kv.value : kv.key);
  const int64_t token_stride = value ? kv.v_token_stride : kv.k_token_stride;
  const int64_t head_stride = value ? kv.v_head_stride : kv.k_head_stride;
  int64_t offset;
  if (kv.paged) {
    const int64_t block = kv.block_table[req * kv.block_table_stride + key / kv.block_size];
    const int64_t block_stride = value ? kv.v_block_stride : kv.k_block_stride;
    offset = block * block_stride + (key % kv.block_size) * token_stride;
  } else {
    const int32_t* starts = kv.key_start_loc != nullptr ? kv.key_start_loc : a.query_start_loc;
    offset = (static_cast<int64_t>(starts[req]) + key) * token_stride;
  }
  offset += static_cast<int64_t>(kv_head) * head_stride;
  return base + offset * static_cast<int64_t>(elem_bytes(kv.dtype));
}

// Whether one of the n elements of `row` is NaN or infinite: all exponent bits set (fp8 e4m3 has
// no infinities; its NaN S.1111.111 is the only code with those bits all set).
// The loops count hits (an add reduction, which the compiler vectorizes; a bool |= is left scalar).
inline bool row_has_non_finite(const char* row, DType dtype, int n) {
  unsigned bad = 0;
  switch (dtype) {
    case DType::f32: {
      for (int d = 0; d < n; ++d) {
        uint32_t x;
        std::memcpy(&x, row + 4 * d, 4);
        bad += (x & 0x7F800000u) == 0x7F800000u;
      }
      break;
    }
    case DType::f16:
    case DType::bf16: {
      const uint16_t mask = dtype == DType::f16 ? 0x7C00 : 0x7F80;
      for (int d = 0; d < n; ++d) {
        uint16_t x;
        std::memcpy(&x, row + 2 * d, 2);
        bad += (x & mask) == mask;
      }
      break;
    }
    default: {
      const uint8_t mask = dtype == DType::fp8_e5m2 ? 0x7C : 0x7F;
      for (int d = 0; d < n; ++d) {
        const uint8_t x = static_cast<uint8_t>(row[d]);
        bad += (x & mask) == mask;
      }
      break;
    }
  }
  return bad != 0;
}

// Whether the V row of a key in [k0, k1) of request `req` holds a NaN or an infinity, for KV heads
// [kv_head, kv_head + heads). The P·V products give such a row 0 * NaN = NaN in every row whose P
// is 0 for it, so keys that some rows cannot see are checked before they share a V tile.
inline bool values_non_finite(const AttentionArgs& a, int req, int kv_head, int heads, int k0,
                              int k1) {
  for (int key = k0; key < k1; ++key) {
    for (int h = kv_head; h < kv_head + heads; ++h) {
      if (row_has_non_finite(kv_row_of(a, h, true, req, key), a.kv.dtype, a.head_size_v)) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace
}  // namespace pagedattn::cpu
