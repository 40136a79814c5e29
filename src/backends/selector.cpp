// Backend selection (vLLM get_attn_backend) with reasons: every registered backend is asked
// validate_configuration in priority order; the first with no reasons wins. A forced name
// (argument, or env PAGEDATTN_BACKEND read at each call) picks one backend or fails with its
// reasons; when nothing fits the error lists every backend with every reason.
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/selector.h"
#include "backends/ordered_registry.h"

namespace pagedattn {
namespace {

// "(head_size=72, dtype=bfloat16, kv_cache_dtype=auto, block_size=16, attn_type=decoder,
// device=cpu)" plus every feature that is switched on.
std::string describe_config(const SelectorConfig& c) {
  std::ostringstream os;
  os << "(head_size=" << c.head_size;
  if (c.head_size_v > 0 && c.head_size_v != c.head_size) os << ", head_size_v=" << c.head_size_v;
  os << ", dtype=" << dtype_name(c.dtype) << ", kv_cache_dtype=" << c.kv_cache_dtype
     << ", block_size=" << c.block_size << ", attn_type=" << attention_type_name(c.attn_type)
     << ", device=" << device_name(c.device);
  if (c.use_mla) os << ", use_mla=true";
  if (c.has_sink) os << ", has_sink=true";
  if (c.use_sparse) os << ", use_sparse=true";
  if (c.use_alibi) os << ", alibi=true";
  if (c.use_sliding_window) os << ", sliding_window=true";
  if (c.use_logits_soft_cap) os << ", logits_soft_cap=true";
  if (c.fp8_output) os << ", fp8_output=true";
  os << ")";
  return os.str();
}

// The configuration itself must make sense before backends are asked about it.
void validate_selector_config(const SelectorConfig& c) {
  PAGEDATTN_CHECK(c.head_size > 0, "head_size", "get_attn_backend: head_size = ", c.head_size,
                  " must be > 0");
  PAGEDATTN_CHECK(c.head_size_v >= 0, "head_size_v", "get_attn_backend: head_size_v = ",
                  c.head_size_v, " must be >= 0 (0 = head_size)");
  PAGEDATTN_CHECK(c.block_size > 0, "block_size", "get_attn_backend: block_size = ", c.block_size,
                  " must be > 0");
  validate_kv_cache_dtype(c.kv_cache_dtype);
}

// A backend's reasons; an Error thrown by validate_configuration becomes a reason too.
std::vector<std::string> reasons_of(const AttentionBackend& backend, const SelectorConfig& c) {
  try {
    return backend.validate_configuration(c);
  } catch (const Error& e) {
    return {std::string("validate_configuration failed: ") + e.what()};
  }
}

}  // namespace

std::vector<BackendReport> explain_backends(const SelectorConfig& config) {
  validate_selector_config(config);
  std::vector<BackendReport> reports;
  for (const AttentionBackend* backend : registered_backends()) {
    reports.push_back(BackendReport{backend, reasons_of(*backend, config)});
  }
  return reports;
}

const AttentionBackend& get_attn_backend(const SelectorConfig& config, std::string_view forced) {
  validate_selector_config(config);
  return detail::select_from_registry(
      registered_backends(), forced, describe_config(config),
      [&config](const AttentionBackend& backend) { return reasons_of(backend, config); },
      detail::attention_backend_registry_words);
}

const AttentionBackend& get_attn_backend(int head_size, DType dtype,
                                         std::string_view kv_cache_dtype, int block_size,
                                         bool use_mla, bool has_sink, bool use_sparse,
                                         AttentionType attn_type, Device device) {
  SelectorConfig config;
  config.head_size = head_size;
  config.dtype = dtype;
  // vLLM passes kv_cache_dtype=None for "auto".
  config.kv_cache_dtype = kv_cache_dtype.empty() ? std::string("auto") : std::string(kv_cache_dtype);
  config.block_size = block_size;
  config.use_mla = use_mla;
  config.has_sink = has_sink;
  config.use_sparse = use_sparse;
  config.attn_type = attn_type;
  config.device = device;
  return get_attn_backend(config);
}

}  // namespace pagedattn
