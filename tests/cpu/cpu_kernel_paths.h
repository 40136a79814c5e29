// The CPU kernel paths a parameterised test runs on: every ISA forced through the override, and
// the AMX kernels on the emulated tile unit (wherever avx512 runs, so machines without AMX still
// check the AMX tiling and layouts); a path this machine cannot run skips. Shared by the CPU tests
// that run a case on every path.
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "../../src/backends/cpu/cpu_kernels.h"

namespace pagedattn::cpu {

struct KernelPath {
  Isa isa;
  bool emulated_amx;
};

inline void PrintTo(const KernelPath& path, std::ostream* os) {
  *os << (path.emulated_amx ? "amx_emulated" : isa_name(path.isa));
}

// Test names: "avx2", "amx_emulated", ...
inline std::string kernel_path_name(const ::testing::TestParamInfo<KernelPath>& info) {
  return info.param.emulated_amx ? "amx_emulated" : isa_name(info.param.isa);
}

// Every path, for INSTANTIATE_TEST_SUITE_P(..., every_kernel_path(), kernel_path_name).
inline auto every_kernel_path() {
  return ::testing::Values(KernelPath{Isa::scalar, false}, KernelPath{Isa::avx2, false},
                           KernelPath{Isa::avx512f, false}, KernelPath{Isa::avx512, false},
                           KernelPath{Isa::amx, false}, KernelPath{Isa::amx, true});
}

// Forces the test's path for its duration (skips when this CPU cannot run it).
class KernelPathTest : public ::testing::TestWithParam<KernelPath> {
 protected:
  void SetUp() override {
    if (GetParam().emulated_amx) {
      const KernelTable* table = amx_emulated_kernel_table();
      if (table == nullptr || !isa_supported(Isa::avx512)) GTEST_SKIP() << "needs avx512";
      set_kernel_table_override(table);
      return;
    }
    if (!isa_supported(GetParam().isa)) GTEST_SKIP() << isa_name(GetParam().isa) << " is not available here";
    set_isa_override(GetParam().isa);
  }
  void TearDown() override {
    set_kernel_table_override(nullptr);
    clear_isa_override();
  }
};

}  // namespace pagedattn::cpu
