// Internal helpers of the metadata module: reading integer elements of host tensors (honouring
// strides) and the arithmetic vLLM's numpy code relies on (cdiv, Python floor division).
#pragma once

#include <cstdint>

#include "pagedattn/tensor.h"

namespace pagedattn::metadata_detail {

// Element i of a 1-D i32 host tensor. Callers check dtype/ndim/size/device first.
inline int32_t read_i32(const TensorView& t, int64_t i) {
  return t.data_as<const int32_t>()[i * t.stride(0)];
}

// Element i of a 1-D i64 host tensor.
inline int64_t read_i64(const TensorView& t, int64_t i) {
  return t.data_as<const int64_t>()[i * t.stride(0)];
}

// Element (r, c) of a 2-D i32 host tensor.
inline int32_t read_i32(const TensorView& t, int64_t r, int64_t c) {
  return t.data_as<const int32_t>()[r * t.stride(0) + c * t.stride(1)];
}

// ceil(a / b) for a >= 0, b > 0 (vLLM's cdiv on non-negative operands).
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Python's a // b (rounds toward -inf) for b > 0.
inline int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// Python's a % b for b > 0: the result lies in [0, b).
inline int64_t py_mod_pos(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}

// Python's a % (-b) for b > 0: the result lies in (-b, 0].
inline int64_t py_mod_neg(int64_t a, int64_t b) {
  const int64_t r = py_mod_pos(a, b);  // in [0, b)
  return r == 0 ? 0 : r - b;
}

}  // namespace pagedattn::metadata_detail
