// A rejected forward leaves the KV cache byte-identical on every host backend (the cases are in
// rejected_calls.cpp; tests/gpu runs the same cases on CUDA and CUDA_MLA).
#include <gtest/gtest.h>

#include "conformance/rejected_calls.h"

namespace pagedattn::testing {
namespace {

TEST(RejectedCalls, CpuLeavesCacheUntouched) {
  expect_rejected_forwards_leave_cache_untouched("CPU", Device::cpu);
}

TEST(RejectedCalls, ReferenceLeavesCacheUntouched) {
  expect_rejected_forwards_leave_cache_untouched("REFERENCE", Device::cpu);
}

TEST(RejectedCalls, CpuMlaLeavesCacheUntouched) {
  expect_rejected_mla_forwards_leave_cache_untouched("CPU_MLA", Device::cpu);
}

TEST(RejectedCalls, ReferenceMlaLeavesCacheUntouched) {
  expect_rejected_mla_forwards_leave_cache_untouched("REFERENCE_MLA", Device::cpu);
}

}  // namespace
}  // namespace pagedattn::testing
