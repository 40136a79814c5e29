// Batch-invariant mode on the host backends (CPU on every kernel path this machine runs,
// REFERENCE, CPU_MLA, REFERENCE_MLA): every request of a pool gives the same bits alone and in
// >= 50 random batches (sizes, orders, decode-only and mixed steps, 1 to 4 threads), through the
// shared harness (conformance/batch_invariance.h). Also: the default mode is NOT invariant on the
// same pools (so the check can fail), the environment variable and its bad values, and cascade
// off in the mode.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/batch_invariance.h"
#include "conformance/env_guard.h"
#include "conformance/harness.h"
#include "conformance/mla_harness.h"

namespace pagedattn::cpu {
namespace {

using conformance::EnvGuard;
using conformance::RequestShape;
using conformance::invariance::check_batch_invariance;
using conformance::invariance::InvarianceCase;
using conformance::invariance::InvarianceReport;

const AttentionBackend& backend_named(const char* name) {
  const AttentionBackend* backend = find_backend(name);
  if (backend == nullptr) throw Error("name", detail::concat(name, " is not registered"));
  return *backend;
}

// Decodes over short and long contexts (long ones are split-KV candidates in the default mode),
// a speculative decode, prefills longer than a q tile, a chunked prefill with context.
std::vector<RequestShape> standard_pool() {
  return {{2900, 1}, {1500, 1}, {700, 1}, {40, 1}, {0, 1}, {300, 3},
          {0, 150},  {600, 70}, {0, 33}, {2100, 1}};
}

InvarianceCase gqa_case() {
  InvarianceCase c;
  c.name = "gqa";
  c.dtype = DType::bf16;
  c.head_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.pool = standard_pool();
  c.num_sms = {2, 1, 3, 4};
  return c;
}

void expect_invariant(const AttentionBackend& backend, const InvarianceCase& c, uint64_t seed) {
  const InvarianceReport report = check_batch_invariance(backend, Device::cpu, c, seed);
  EXPECT_TRUE(report.invariant()) << backend.name() << " " << c.describe() << "\n" << report.describe();
  EXPECT_GE(report.min_appearances, c.compositions) << report.describe();
  EXPECT_GT(report.decode_only_batches, 0) << report.describe();
  EXPECT_GT(report.mixed_batches, 0) << report.describe();
}

struct KernelPath {
  Isa isa;
  bool emulated_amx;
};

void PrintTo(const KernelPath& path, std::ostream* os) {
  *os << (path.emulated_amx ? "amx_emulated" : isa_name(path.isa));
}

class CpuBatchInvariant : public ::testing::TestWithParam<KernelPath> {
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

TEST_P(CpuBatchInvariant, GqaBf16) { expect_invariant(cpu_backend(), gqa_case(), 11); }

TEST_P(CpuBatchInvariant, F32Fp8CacheManyKvHeads) {
  // Eight KV heads of group 1: decodes fuse all heads (the direct decode kernel where it runs),
  // prefill tiles do not; fp8 e4m3 cache.
  InvarianceCase c = gqa_case();
  c.name = "mha-fp8";
  c.dtype = DType::f32;
  c.kv_cache_dtype = "fp8_e4m3";
  c.num_heads = 8;
  c.num_kv_heads = 8;
  expect_invariant(cpu_backend(), c, 12);
}

TEST_P(CpuBatchInvariant, SlidingWindowF16Mqa) {
  InvarianceCase c = gqa_case();
  c.name = "mqa-window";
  c.dtype = DType::f16;
  c.num_heads = 16;
  c.num_kv_heads = 1;
  c.head_size = 128;
  c.block_size = 32;
  c.sliding_window = 500;
  expect_invariant(cpu_backend(), c, 13);
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuBatchInvariant,
                         ::testing::Values(KernelPath{Isa::scalar, false}, KernelPath{Isa::avx2, false},
                                           KernelPath{Isa::avx512f, false},
                                           KernelPath{Isa::avx512, false}, KernelPath{Isa::amx, false},
                                           KernelPath{Isa::amx, true}),
                         [](const ::testing::TestParamInfo<KernelPath>& info) {
                           return std::string(info.param.emulated_amx ? "amx_emulated"
                                                                      : isa_name(info.param.isa));
                         });

// The check finds what the default mode changes: split-KV follows the batch and the threads.
TEST(CpuBatchInvariantControl, DefaultModeDiffers) {
  InvarianceCase c = gqa_case();
  c.compositions = 5;
  const InvarianceReport report =
      check_batch_invariance(cpu_backend(), Device::cpu, c, 11, /*batch_invariant=*/false);
  EXPECT_FALSE(report.invariant()) << report.describe();
}

TEST(ReferenceBatchInvariant, Bf16Gqa) {
  InvarianceCase c = gqa_case();
  c.pool = {{900, 1}, {300, 1}, {0, 1}, {200, 3}, {0, 60}, {100, 20}};
  expect_invariant(backend_named("REFERENCE"), c, 21);
}

InvarianceCase mla_case() {
  InvarianceCase c;
  c.name = "mla";
  c.mla = true;
  c.dtype = DType::bf16;
  c.num_heads = 16;
  c.mla_dims = {64, 32, 16, 32};
  c.block_size = 16;
  // Decodes (query_len 1) and prefills with and without context; a workspace of 2 pages per
  // request, so the contexts take several chunks (and, by default, chunk sizes that follow the
  // number of prefills with context).
  c.pool = {{1800, 1}, {700, 1}, {30, 1}, {0, 1}, {1200, 1},
            {0, 40},   {300, 25}, {90, 60}, {500, 9}};
  c.mla_workspace_tokens = static_cast<int64_t>(c.pool.size()) * 2 * c.block_size;
  c.num_sms = {2, 1, 3, 4};
  return c;
}

TEST(CpuMlaBatchInvariant, Bf16) { expect_invariant(backend_named("CPU_MLA"), mla_case(), 31); }

TEST(CpuMlaBatchInvariant, F32Fp8Cache) {
  InvarianceCase c = mla_case();
  c.dtype = DType::f32;
  c.kv_cache_dtype = "fp8";
  expect_invariant(backend_named("CPU_MLA"), c, 32);
}

TEST(CpuMlaBatchInvariantControl, DefaultModeDiffers) {
  InvarianceCase c = mla_case();
  c.compositions = 5;
  const InvarianceReport report = check_batch_invariance(backend_named("CPU_MLA"), Device::cpu, c,
                                                         31, /*batch_invariant=*/false);
  EXPECT_FALSE(report.invariant()) << report.describe();
}

TEST(ReferenceMlaBatchInvariant, F32) {
  InvarianceCase c = mla_case();
  c.dtype = DType::f32;
  c.pool = {{500, 1}, {90, 1}, {0, 1}, {0, 30}, {200, 12}, {60, 20}};
  c.mla_workspace_tokens = static_cast<int64_t>(c.pool.size()) * 2 * c.block_size;
  expect_invariant(backend_named("REFERENCE_MLA"), c, 41);
}

// ---- the mode computes the same attention ----------------------------------------------------
// The CI conformance grids against the fp64 oracles with every builder in the mode
// (PAGEDATTN_BATCH_INVARIANT=1): the CPU (its request-local plans, no cascade even where the grid
// asks for it) and CPU_MLA (fixed context chunks, no split, the fixed-row GEMMs).

TEST(BatchInvariantConformance, CpuGrid) {
  EnvGuard env(kBatchInvariantEnv, "1");
  int ran = 0;
  for (const conformance::ConformanceCase& c : conformance::conformance_grid(false)) {
    if (!conformance::unsupported_reasons(cpu_backend(), Device::cpu, c).empty()) continue;
    const conformance::ConformanceResult result = conformance::run_case(cpu_backend(), Device::cpu, c, 7);
    EXPECT_TRUE(result.passed()) << result.describe();
    EXPECT_FALSE(result.used_cascade) << result.describe();
    ++ran;
  }
  EXPECT_GT(ran, 20);
}

TEST(BatchInvariantConformance, CpuMlaGrid) {
  EnvGuard env(kBatchInvariantEnv, "1");
  const auto results = conformance::mla::run_mla_grid(backend_named("CPU_MLA"), "", Device::cpu,
                                                      conformance::mla::mla_grid(false), 7);
  int ran = 0;
  for (const conformance::mla::MLAResult& r : results) {
    EXPECT_TRUE(r.passed()) << r.describe();
    ran += r.skipped ? 0 : 1;
  }
  EXPECT_GT(ran, 5);
}

// ---- the switch --------------------------------------------------------------------------------

// A two-request batch sharing its first 32 cached tokens (two pages of 16), as a cascade step.
OwnedCommonAttentionMetadata shared_prefix_batch() {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 1, 2};
  args.seq_lens = {40, 50};
  args.max_num_blocks_per_req = 4;
  args.block_table = {0, 1, 2, 3, 0, 1, 4, 5};
  args.slot_mapping = {3 * 16 + 7, 5 * 16 + 1};  // positions 39 and 49
  return make_common_attention_metadata(args);
}

KVCacheSpec small_spec() { return KVCacheSpec::full_attention(16, 2, 64, DType::bf16); }

BuilderConfig small_config(bool batch_invariant) {
  BuilderConfig config;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_size = 64;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 16;
  config.max_model_len = 64;
  config.num_sms = 2;
  config.batch_invariant = batch_invariant;
  return config;
}

TEST(BatchInvariantSwitch, CascadeOffInTheMode) {
  const OwnedCommonAttentionMetadata batch = shared_prefix_batch();
  for (const char* name : {"CPU", "REFERENCE"}) {
    for (bool invariant : {false, true}) {
      auto builder = backend_named(name).make_builder(small_spec(), small_config(invariant), Device::cpu);
      EXPECT_EQ(builder->supports_cascade(), !invariant) << name;
      const auto plan = builder->build(32, batch.common);
      EXPECT_EQ(plan->use_cascade, !invariant) << name << " batch_invariant = " << invariant;
      EXPECT_EQ(plan->batch_invariant, invariant) << name;
    }
  }
}

TEST(BatchInvariantSwitch, EnvironmentVariable) {
  const OwnedCommonAttentionMetadata batch = shared_prefix_batch();
  {
    EnvGuard env(kBatchInvariantEnv, "1");
    EXPECT_TRUE(batch_invariant_mode(small_config(false)));
    auto builder = cpu_backend().make_builder(small_spec(), small_config(false), Device::cpu);
    const auto plan = builder->build(32, batch.common);
    EXPECT_TRUE(plan->batch_invariant);
    EXPECT_FALSE(plan->use_cascade);
  }
  {
    EnvGuard env(kBatchInvariantEnv, "0");
    EXPECT_FALSE(batch_invariant_mode(small_config(false)));
    EXPECT_TRUE(batch_invariant_mode(small_config(true)));
  }
  for (const char* bad : {"yes", "2", "true"}) {
    EnvGuard env(kBatchInvariantEnv, bad);
    try {
      cpu_backend().make_builder(small_spec(), small_config(false), Device::cpu);
      ADD_FAILURE() << "PAGEDATTN_BATCH_INVARIANT=" << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), kBatchInvariantEnv);
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace pagedattn::cpu
