// The backend registry: every backend, highest priority first (oneDNN-style ordered list, the
// reference last). Adding a backend = its folder under src/backends/<name>/ exposing
// `const AttentionBackend& <name>_backend();` in <name>/<name>_backend.h, plus ONE line in
// kBackendTable below (and its include). CUDA backends go under PAGEDATTN_HAS_CUDA.
#include <cctype>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/selector.h"

// One include per backend (CUDA ones under #if PAGEDATTN_HAS_CUDA).
#if PAGEDATTN_HAS_CUDA
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/mla_cuda_backend.h"
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
    &reference_backend,  // fp64 oracle, every feature: always last
    &reference_mla_backend,  // MLA fp64 oracle (use_mla = true only): last of the MLA backends
};

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::vector<const AttentionBackend*> build_registry() {
  std::vector<const AttentionBackend*> backends;
  for (const BackendAccessor accessor : kBackendTable) {
    const AttentionBackend* backend = &accessor();
    for (const AttentionBackend* other : backends) {
      PAGEDATTN_CHECK(!equal_ignoring_case(other->name(), backend->name()), "backend",
                      "backend registry: two backends are named \"", backend->name(),
                      "\" (names are case-insensitive and must be unique)");
    }
    backends.push_back(backend);
  }
  return backends;
}

}  // namespace

const std::vector<const AttentionBackend*>& registered_backends() {
  static const std::vector<const AttentionBackend*> backends = build_registry();
  return backends;
}

const AttentionBackend* find_backend(std::string_view name) {
  for (const AttentionBackend* backend : registered_backends()) {
    if (equal_ignoring_case(backend->name(), name)) return backend;
  }
  return nullptr;
}

}  // namespace pagedattn
