// Kernel-variant choice of the paged attention launches (attention_kernel_choice.h): the
// PAGEDATTN_CUDA_PREFILL_KERNEL switch and the test / benchmark override.
#include "backends/cuda/attention/attention_kernel_choice.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

// -1: no override; else an AttentionKernelChoice / DecodeKernelChoice.
std::atomic<int> g_override{-1};
std::atomic<int> g_decode_override{-1};

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

const char* kernel_variant_name(int variant) {
  switch (variant) {
    case kVariantMma: return "mma";
    case kVariantWgmma: return "wgmma";
    case kVariantWs: return "ws";
    default: return "unknown";
  }
}

}  // namespace pagedattn::cuda
