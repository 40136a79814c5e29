// ISA dispatch of the CPU backend: which kernel table runs, chosen once.
//   PAGEDATTN_CPU_ISA = scalar | avx2 | avx512   forces a path (read on first use); a path the CPU
//                                                cannot run is an Error naming the variable.
//   otherwise                                    the best the CPU supports: avx512 (needs
//                                                AVX512F/BW/DQ/VL + AVX512_BF16), avx2 (AVX2 + FMA
//                                                + F16C), scalar.
// AMX tiles are not used: no AMX path exists (it could not be validated on the development
// machine, which has none), see docs/perf/cpu.md.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backends/cpu/cpu_kernels.h"
#include "pagedattn/error.h"

namespace pagedattn::cpu {
namespace {

constexpr const char* kIsaEnv = "PAGEDATTN_CPU_ISA";

std::atomic<int> g_isa_override{-1};

bool cpu_has_avx2() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

const KernelTable* table_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return avx512_kernel_table();
    case Isa::avx2: return avx2_kernel_table();
    case Isa::scalar: return scalar_kernel_table();
  }
  return nullptr;
}

// The choice without override: env or best. Computed once (static local).
const KernelTable& default_table() {
  static const KernelTable* const table = [] {
    const char* env = std::getenv(kIsaEnv);
    if (env != nullptr && env[0] != '\0') {
      const Isa isa = parse_isa(env, kIsaEnv);
      PAGEDATTN_CHECK(isa_supported(isa), kIsaEnv, kIsaEnv, " = '", env,
                      "' cannot run on this CPU (or is not compiled in): it supports ",
                      isa_name(best_isa()), " at best");
      return table_for(isa);
    }
    return table_for(best_isa());
  }();
  return *table;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::scalar: return "scalar";
  }
  return "unknown";
}

Isa parse_isa(const char* name, const char* argument) {
  const std::string value = name == nullptr ? "" : name;
  if (value == "scalar") return Isa::scalar;
  if (value == "avx2") return Isa::avx2;
  if (value == "avx512") return Isa::avx512;
  throw Error(argument, detail::concat(argument, " = '", value,
                                       "' is not a CPU kernel path: expected scalar, avx2 or avx512"));
}

bool isa_supported(Isa isa) {
  if (table_for(isa) == nullptr) return false;
  switch (isa) {
    case Isa::avx512: return cpu_has_avx512();
    case Isa::avx2: return cpu_has_avx2();
    case Isa::scalar: return true;
  }
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

void set_isa_override(Isa isa) {
  PAGEDATTN_CHECK(isa_supported(isa), "isa", "set_isa_override: isa = ", isa_name(isa),
                  " cannot run on this CPU (or is not compiled in): it supports ",
                  isa_name(best_isa()), " at best");
  g_isa_override.store(static_cast<int>(isa), std::memory_order_release);
}

void clear_isa_override() { g_isa_override.store(-1, std::memory_order_release); }

const KernelTable& active_kernels() {
  const int forced = g_isa_override.load(std::memory_order_acquire);
  if (forced >= 0) return *table_for(static_cast<Isa>(forced));
  return default_table();
}

}  // namespace pagedattn::cpu
