// The case of a NaN-rule test (tests/cpu/test_cpu_decode_nan_logits.cpp,
// tests/gpu/test_cuda_nan_logits.cpp): a batch of requests at one head size, LSE returned, normal
// inputs, into which the test then writes its NaN elements.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace pagedattn::conformance {

inline ConformanceCase nan_rule_case(DType activations, const std::string& kv_cache_dtype, int head_size, int heads,
                                     int kv_heads, std::optional<int> sliding_window, std::vector<RequestShape> batch) {
  ConformanceCase c;
  c.dtype = activations;
  c.kv_cache_dtype = kv_cache_dtype;
  c.head_size = head_size;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.sliding_window = sliding_window;
  c.return_lse = true;
  c.distribution = Distribution::normal;
  c.batch = std::move(batch);
  return c;
}

}  // namespace pagedattn::conformance
