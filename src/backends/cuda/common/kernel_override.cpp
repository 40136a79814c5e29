// PAGEDATTN_CUDA_KERNEL: parser and the process-wide override (kernel_override.h).
#include "backends/cuda/common/kernel_override.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

constexpr const char* kGrammar =
    "a comma-separated list of prefill=auto|mma|wgmma|ws, decode=auto|decode|unified, mla=auto|mma "
    "(each key at most once; empty = all auto)";

template <class Choice>
struct ChoiceName {
  std::string_view name;
  Choice value;
};

// The choice spelled `value` among `names`; Error quoting the whole spec otherwise.
template <class Choice, size_t N>
Choice parse_value(std::string_view spec, std::string_view key, std::string_view value,
                   const ChoiceName<Choice> (&names)[N]) {
  for (const ChoiceName<Choice>& n : names) {
    if (value == n.name) return n.value;
  }
  throw Error(kKernelOverrideVariable,
              detail::concat(kKernelOverrideVariable, " = \"", spec, "\": \"", value, "\" is not a value of ", key,
                             ": expected ", kGrammar));
}

std::mutex& override_mutex() {
  static std::mutex m;
  return m;
}
std::optional<KernelOverride>& forced_override() {
  static std::optional<KernelOverride> forced;
  return forced;
}

}  // namespace

KernelOverride parse_kernel_override(std::string_view spec) {
  static constexpr ChoiceName<PrefillKernelChoice> kPrefill[] = {{"auto", PrefillKernelChoice::automatic},
                                                                 {"mma", PrefillKernelChoice::mma},
                                                                 {"wgmma", PrefillKernelChoice::wgmma},
                                                                 {"ws", PrefillKernelChoice::ws}};
  static constexpr ChoiceName<DecodeKernelChoice> kDecode[] = {{"auto", DecodeKernelChoice::automatic},
                                                               {"decode", DecodeKernelChoice::decode},
                                                               {"unified", DecodeKernelChoice::unified}};
  static constexpr ChoiceName<MlaDecodeKernelChoice> kMla[] = {{"auto", MlaDecodeKernelChoice::automatic},
                                                               {"mma", MlaDecodeKernelChoice::mma}};
  KernelOverride result;
  if (spec.empty()) return result;
  bool seen_prefill = false, seen_decode = false, seen_mla = false;
  for (size_t pos = 0; pos <= spec.size();) {
    const size_t end = std::min(spec.find(',', pos), spec.size());
    const std::string_view entry = spec.substr(pos, end - pos);
    pos = end + 1;
    const size_t eq = entry.find('=');
    const std::string_view key = eq == std::string_view::npos ? entry : entry.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view{} : entry.substr(eq + 1);
    bool* seen = key == "prefill" ? &seen_prefill : key == "decode" ? &seen_decode : key == "mla" ? &seen_mla : nullptr;
    PAGEDATTN_CHECK(seen != nullptr && eq != std::string_view::npos, kKernelOverrideVariable, kKernelOverrideVariable,
                    " = \"", spec, "\": \"", entry, "\" is not an entry: expected ", kGrammar);
    PAGEDATTN_CHECK(!*seen, kKernelOverrideVariable, kKernelOverrideVariable, " = \"", spec, "\" names ", key,
                    " twice: expected ", kGrammar);
    *seen = true;
    if (key == "prefill") {
      result.prefill = parse_value(spec, key, value, kPrefill);
    } else if (key == "decode") {
      result.decode = parse_value(spec, key, value, kDecode);
    } else {
      result.mla = parse_value(spec, key, value, kMla);
    }
  }
  return result;
}

KernelOverride kernel_override() {
  {
    const std::lock_guard<std::mutex> lock(override_mutex());
    if (forced_override()) return *forced_override();
  }
  static const std::string saved = [] {
    const char* env = std::getenv(kKernelOverrideVariable);
    return std::string(env != nullptr ? env : "");
  }();
  return parse_kernel_override(saved);
}

void set_kernel_override(std::optional<KernelOverride> choice) {
  const std::lock_guard<std::mutex> lock(override_mutex());
  forced_override() = choice;
}

}  // namespace pagedattn::cuda
