// Kernel-variant choice of the paged attention launches (attention_kernel_choice.h): the
// PAGEDATTN_CUDA_PREFILL_KERNEL switch, the test / benchmark override, and the sm_90a probe.
#include "backends/cuda/attention/attention_kernel_choice.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "backends/cuda/attention/kernel_launch.h"
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

// One value of an environment switch: its spelling and its enum value.
struct ChoiceName {
  const char* name;
  int value;
};

// The value named by `value` (nullptr or "" = the first entry, the default); Error naming
// `variable` and listing `expected` for anything else.
int parse_choice(const char* variable, const char* value, std::initializer_list<ChoiceName> names,
                 const char* expected) {
  if (value == nullptr || *value == '\0') return names.begin()->value;
  for (const ChoiceName& n : names) {
    if (std::string_view(value) == n.name) return n.value;
  }
  PAGEDATTN_CHECK(false, variable, variable, " = \"", value, "\" is not a valid choice: expected ", expected);
  return 0;
}

// The override when set (>= 0), else the environment variable, read once per Choice type (each
// type has one variable; an invalid value throws at every call).
template <class Choice>
Choice current_choice(const std::atomic<int>& forced, const char* variable, Choice (*parse)(const char*)) {
  const int f = forced.load(std::memory_order_relaxed);
  if (f >= 0) return static_cast<Choice>(f);
  static const std::string saved = [variable] {
    const char* env = std::getenv(variable);
    return std::string(env != nullptr ? env : "");
  }();
  return parse(saved.c_str());
}

template <class Choice>
void store_choice(std::atomic<int>& forced, std::optional<Choice> choice) {
  forced.store(choice ? static_cast<int>(*choice) : -1, std::memory_order_relaxed);
}

}  // namespace

AttentionKernelChoice parse_prefill_kernel_choice(const char* value) {
  return static_cast<AttentionKernelChoice>(parse_choice(
      "PAGEDATTN_CUDA_PREFILL_KERNEL", value,
      {{"auto", static_cast<int>(AttentionKernelChoice::automatic)},
       {"mma", static_cast<int>(AttentionKernelChoice::mma)},
       {"ws", static_cast<int>(AttentionKernelChoice::ws)},
       {"wgmma", static_cast<int>(AttentionKernelChoice::wgmma)}},
      "auto (with 16-bit caches on sm_90a: the warp-specialized kernel for head sizes 64 and 128, wgmma "
      "for 256; mma.sync elsewhere), mma (the mma.sync prefill path everywhere), wgmma (the one-warpgroup wgmma "
      "path for head sizes 64, 128 and 256, mma.sync elsewhere) or ws (the warp-specialized kernel for head "
      "sizes 64 and 128, auto elsewhere)"));
}

AttentionKernelChoice attention_kernel_choice() {
  return current_choice(g_override, "PAGEDATTN_CUDA_PREFILL_KERNEL", parse_prefill_kernel_choice);
}

void set_attention_kernel_choice(std::optional<AttentionKernelChoice> choice) { store_choice(g_override, choice); }

DecodeKernelChoice parse_decode_kernel_choice(const char* value) {
  return static_cast<DecodeKernelChoice>(parse_choice(
      "PAGEDATTN_CUDA_DECODE_KERNEL", value,
      {{"auto", static_cast<int>(DecodeKernelChoice::automatic)},
       {"decode", static_cast<int>(DecodeKernelChoice::decode)},
       {"unified", static_cast<int>(DecodeKernelChoice::unified)}},
      "auto (the decode-only kernel for batches of decodes, head sizes <= 128, but for the smallest and, where "
      "the warp-specialized kernel runs, the large), decode "
      "(for every batch of decodes) or unified (the paged attention kernel for every batch)"));
}

DecodeKernelChoice decode_kernel_choice() {
  return current_choice(g_decode_override, "PAGEDATTN_CUDA_DECODE_KERNEL", parse_decode_kernel_choice);
}

void set_decode_kernel_choice(std::optional<DecodeKernelChoice> choice) { store_choice(g_decode_override, choice); }

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
    case kVariantWs: return "ws";
    default: return "unknown";
  }
}

}  // namespace pagedattn::cuda
