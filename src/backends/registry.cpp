// The backend registry: every backend, highest priority first (oneDNN-style ordered list, the
// reference last). Adding a backend = its folder under src/backends/<name>/ exposing
// `const AttentionBackend& <name>_backend();` in <name>/<name>_backend.h, plus ONE line in
// kBackendTable below (and its include). CUDA backends go under PAGEDATTN_HAS_CUDA.
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/selector.h"
#include "backends/ordered_registry.h"

// One include per backend (CUDA ones under #if PAGEDATTN_HAS_CUDA).
#if PAGEDATTN_HAS_CUDA
#include "backends/cuda/attention/cuda_backend.h"
#include "backends/cuda/mla/mla_cuda_backend.h"
#endif
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_mla_backend.h"
#include "backends/reference/reference_backend.h"
#include "backends/reference/reference_mla.h"

namespace pagedattn {
namespace {

using BackendAccessor = const AttentionBackend& (*)();

// Highest priority first. One line per backend.
constexpr BackendAccessor kBackendTable[] = {
#if PAGEDATTN_HAS_CUDA
    &cuda_backend,       // Hopper paged attention, mixed prefill + decode in one launch
    &cuda_mla_backend,   // MLA latent decode (split-KV) + CUDA MLA prefill
#endif
    &cpu_backend,        // flash-style SIMD (AVX-512 / AVX2 / scalar) + OpenMP
    &cpu_mla_backend,    // MLA on the CPU kernels (latent MQA decode, up-projected prefill)
    &reference_backend,      // fp64 oracle of standard layers, every feature: last of those
    &reference_mla_backend,  // fp64 oracle of MLA layers (use_mla = true only): always last
};

std::string_view backend_name(const AttentionBackend& b) { return b.name(); }

}  // namespace

const detail::RegistryWords<AttentionBackend> detail::attention_backend_registry_words = {
    &backend_name, "backend registry", "backend", "attention backend", "backend",
    "PAGEDATTN_BACKEND", "get_attn_backend"};

const std::vector<const AttentionBackend*>& registered_backends() {
  static const std::vector<const AttentionBackend*> backends =
      detail::build_ordered_registry(kBackendTable, detail::attention_backend_registry_words);
  return backends;
}

const AttentionBackend* find_backend(std::string_view name) {
  return detail::find_in_registry(registered_backends(), name, detail::attention_backend_registry_words);
}

}  // namespace pagedattn
