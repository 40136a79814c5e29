// Kernel-variant choice of the paged attention launches (attention_kernel_choice.h): the
// PAGEDATTN_CUDA_PREFILL_KERNEL switch, the test / benchmark override, and the sm_90a probe.
#include "backends/cuda/attention_kernel_choice.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "backends/cuda/kernel_launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

// -1: no override; else an AttentionKernelChoice / DecodeKernelChoice.
std::atomic<int> g_override{-1};
std::atomic<int> g_decode_override{-1};

// Built for sm_90a, the probe has no static shared memory; built for another target it has a
// marker array, which cudaFuncGetAttributes reports (the device then runs that other image).
__global__ void wgmma_image_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (out != nullptr) *out = 1;
#else
  __shared__ int not_sm90a_marker[32];
  reinterpret_cast<volatile int*>(not_sm90a_marker)[threadIdx.x & 31] = 0;
  if (out != nullptr) *out = not_sm90a_marker[0];
#endif
}

}  // namespace

AttentionKernelChoice parse_prefill_kernel_choice(const char* value) {
  if (value == nullptr || *value == '\0' || std::string_view(value) == "auto") return AttentionKernelChoice::automatic;
  PAGEDATTN_CHECK(std::string_view(value) == "mma", "PAGEDATTN_CUDA_PREFILL_KERNEL",
                  "PAGEDATTN_CUDA_PREFILL_KERNEL = \"", value,
                  "\" is not a prefill kernel choice: expected auto (wgmma for head sizes 64, 128 and 256 with "
                  "16-bit caches on sm_90a, mma.sync elsewhere) or mma (the mma.sync prefill path everywhere)");
  return AttentionKernelChoice::mma;
}

AttentionKernelChoice attention_kernel_choice() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<AttentionKernelChoice>(forced);
  // Read once; an invalid value throws at every call.
  static const std::string saved = [] {
    const char* env = std::getenv("PAGEDATTN_CUDA_PREFILL_KERNEL");
    return std::string(env != nullptr ? env : "");
  }();
  return parse_prefill_kernel_choice(saved.c_str());
}

void set_attention_kernel_choice(std::optional<AttentionKernelChoice> choice) {
  g_override.store(choice ? static_cast<int>(*choice) : -1, std::memory_order_relaxed);
}

DecodeKernelChoice parse_decode_kernel_choice(const char* value) {
  if (value == nullptr || *value == '\0' || std::string_view(value) == "auto") return DecodeKernelChoice::automatic;
  if (std::string_view(value) == "decode") return DecodeKernelChoice::decode;
  PAGEDATTN_CHECK(std::string_view(value) == "unified", "PAGEDATTN_CUDA_DECODE_KERNEL",
                  "PAGEDATTN_CUDA_DECODE_KERNEL = \"", value,
                  "\" is not a decode kernel choice: expected auto (the decode-only kernel for batches of decodes, "
                  "head sizes <= 128, but for the smallest), decode (for every batch of decodes) or unified (the "
                  "paged attention kernel for every batch)");
  return DecodeKernelChoice::unified;
}

DecodeKernelChoice decode_kernel_choice() {
  const int forced = g_decode_override.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<DecodeKernelChoice>(forced);
  static const std::string saved = [] {
    const char* env = std::getenv("PAGEDATTN_CUDA_DECODE_KERNEL");
    return std::string(env != nullptr ? env : "");
  }();
  return parse_decode_kernel_choice(saved.c_str());
}

void set_decode_kernel_choice(std::optional<DecodeKernelChoice> choice) {
  g_decode_override.store(choice ? static_cast<int>(*choice) : -1, std::memory_order_relaxed);
}

bool wgmma_kernels_available() {
  static std::atomic<uint64_t> known{0}, available{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((known.load() & bit) == 0) {
    cudaFuncAttributes attributes{};
    const bool ok = cudaFuncGetAttributes(&attributes, wgmma_image_probe_kernel) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    if (ok && attributes.sharedSizeBytes == 0) available.fetch_or(bit);
    known.fetch_or(bit);
  }
  return (available.load() & bit) != 0;
}

const char* kernel_variant_name(int variant) {
  switch (variant) {
    case kVariantMma: return "mma";
    case kVariantWgmma: return "wgmma";
    default: return "unknown";
  }
}

}  // namespace pagedattn::cuda
