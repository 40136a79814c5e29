// ISA dispatch of the CPU backend: which kernel table runs, chosen once.
//   PAGEDATTN_CPU_ISA = scalar | avx2 | avx512f | avx512 | amx
//                                                forces a path (read on first use); a path the
//                                                CPU cannot run is an Error naming the variable.
//   otherwise                                    the best the CPU supports: amx (avx512 + AMX-TILE
//                                                + AMX-BF16, the tile state enabled by the OS and
//                                                granted to this process), avx512 (AVX512F/BW/DQ/VL
//                                                + AVX512_BF16), avx512f (AVX512F/BW/DQ/VL without
//                                                BF16), avx2 (AVX2 + FMA + F16C), scalar.
//   PAGEDATTN_CPU_DECODE_KERNEL = auto | tile | fma | dot
//                                                the direct decode kernel for head-fused decode
//                                                items where it applies (auto; fma / dot: in that
//                                                form on the avx512 and amx paths), or the tile
//                                                kernel for everything (tile); read on first use.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "backends/cpu/cpu_kernels.h"
#include "pagedattn/error.h"

namespace pagedattn::cpu {
namespace {

constexpr const char* kIsaEnv = "PAGEDATTN_CPU_ISA";
constexpr const char* kDecodeKernelEnv = "PAGEDATTN_CPU_DECODE_KERNEL";

std::atomic<int> g_decode_kernel_override{-1};
std::atomic<int> g_cpu_vendor_override{-1};
std::atomic<uint64_t> g_direct_decode_items{0};

std::atomic<int> g_isa_override{-1};
std::atomic<const KernelTable*> g_table_override{nullptr};

bool cpu_has_avx2() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  // F16C from CPUID.1:ECX bit 29: clang before 16 has no "f16c" in __builtin_cpu_supports.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && ((ecx >> 29) & 1u) != 0;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return false;
#endif
}

bool cpu_has_avx512f() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx512f() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-TILE + AMX-BF16 usable by this process: CPUID.(7,0):EDX bits 24 and 22; the OS saves the
// tile state (OSXSAVE, XCR0 bits 17 XTILECFG and 18 XTILEDATA); and, on Linux (5.16+), the
// kernel grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM with
// XFEATURE_XTILEDATA = 18; process-wide, requested once). Without that permission the first tile
// instruction would fault.
bool cpu_has_amx() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    defined(__linux__)
  static const bool usable = [] {
    if (!cpu_has_avx512()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    const bool amx_tile = (edx >> 24) & 1u, amx_bf16 = (edx >> 22) & 1u;
    if (!amx_tile || !amx_bf16) return false;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || ((ecx >> 27) & 1u) == 0) return false;
    uint32_t xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    const uint32_t tile_state = (1u << 17) | (1u << 18);
    if ((xcr0_lo & tile_state) != tile_state) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

const KernelTable* table_for(Isa isa) {
  switch (isa) {
    case Isa::amx: return amx_kernel_table();
    case Isa::avx512: return avx512_kernel_table();
    case Isa::avx512f: return avx512f_kernel_table();
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
    case Isa::amx: return "amx";
    case Isa::avx512: return "avx512";
    case Isa::avx512f: return "avx512f";
    case Isa::avx2: return "avx2";
    case Isa::scalar: return "scalar";
  }
  return "unknown";
}

Isa parse_isa(const char* name, const char* argument) {
  const std::string value = name == nullptr ? "" : name;
  if (value == "scalar") return Isa::scalar;
  if (value == "avx2") return Isa::avx2;
  if (value == "avx512f") return Isa::avx512f;
  if (value == "avx512") return Isa::avx512;
  if (value == "amx") return Isa::amx;
  throw Error(argument, detail::concat(argument, " = '", value,
                                       "' is not a CPU kernel path: expected scalar, avx2, "
                                       "avx512f, avx512 or amx"));
}

bool isa_supported(Isa isa) {
  if (table_for(isa) == nullptr) return false;
  switch (isa) {
    case Isa::amx: return cpu_has_amx();
    case Isa::avx512: return cpu_has_avx512();
    case Isa::avx512f: return cpu_has_avx512f();
    case Isa::avx2: return cpu_has_avx2();
    case Isa::scalar: return true;
  }
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::amx)) return Isa::amx;
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx512f)) return Isa::avx512f;
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

void set_kernel_table_override(const KernelTable* table) {
  if (table != nullptr) {
    const bool emulated = table == amx_emulated_kernel_table();
    const Isa needs = emulated ? Isa::avx512 : table->isa;
    PAGEDATTN_CHECK(isa_supported(needs), "table", "set_kernel_table_override: table = ",
                    table->name, " needs ", isa_name(needs),
                    ", which this CPU cannot run (or is not compiled in): it supports ",
                    isa_name(best_isa()), " at best");
  }
  g_table_override.store(table, std::memory_order_release);
}

const KernelTable& active_kernels() {
  if (const KernelTable* table = g_table_override.load(std::memory_order_acquire)) return *table;
  const int forced = g_isa_override.load(std::memory_order_acquire);
  if (forced >= 0) return *table_for(static_cast<Isa>(forced));
  return default_table();
}

DecodeKernel parse_decode_kernel(const char* name, const char* argument) {
  const std::string value = name == nullptr ? "" : name;
  if (value == "auto") return DecodeKernel::automatic;
  if (value == "tile") return DecodeKernel::tile;
  if (value == "fma") return DecodeKernel::fma;
  if (value == "dot") return DecodeKernel::dot;
  throw Error(argument, detail::concat(argument, " = '", value,
                                       "' is not a CPU decode kernel choice: expected auto, tile, fma or dot"));
}

DecodeKernel decode_kernel() {
  const int forced = g_decode_kernel_override.load(std::memory_order_acquire);
  if (forced >= 0) return static_cast<DecodeKernel>(forced);
  static const DecodeKernel choice = [] {
    const char* env = std::getenv(kDecodeKernelEnv);
    if (env == nullptr || env[0] == '\0') return DecodeKernel::automatic;
    return parse_decode_kernel(env, kDecodeKernelEnv);
  }();
  return choice;
}

void set_decode_kernel_override(DecodeKernel kernel) {
  g_decode_kernel_override.store(static_cast<int>(kernel), std::memory_order_release);
}

void clear_decode_kernel_override() { g_decode_kernel_override.store(-1, std::memory_order_release); }

uint64_t direct_decode_items_run() { return g_direct_decode_items.load(std::memory_order_relaxed); }

void count_direct_decode_item() { g_direct_decode_items.fetch_add(1, std::memory_order_relaxed); }

CpuVendor cpu_vendor() {
  const int forced = g_cpu_vendor_override.load(std::memory_order_acquire);
  if (forced >= 0) return static_cast<CpuVendor>(forced);
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  static const CpuVendor vendor = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return CpuVendor::other;
    char name[13] = {};
    std::memcpy(name, &ebx, 4);
    std::memcpy(name + 4, &edx, 4);
    std::memcpy(name + 8, &ecx, 4);
    if (std::strcmp(name, "GenuineIntel") == 0) return CpuVendor::intel;
    if (std::strcmp(name, "AuthenticAMD") == 0 || std::strcmp(name, "HygonGenuine") == 0) return CpuVendor::amd;
    return CpuVendor::other;
  }();
  return vendor;
#else
  return CpuVendor::other;
#endif
}

void set_cpu_vendor_override(CpuVendor vendor) {
  g_cpu_vendor_override.store(static_cast<int>(vendor), std::memory_order_release);
}

void clear_cpu_vendor_override() { g_cpu_vendor_override.store(-1, std::memory_order_release); }

}  // namespace pagedattn::cpu
