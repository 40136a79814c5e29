// Pre-quantized query input (supports_quant_query_input; vLLM's query_quant): an fp8_e4m3 query
// holding q / q_scale over an fp8 cache. Its values are checked by the conformance grid and the
// REFERENCE oracle (Feature::quant_query, "quant_query_soft_cap_alibi"); here: which impls accept
// it, and that every rejected call (a backend without it, a 16-bit cache, a bad q_scale) names
// its argument and leaves the KV cache byte-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "conformance/harness.h"
#include "pagedattn/selector.h"

namespace pagedattn::conformance {
namespace {

ConformanceCase quant_case(const std::string& kv_cache_dtype) {
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.kv_cache_dtype = kv_cache_dtype;
  c.head_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.batch = {{20, 1}, {0, 5}, {9, 3}};
  return c;
}

std::vector<uint8_t> cache_bytes(const PreparedRun& run) {
  const Tensor host = run.kv_cache.to(Device::cpu);
  const auto* p = static_cast<const uint8_t*>(host.data());
  return {p, p + host.nbytes()};
}

// The layer's forward throws an Error naming `argument`, and the cache is unchanged.
void expect_rejected(PreparedRun& run, const std::string& argument, const std::string& what) {
  const std::vector<uint8_t> before = cache_bytes(run);
  try {
    execute(run);
    ADD_FAILURE() << what << ": expected an Error naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << what << ": " << e.what();
  }
  EXPECT_TRUE(before == cache_bytes(run)) << what << ": a rejected call changed the KV cache";
}

TEST(QuantQueryInput, ImplsThatAcceptIt) {
  for (const char* kv : {"auto", "fp8_e4m3", "fp8_e5m2"}) {
    const CaseInputs in = make_inputs(quant_case(kv), 1);
    const bool fp8 = std::string(kv) != "auto";
    PreparedRun ref = prepare_run(reference(), Device::cpu, in);
    EXPECT_EQ(ref.impl().supports_quant_query_input(), fp8) << kv;
    PreparedRun cpu = prepare_run(*find_backend("CPU"), Device::cpu, in);
    EXPECT_FALSE(cpu.impl().supports_quant_query_input()) << kv;
  }
}

TEST(QuantQueryInput, RejectedCallsLeaveTheCacheUntouched) {
  ConformanceCase c = quant_case("fp8_e4m3");
  c.quant_query = true;
  const CaseInputs in = make_inputs(c, 2);
  ASSERT_EQ(in.query.dtype(), DType::fp8_e4m3);
  {  // CPU has no quantized-query path
    PreparedRun run = prepare_run(*find_backend("CPU"), Device::cpu, in);
    expect_rejected(run, "query", "CPU, e4m3 query");
  }
  {  // REFERENCE with a 16-bit cache
    ConformanceCase plain = quant_case("auto");
    const CaseInputs bf16 = make_inputs(plain, 3);
    PreparedRun run = prepare_run(reference(), Device::cpu, bf16);
    run.query = in.query.to(Device::cpu);  // the same token count and heads, e4m3
    expect_rejected(run, "query", "REFERENCE, 16-bit cache, e4m3 query");
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float bad : {0.f, -0.5f, nan, std::numeric_limits<float>::infinity()}) {
    PreparedRun run = prepare_run(reference(), Device::cpu, in);
    run.scales().q_scale = bad;
    expect_rejected(run, "scales.q_scale", "REFERENCE, q_scale = " + std::to_string(bad));
  }
  // Control: the same call with the case's q_scale runs and writes the cache.
  PreparedRun run = prepare_run(reference(), Device::cpu, in);
  const std::vector<uint8_t> before = cache_bytes(run);
  EXPECT_NO_THROW(execute(run));
  EXPECT_FALSE(before == cache_bytes(run));
}

// q8 with q_scale attends exactly as the f32 query q8 * q_scale does (REFERENCE, f32 layer).
TEST(QuantQueryInput, EqualsTheDequantizedQuery) {
  ConformanceCase c = quant_case("fp8_e4m3");
  c.dtype = DType::f32;
  c.quant_query = true;
  c.return_lse = true;
  const CaseInputs in = make_inputs(c, 4);
  const BackendOutputs quant = run_backend(reference(), Device::cpu, in);
  CaseInputs deq = make_inputs(c, 4);  // the same inputs; the query replaced below
  deq.c.quant_query = false;
  deq.q_scale = 1.f;
  deq.query = Tensor(in.query.shape(), DType::f32, Device::cpu);
  for (int64_t i = 0; i < deq.query.numel(); ++i) {
    store_f32(deq.query.data(), DType::f32, i, load_f32(in.query.data(), DType::fp8_e4m3, i) * in.q_scale);
  }
  const BackendOutputs plain = run_backend(reference(), Device::cpu, deq);
  const ConformanceResult r = compare(in, quant, plain);
  EXPECT_LE(r.output_rel_error, 1e-6) << r.describe();
  EXPECT_LE(r.lse_rel_error, 1e-6) << r.describe();
  EXPECT_TRUE(r.all_written) << r.describe();
}

}  // namespace
}  // namespace pagedattn::conformance
