// A rejected forward leaves the KV cache byte-identical on CUDA and CUDA_MLA: the same cases as
// the host backends (tests/conformance/rejected_calls.cpp), with the block ids and slots checked
// at plan time on the host mirrors and against the cache in O(1) before the first launch.
#include <gtest/gtest.h>

#include "conformance/rejected_calls.h"
#include "gpu_test_util.h"

namespace pagedattn::testing {
namespace {

TEST(CudaRejectedCalls, CudaLeavesCacheUntouched) {
  PAGEDATTN_REQUIRE_GPU();
  expect_rejected_forwards_leave_cache_untouched("CUDA", Device::cuda);
}

TEST(CudaRejectedCalls, CudaMlaLeavesCacheUntouched) {
  PAGEDATTN_REQUIRE_GPU();
  expect_rejected_mla_forwards_leave_cache_untouched("CUDA_MLA", Device::cuda);
}

}  // namespace
}  // namespace pagedattn::testing
