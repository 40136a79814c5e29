// Padding requests (query_len 0) in MLA batches are no-ops on the host MLA backends: the step with
// them computes the same bytes (output and LSE) as the step without them, wherever they sit
// (tests/conformance/mla_padding.h), and the plan leaves them out of both parts.
#include <gtest/gtest.h>

#include "conformance/mla_padding.h"

namespace pagedattn {
namespace {

namespace mp = conformance::mla_padding;

void expect_padding_is_a_no_op(const char* backend, DType dtype) {
  const auto batches = mp::padded_batches();
  for (size_t b = 0; b < batches.size(); ++b) {
    int decodes = 0, prefills = 0;
    for (const mp::Request& r : batches[b]) {
      decodes += r.query_len == 1;
      prefills += r.query_len > 1;
    }
    const mp::Outputs padded = mp::run_step(backend, Device::cpu, dtype, batches[b], false, 100 + b);
    const mp::Outputs plain = mp::run_step(backend, Device::cpu, dtype, batches[b], true, 100 + b);
    EXPECT_EQ(padded.num_decodes, decodes) << backend << " batch " << b;
    EXPECT_EQ(padded.num_prefills, prefills) << backend << " batch " << b;
    EXPECT_FALSE(padded.output.empty());
    EXPECT_EQ(padded.output, plain.output) << backend << " batch " << b;
    EXPECT_EQ(padded.lse, plain.lse) << backend << " batch " << b;
  }
}

TEST(MlaPadding, CpuMlaComputesTheBatchWithoutThePadding) {
  expect_padding_is_a_no_op("CPU_MLA", DType::bf16);
  expect_padding_is_a_no_op("CPU_MLA", DType::f32);
}

TEST(MlaPadding, ReferenceMlaComputesTheBatchWithoutThePadding) {
  expect_padding_is_a_no_op("REFERENCE_MLA", DType::f32);
}

}  // namespace
}  // namespace pagedattn
