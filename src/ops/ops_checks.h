// Argument checks shared by the ops (src/ops/*.cpp). Every message starts with the op name and
// names the argument, its value and what was expected; Error::argument() is the argument name.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pagedattn/error.h"
#include "pagedattn/tensor.h"

namespace pagedattn::ops_detail {

// `t` is defined and has `ndim` dimensions; `layout` describes them, e.g. "(T, H, D)".
inline void check_rank(std::string_view op, const TensorView& t, std::string_view argument,
                       int ndim, std::string_view layout) {
  PAGEDATTN_CHECK(t.defined(), std::string(argument), op, ": ", argument, " is required: expected ",
                  ndim, "-D ", layout);
  PAGEDATTN_CHECK(t.ndim() == ndim, std::string(argument), op, ": ", argument, " has shape ",
                  t.shape().str(), ", expected ", ndim, "-D ", layout);
}

// Activations: f32, f16 or bf16.
inline void check_activation_dtype(std::string_view op, const TensorView& t,
                                   std::string_view argument) {
  const DType dt = t.dtype();
  PAGEDATTN_CHECK(dt == DType::f32 || dt == DType::f16 || dt == DType::bf16, std::string(argument),
                  op, ": ", argument, " is ", dtype_name(dt),
                  ", expected float32, float16 or bfloat16");
}

inline void check_same_device(std::string_view op, const TensorView& t, std::string_view argument,
                              Device device, int device_index) {
  PAGEDATTN_CHECK(t.device() == device && t.device_index() == device_index, std::string(argument),
                  op, ": ", argument, " is on ", device_name(t.device()), ":", t.device_index(),
                  ", expected ", device_name(device), ":", device_index,
                  " (all tensors on one device)");
}

// slot_mapping: defined, int64, 1-D, at most n entries (`holders` names what holds the n tokens,
// e.g. "key/value hold"). Returns its length (the tokens written).
inline int64_t check_slot_mapping(std::string_view op, const TensorView& slot_mapping, int64_t n,
                                  std::string_view holders) {
  PAGEDATTN_CHECK(slot_mapping.defined(), "slot_mapping", op,
                  ": slot_mapping is required (int64 (num_tokens,))");
  PAGEDATTN_CHECK(slot_mapping.dtype() == DType::i64, "slot_mapping", op, ": slot_mapping is ",
                  dtype_name(slot_mapping.dtype()), ", expected int64");
  PAGEDATTN_CHECK(slot_mapping.ndim() == 1, "slot_mapping", op, ": slot_mapping has shape ",
                  slot_mapping.shape().str(), ", expected 1-D (num_tokens,)");
  const int64_t num_tokens = slot_mapping.size(0);
  PAGEDATTN_CHECK(num_tokens <= n, "slot_mapping", op, ": slot_mapping has ", num_tokens,
                  " entries but ", holders, " only ", n, " tokens (expected length <= ", n, ")");
  return num_tokens;
}

}  // namespace pagedattn::ops_detail
