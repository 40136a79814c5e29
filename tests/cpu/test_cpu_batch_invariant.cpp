// Batch-invariant mode on the host backends (CPU on every kernel path this machine runs,
// REFERENCE, CPU_MLA, REFERENCE_MLA): every request of a pool gives the same bits alone and in
// >= 50 random batches (sizes, orders, decode-only and mixed steps, 1 to 4 threads), through the
// shared harness (conformance/batch_invariance.h). Also: the default mode is NOT invariant on the
// same pools (so the check can fail), the environment variable and its bad values, and cascade
// off in the mode.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/batch_invariance.h"
#include "conformance/env_guard.h"
#include "cpu_kernel_paths.h"

namespace pagedattn::cpu {
namespace {

using conformance::EnvGuard;
using conformance::RequestShape;
using conformance::invariance::check_batch_invariance;
using conformance::invariance::InvarianceCase;
using conformance::invariance::InvarianceReport;
using conformance::invariance::registered_backend;

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
  conformance::invariance::expect_batch_invariant(backend, Device::cpu, c, seed);
}

// Every kernel path this machine runs (cpu_kernel_paths.h).
class CpuBatchInvariant : public KernelPathTest {};

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

INSTANTIATE_TEST_SUITE_P(Paths, CpuBatchInvariant, every_kernel_path(), kernel_path_name);

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
  expect_invariant(registered_backend("REFERENCE"), c, 21);
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

TEST(CpuMlaBatchInvariant, Bf16) { expect_invariant(registered_backend("CPU_MLA"), mla_case(), 31); }

TEST(CpuMlaBatchInvariant, F32Fp8Cache) {
  InvarianceCase c = mla_case();
  c.dtype = DType::f32;
  c.kv_cache_dtype = "fp8";
  expect_invariant(registered_backend("CPU_MLA"), c, 32);
}

TEST(CpuMlaBatchInvariantControl, DefaultModeDiffers) {
  InvarianceCase c = mla_case();
  c.compositions = 5;
  const InvarianceReport report = check_batch_invariance(registered_backend("CPU_MLA"), Device::cpu, c,
                                                         31, /*batch_invariant=*/false);
  EXPECT_FALSE(report.invariant()) << report.describe();
}

TEST(ReferenceMlaBatchInvariant, F32) {
  InvarianceCase c = mla_case();
  c.dtype = DType::f32;
  c.pool = {{500, 1}, {90, 1}, {0, 1}, {0, 30}, {200, 12}, {60, 20}};
  c.mla_workspace_tokens = static_cast<int64_t>(c.pool.size()) * 2 * c.block_size;
  expect_invariant(registered_backend("REFERENCE_MLA"), c, 41);
}

// ---- the mode computes the same attention ----------------------------------------------------
// The CI conformance grids against the fp64 oracles with every builder in the mode
// (PAGEDATTN_BATCH_INVARIANT=1): the CPU (its request-local plans, no cascade even where the grid
// asks for it) and CPU_MLA (fixed context chunks, no split, the fixed-row GEMMs).

void expect_conformant_in_the_mode(const AttentionBackend& backend, bool mla, int at_least) {
  const conformance::invariance::ModeConformance result =
      conformance::invariance::conformance_in_the_mode(backend, Device::cpu, mla);
  EXPECT_GE(result.ran, at_least) << backend.name();
  for (const std::string& failure : result.failures) ADD_FAILURE() << failure;
}

TEST(BatchInvariantConformance, CpuGrid) { expect_conformant_in_the_mode(cpu_backend(), false, 20); }

TEST(BatchInvariantConformance, CpuMlaGrid) { expect_conformant_in_the_mode(registered_backend("CPU_MLA"), true, 5); }

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
      auto builder = registered_backend(name).make_builder(small_spec(), small_config(invariant), Device::cpu);
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
