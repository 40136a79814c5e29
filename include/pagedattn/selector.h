// Backend registry and selection (vLLM get_attn_backend), with reasons.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn {

// Registered backends, highest priority first (CUDA, CPU, ..., REFERENCE last). Static lifetime.
const std::vector<const AttentionBackend*>& registered_backends();
// nullptr when no backend has that name (case-insensitive).
const AttentionBackend* find_backend(std::string_view name);

struct BackendReport {
  const AttentionBackend* backend = nullptr;
  std::vector<std::string> reasons;  // empty = usable
  bool usable() const { return reasons.empty(); }
};
// Every registered backend, in priority order, with its validate_configuration reasons.
std::vector<BackendReport> explain_backends(const SelectorConfig& config);

// Walks the registry in priority order and returns the first backend with no reasons.
// `forced` (or env PAGEDATTN_BACKEND when forced is empty) names one backend: it is returned if
// usable, else an Error lists its reasons. When nothing fits the Error lists every backend with
// its reasons.
const AttentionBackend& get_attn_backend(const SelectorConfig& config, std::string_view forced = "");
const AttentionBackend& get_attn_backend(int head_size, DType dtype, std::string_view kv_cache_dtype,
                                         int block_size, bool use_mla = false, bool has_sink = false,
                                         bool use_sparse = false,
                                         AttentionType attn_type = AttentionType::decoder,
                                         Device device = Device::cpu);

}  // namespace pagedattn
