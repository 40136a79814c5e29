// The CPU backend's host side: selector reasons, capabilities, ISA dispatch, thread count, the
// plan (every output row written exactly once, splits covering the visible keys), and bad input
// (an Error naming the argument, nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_backend.h"
#include "../../src/backends/cpu/cpu_internal.h"
#include "conformance/env_guard.h"
#include "conformance/harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cpu {
namespace {

using conformance::EnvGuard;

bool any_reason_contains(const std::vector<std::string>& reasons, const std::string& text) {
  return std::any_of(reasons.begin(), reasons.end(),
                     [&](const std::string& r) { return r.find(text) != std::string::npos; });
}

TEST(CpuBackend, AcceptsTheIssueConfigurations) {
  const AttentionBackend& backend = cpu_backend();
  EXPECT_EQ(backend.name(), "CPU");
  for (int head_size : {64, 80, 96, 128, 192, 256}) {
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      for (const char* kv : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16",
                             "float32"}) {
        for (int block_size : {16, 32, 64, 48, 1, 24}) {
          SelectorConfig c;
          c.head_size = head_size;
          c.dtype = dtype;
          c.kv_cache_dtype = kv;
          c.block_size = block_size;
          c.has_sink = true;
          c.use_alibi = true;
          c.use_sliding_window = true;
          c.use_logits_soft_cap = true;
          c.fp8_output = true;
          c.head_size_v = head_size == 256 ? 128 : 0;
          const auto reasons = backend.validate_configuration(c);
          EXPECT_TRUE(reasons.empty()) << head_size << " " << kv << ": " << reasons.front();
        }
      }
    }
  }
  for (AttentionType type : {AttentionType::decoder, AttentionType::encoder,
                             AttentionType::encoder_only, AttentionType::encoder_decoder}) {
    SelectorConfig c;
    c.attn_type = type;
    EXPECT_TRUE(backend.validate_configuration(c).empty()) << attention_type_name(type);
  }
}

TEST(CpuBackend, RejectsWithAReasonNamingTheValue) {
  const AttentionBackend& backend = cpu_backend();
  SelectorConfig c;
  c.head_size = 72;
  c.head_size_v = 300;
  c.dtype = DType::fp8_e4m3;
  c.kv_cache_dtype = "int4";
  c.use_mla = true;
  c.use_sparse = true;
  c.device = Device::cuda;
  c.block_size = 0;
  const auto reasons = backend.validate_configuration(c);
  EXPECT_TRUE(any_reason_contains(reasons, "head_size = 72"));
  EXPECT_TRUE(any_reason_contains(reasons, "head_size_v = 300"));
  EXPECT_TRUE(any_reason_contains(reasons, "dtype = fp8_e4m3"));
  EXPECT_TRUE(any_reason_contains(reasons, "kv_cache_dtype = 'int4'"));
  EXPECT_TRUE(any_reason_contains(reasons, "use_mla = true"));
  EXPECT_TRUE(any_reason_contains(reasons, "use_sparse = true"));
  EXPECT_TRUE(any_reason_contains(reasons, "device = cuda"));
  EXPECT_TRUE(any_reason_contains(reasons, "block_size = 0"));
  SelectorConfig cross;
  cross.attn_type = AttentionType::encoder_decoder;
  cross.use_sliding_window = true;
  cross.use_alibi = true;
  EXPECT_EQ(backend.validate_configuration(cross).size(), 2u);
  SelectorConfig encoder;
  encoder.attn_type = AttentionType::encoder_only;
  encoder.kv_cache_dtype = "fp8";
  EXPECT_TRUE(any_reason_contains(backend.validate_configuration(encoder), "kv_cache_dtype = 'fp8'"));
}

TEST(CpuBackend, CapabilitiesListEveryFeatureAndAmxOnlyWhereItRuns) {
  const BackendCapabilities caps = cpu_backend().capabilities();
  for (const char* feature : {"alibi", "sliding_window", "soft_cap", "sinks", "lse", "cascade",
                              "fp8_output", "head_size_v", "fp8_kv_cache", "per_head_kv_scales"}) {
    EXPECT_NE(std::find(caps.features.begin(), caps.features.end(), feature), caps.features.end())
        << feature;
  }
  // "amx" exactly when the AMX path can run here.
  EXPECT_EQ(std::find(caps.features.begin(), caps.features.end(), "amx") != caps.features.end(),
            isa_supported(Isa::amx));
  EXPECT_EQ(caps.head_sizes.front(), 16);
  EXPECT_EQ(caps.head_sizes.back(), 256);
  EXPECT_EQ(caps.attn_types.size(), 4u);
}

TEST(CpuDispatch, ParsesPathsAndRejectsUnknownNames) {
  EXPECT_EQ(parse_isa("scalar", "x"), Isa::scalar);
  EXPECT_EQ(parse_isa("avx2", "x"), Isa::avx2);
  EXPECT_EQ(parse_isa("avx512", "x"), Isa::avx512);
  EXPECT_EQ(parse_isa("avx512f", "x"), Isa::avx512f);
  EXPECT_EQ(parse_isa("amx", "x"), Isa::amx);
  for (const char* bad : {"amx512", "AVX2", "neon", ""}) {
    try {
      parse_isa(bad, "PAGEDATTN_CPU_ISA");
      FAIL() << bad << " is not a path";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "PAGEDATTN_CPU_ISA");
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos);
    }
  }
  EXPECT_TRUE(isa_supported(Isa::scalar));
  EXPECT_TRUE(isa_supported(best_isa()));
}

TEST(CpuDispatch, OverrideSelectsTheTable) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512f, Isa::avx512, Isa::amx}) {
    if (!isa_supported(isa)) {
      EXPECT_THROW(set_isa_override(isa), Error) << isa_name(isa);
      continue;
    }
    set_isa_override(isa);
    EXPECT_EQ(active_kernels().isa, isa);
    EXPECT_STREQ(active_kernels().name, isa_name(isa));
  }
  clear_isa_override();
  // The emulated AMX table (tests only) wins over the ISA override until cleared.
  if (isa_supported(Isa::avx512)) {
    set_isa_override(Isa::scalar);
    set_kernel_table_override(amx_emulated_kernel_table());
    EXPECT_STREQ(active_kernels().name, "amx-emulated");
    set_kernel_table_override(nullptr);
    EXPECT_EQ(active_kernels().isa, Isa::scalar);
    clear_isa_override();
  } else {
    EXPECT_THROW(set_kernel_table_override(amx_emulated_kernel_table()), Error);
  }
  if (std::getenv("PAGEDATTN_CPU_ISA") == nullptr) {  // a forced path (CI's ISA runs) wins
    EXPECT_EQ(active_kernels().isa, best_isa()) << "without PAGEDATTN_CPU_ISA the best path runs";
  }
}

// Host allocations >= 32 MiB (a KV cache) start on a 2 MiB boundary so that transparent huge
// pages can back them (the allocator advises them; the data is never touched here).
TEST(CpuMemory, LargeKvCachesAreAlignedForHugePages) {
  const Tensor big = cpu_backend().allocate_kv_cache(1024, 16, 8, 128, DType::bf16, Device::cpu);
  ASSERT_GE(big.nbytes(), size_t{32} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (uintptr_t{1} << 21), 0u);
  const Tensor small = cpu_backend().allocate_kv_cache(4, 16, 2, 64, DType::bf16, Device::cpu);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
}

TEST(CpuThreads, EnvironmentAndConfigDecide) {
  {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", "3");
    EXPECT_EQ(resolve_num_threads(0), 3);
    EXPECT_EQ(resolve_num_threads(5), 5);
  }
  for (const char* bad : {"0", "-2", "many", "3x"}) {
    const EnvGuard guard("PAGEDATTN_NUM_THREADS", bad);
    try {
      resolve_num_threads(0);
      FAIL() << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "PAGEDATTN_NUM_THREADS");
    }
  }
}

// ---- plans ------------------------------------------------------------------------------------

struct PlanCase {
  std::vector<int32_t> query_lens, seq_lens;
  int num_heads = 8, num_kv_heads = 2, threads = 2, prefix = 0;
  int num_speculative_tokens = 0;
  std::optional<int> window;
};

std::shared_ptr<const CpuAttentionMetadata> make_plan(const PlanCase& p, size_t* workspace = nullptr,
                                                      bool fast_build = false) {
  const int bs = 16;
  KVCacheSpec spec = KVCacheSpec::full_attention(bs, p.num_kv_heads, 64, DType::bf16);
  BuilderConfig config;
  config.num_heads = p.num_heads;
  config.num_kv_heads = p.num_kv_heads;
  config.head_size = 64;
  config.head_size_v = 64;
  config.max_model_len = 1 << 16;
  config.max_num_batched_tokens = 1 << 14;
  config.num_sms = p.threads;
  config.sliding_window = p.window;
  config.num_speculative_tokens = p.num_speculative_tokens;
  auto builder = cpu_backend().make_builder(spec, config, Device::cpu);
  if (workspace != nullptr) *workspace = builder->workspace_bytes();
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  int cols = 0;
  for (size_t r = 0; r < p.query_lens.size(); ++r) {
    args.query_start_loc.push_back(args.query_start_loc.back() + p.query_lens[r]);
    cols = std::max(cols, (p.seq_lens[r] + bs - 1) / bs);
  }
  args.seq_lens = p.seq_lens;
  args.max_num_blocks_per_req = std::max(cols, 1);
  int next_block = p.prefix / bs;
  for (size_t r = 0; r < p.query_lens.size(); ++r) {
    for (int c = 0; c < args.max_num_blocks_per_req; ++c) {
      args.block_table.push_back(c < p.prefix / bs ? c : next_block++);
    }
  }
  args.slot_mapping.assign(args.query_start_loc.back(), -1);
  OwnedCommonAttentionMetadata owned = make_common_attention_metadata(args);
  auto md = builder->build(p.prefix, owned.common, fast_build);
  return std::dynamic_pointer_cast<const CpuAttentionMetadata>(md);
}

// Every (token, kv head) row is finalized exactly once (by an item or by a merge), and the
// splits of a merge group tile the keys without overlap.
void expect_complete(const CpuAttentionMetadata& md) {
  std::map<std::pair<int, int>, int> writers;
  for (const WorkItem& item : md.items) {
    ASSERT_GE(item.num_kv_heads, 1);
    ASSERT_LE(item.kv_head + item.num_kv_heads, md.num_kv_heads);
    ASSERT_LE((item.tok_end - item.tok_begin) * (md.num_heads / md.num_kv_heads) * item.num_kv_heads,
              md.workspace->max_rows);
    if (item.num_kv_heads > 1) {  // head-fused items: one request, final rows, no prefix
      EXPECT_EQ(item.req_end - item.req_begin, 1);
      EXPECT_LT(item.partial_base, 0);
      EXPECT_EQ(item.prefix_len, 0);
    }
    if (item.partial_base >= 0) continue;
    for (int t = item.tok_begin; t < item.tok_end; ++t) {
      for (int g = item.kv_head; g < item.kv_head + item.num_kv_heads; ++g) ++writers[{t, g}];
    }
  }
  for (const MergeTask& merge : md.merges) {
    for (int t = merge.tok_begin; t < merge.tok_end; ++t) ++writers[{t, merge.kv_head}];
    std::vector<std::pair<int, int>> ranges;
    for (const WorkItem& item : md.items) {
      if (item.partial_base == merge.partial_base && item.kv_head == merge.kv_head) {
        ranges.emplace_back(item.kv_begin, item.kv_end);
      }
    }
    ASSERT_EQ(static_cast<int>(ranges.size()), merge.num_splits);
    std::sort(ranges.begin(), ranges.end());
    for (size_t s = 1; s < ranges.size(); ++s) EXPECT_EQ(ranges[s - 1].second, ranges[s].first);
    // The last split ends at the request's last visible key (its seq_len for a causal decoder).
    EXPECT_EQ(ranges.back().second, md.seq_lens[std::upper_bound(md.query_start_loc.begin(),
                                                                 md.query_start_loc.end(),
                                                                 merge.tok_begin) -
                                                md.query_start_loc.begin() - 1]);
    EXPECT_LE(md.partial_rows_used, md.workspace->partial_capacity_rows);
  }
  for (int t = 0; t < md.num_actual_tokens; ++t) {
    for (int g = 0; g < md.num_kv_heads; ++g) {
      EXPECT_EQ((writers[{t, g}]), 1) << "token " << t << " kv head " << g;
    }
  }
  for (size_t i = 1; i < md.items.size(); ++i) EXPECT_GE(md.items[i - 1].cost, md.items[i].cost);
}

TEST(CpuPlan, PrefillsAreTiledAndDecodesSplitWhenThreadsLackWork) {
  PlanCase prefill;
  prefill.query_lens = {200, 1, 0, 33};
  prefill.seq_lens = {200, 50, 7, 100};
  size_t workspace = 0;
  auto md = make_plan(prefill, &workspace);
  EXPECT_GT(workspace, 0u);
  EXPECT_TRUE(md->merges.empty());
  // 32 tokens per q tile (G = 4): 2 kv heads x (7 + 1 + 2) items, less one for each q tile whose
  // rows for both kv heads fit one item (the 8-token and 1-token tiles and the decode: fused).
  EXPECT_EQ(md->items.size(), 2u * (7 + 1 + 2) - 3);
  expect_complete(*md);

  PlanCase decode;
  decode.query_lens = {1, 1};
  decode.seq_lens = {4000, 300};
  decode.threads = 4;
  md = make_plan(decode);
  EXPECT_EQ(md->merges.size(), 2u) << "the 4000-key decode is split for each kv head";
  expect_complete(*md);

  decode.threads = 1;
  EXPECT_TRUE(make_plan(decode)->merges.empty()) << "one thread never splits";

  PlanCase spec_decode;
  spec_decode.query_lens = {4, 3};
  spec_decode.seq_lens = {3000, 2000};
  spec_decode.window = 1000;
  spec_decode.threads = 8;
  md = make_plan(spec_decode);
  EXPECT_FALSE(md->merges.empty());
  for (const WorkItem& item : md->items) {
    // Request 0's first query sits at 2996: keys below 2996 - 999 are outside every window.
    if (item.req_begin == 0) {
      EXPECT_GE(item.kv_begin, (2996 - 999) / 64 * 64);
    }
  }
  expect_complete(*md);
}

// Speculative decodes longer than 8 tokens are split along the keys like decodes only when the
// builder knows them as decodes (num_speculative_tokens); the partials fit the workspace.
TEST(CpuPlan, SpeculativeDecodesBeyondEightTokensSplitWithTheirThreshold) {
  PlanCase spec;
  spec.query_lens = {12, 10};
  spec.seq_lens = {4000, 3000};
  spec.threads = 4;
  EXPECT_TRUE(make_plan(spec)->merges.empty()) << "12 tokens: a prefill chunk without the threshold";
  spec.num_speculative_tokens = 11;
  const auto md = make_plan(spec);
  EXPECT_EQ(md->merges.size(), 4u) << "both requests split for each kv head";
  for (const MergeTask& merge : md->merges) EXPECT_GE(merge.num_splits, 2);
  expect_complete(*md);
}

// Many decodes (enough items for the threads): the KV heads of each request are fused into one
// item, which then reads whole pages; too few requests keep one item per KV head (and split).
TEST(CpuPlan, DecodeBatchesFuseTheKvHeadsOfARequest) {
  PlanCase batch;
  batch.num_heads = 32;
  batch.num_kv_heads = 8;
  batch.threads = 2;
  for (int r = 0; r < 12; ++r) {
    batch.query_lens.push_back(r == 5 ? 40 : 1);  // one short prefill: 40 * 4 * 8 rows > 128
    batch.seq_lens.push_back(r == 5 ? 300 : 500 + 97 * r);
  }
  auto md = make_plan(batch);
  int fused = 0, single = 0;
  for (const WorkItem& item : md->items) {
    if (item.num_kv_heads == 8) {
      ++fused;
      EXPECT_EQ(item.kv_head, 0);
    } else {
      EXPECT_EQ(item.num_kv_heads, 1);
      EXPECT_EQ(item.req_begin, 5) << "only the prefill keeps per-head items";
      ++single;
    }
  }
  EXPECT_EQ(fused, 11);
  EXPECT_EQ(single, 2 * 8);  // 40 tokens = 2 q tiles of 32 tokens, 8 kv heads
  EXPECT_TRUE(md->merges.empty());
  expect_complete(*md);

  PlanCase few;  // 2 requests x 8 heads = 16 items; fused they would be 2 < 4 per thread
  few.num_heads = 32;
  few.num_kv_heads = 8;
  few.threads = 2;
  few.query_lens = {1, 1};
  few.seq_lens = {900, 1200};
  md = make_plan(few);
  for (const WorkItem& item : md->items) EXPECT_EQ(item.num_kv_heads, 1);
  expect_complete(*md);
  few.threads = 1;  // one thread: always fused
  md = make_plan(few);
  ASSERT_EQ(md->items.size(), 2u);
  for (const WorkItem& item : md->items) EXPECT_EQ(item.num_kv_heads, 8);
  expect_complete(*md);
}

TEST(CpuPlan, CascadeGroupsRequestsAndKeepsEveryRow) {
  PlanCase p;
  p.prefix = 64;
  p.query_lens = {1, 1, 2, 90, 1, 0, 1};
  p.seq_lens = {70, 80, 66, 200, 65, 64, 100};
  auto md = make_plan(p);
  ASSERT_TRUE(md->use_cascade);
  EXPECT_EQ(md->common_prefix_len, 64);
  bool grouped = false;
  for (const WorkItem& item : md->items) {
    EXPECT_EQ(item.prefix_len, 64);
    grouped |= item.req_end - item.req_begin > 1;
  }
  EXPECT_TRUE(grouped);
  expect_complete(*md);
}

// ---- fast_build / build_for_drafting -----------------------------------------------------------

// fast_build: no cascade, no split-KV, no cost ordering; every row still written exactly once.
TEST(CpuPlan, FastBuildSkipsCascadeAndSplitKv) {
  PlanCase decode;  // split by the normal build (see above)
  decode.query_lens = {1, 3};
  decode.seq_lens = {4000, 300};
  decode.threads = 4;
  ASSERT_FALSE(make_plan(decode)->merges.empty());
  auto md = make_plan(decode, nullptr, /*fast_build=*/true);
  EXPECT_TRUE(md->merges.empty());
  EXPECT_EQ(md->partial_rows_used, 0);
  ASSERT_EQ(md->items.size(), 2u);  // one item per request: both kv heads fused
  EXPECT_EQ(md->items[0].req_begin, 0);
  EXPECT_EQ(md->items[1].req_begin, 1);
  expect_complete(*md);

  PlanCase cascade;
  cascade.prefix = 64;
  cascade.query_lens = {1, 1, 2, 90, 1, 0, 1};
  cascade.seq_lens = {70, 80, 66, 200, 65, 64, 100};
  ASSERT_TRUE(make_plan(cascade)->use_cascade);
  md = make_plan(cascade, nullptr, /*fast_build=*/true);
  EXPECT_FALSE(md->use_cascade);
  EXPECT_EQ(md->common_prefix_len, 0);
  for (const WorkItem& item : md->items) EXPECT_EQ(item.prefix_len, 0);
  expect_complete(*md);
}

// The plans of build(fast_build = true) and build_for_drafting compute what build() computes,
// within the dtype's tolerance (DESIGN.md §5), on random inputs: a cascade batch and a batch that
// the normal CPU build splits along the keys (4 threads), on CPU and REFERENCE.
TEST(FastBuild, SameResultsAsTheNormalBuild) {
  const conformance::EnvGuard threads("PAGEDATTN_NUM_THREADS", "4");
  for (const char* name : {"CPU", "REFERENCE"}) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      conformance::ConformanceCase cascade;
      cascade.dtype = dtype;
      cascade.head_size = 32;
      cascade.num_heads = 4;
      cascade.num_kv_heads = 2;
      cascade.cascade_prefix = 32;
      cascade.batch = {{40, 1}, {35, 1}, {50, 2}, {33, 1}, {64, 4}, {32, 1}, {47, 1}, {40, 3}};
      conformance::ConformanceCase split = cascade;
      split.cascade_prefix = 0;
      split.batch = {{800, 1}, {530, 2}};
      for (const conformance::ConformanceCase& c : {cascade, split}) {
        SCOPED_TRACE(std::string(name) + " " + c.describe());
        const AttentionBackend& backend = *find_backend(name);
        const conformance::CaseInputs inputs = conformance::make_inputs(c, 7);
        conformance::PreparedRun run = conformance::prepare_run(backend, Device::cpu, inputs);
        EXPECT_EQ(run.step_metadata->use_cascade, c.cascade_prefix > 0);
        conformance::execute(run);
        const conformance::BackendOutputs normal = conformance::collect(run);
        const CommonAttentionMetadata& common = run.step_common.common;
        for (int variant = 0; variant < 2; ++variant) {
          run.step_metadata = variant == 0 ? run.builder->build(c.cascade_prefix, common, true)
                                           : run.builder->build_for_drafting(common, variant);
          EXPECT_FALSE(run.step_metadata->use_cascade);
          run.output.fill_bytes(0xFF);  // NaN: every row must be written again
          conformance::execute(run);
          const conformance::ConformanceResult r =
              conformance::compare(inputs, conformance::collect(run), normal);
          EXPECT_TRUE(r.passed()) << r.describe();
          EXPECT_LE(r.output_rel_error, conformance::tolerance(c));
        }
      }
    }
  }
}

TEST(FastBuild, DraftIndexIsChecked) {
  const KVCacheSpec spec = KVCacheSpec::full_attention(16, 2, 64, DType::bf16);
  BuilderConfig config;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  auto builder = cpu_backend().make_builder(spec, config, Device::cpu);
  const OwnedCommonAttentionMetadata owned =
      make_common_attention_metadata({.query_start_loc = {0, 1}, .seq_lens = {10},
                                      .block_table = {0}, .max_num_blocks_per_req = 1,
                                      .slot_mapping = {9}});
  try {
    (void)builder->build_for_drafting(owned.common, -1);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "draft_index");
    EXPECT_NE(std::string(e.what()).find("draft_index = -1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(builder->build_for_drafting(owned.common, 3)->num_actual_tokens, 1);
}

// ---- bad input -----------------------------------------------------------------------------------

conformance::ConformanceCase small_case() {
  conformance::ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.return_lse = true;
  c.batch = {{20, 1}, {0, 6}};
  return c;
}

bool all_poisoned(const Tensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  return std::all_of(bytes, bytes + t.nbytes(), [](unsigned char b) { return b == 0xFF; });
}

TEST(CpuBadInput, ForeignMetadataIsRejectedBeforeWriting) {
  const conformance::CaseInputs in = conformance::make_inputs(small_case(), 3);
  conformance::PreparedRun cpu = conformance::prepare_run(cpu_backend(), Device::cpu, in);
  conformance::PreparedRun ref = conformance::prepare_run(conformance::reference(), Device::cpu, in);
  try {
    cpu.impl().forward(cpu.scales(), cpu.query, cpu.key, cpu.value, cpu.kv_cache, *ref.step_metadata,
                       cpu.output, {}, cpu.output_lse);
    FAIL() << "REFERENCE metadata accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metadata");
  }
  EXPECT_TRUE(all_poisoned(cpu.output));
}

TEST(CpuBadInput, WrongShapesAndBlocksNameTheArgument) {
  const conformance::CaseInputs in = conformance::make_inputs(small_case(), 4);
  conformance::PreparedRun run = conformance::prepare_run(cpu_backend(), Device::cpu, in);
  AttentionImpl& impl = run.impl();
  const auto expect_error = [&](const char* argument, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    EXPECT_TRUE(all_poisoned(run.output)) << argument;
  };
  // query with the wrong head count
  const TensorView narrow_query = run.query.view().narrow(1, 0, 2);
  expect_error("query", [&] {
    impl.forward(run.scales(), narrow_query, run.key, run.value, run.kv_cache, *run.step_metadata,
                 run.output, {}, run.output_lse);
  });
  // LSE with too few tokens
  const TensorView short_lse = run.output_lse.view().narrow(1, 0, 1);
  expect_error("output_lse", [&] {
    impl.forward(run.scales(), run.query, run.key, run.value, run.kv_cache, *run.step_metadata,
                 run.output, {}, short_lse);
  });
  // a cache with fewer blocks than the block table names
  const TensorView small_cache = run.kv_cache.view().narrow(1, 0, 1);
  expect_error("metadata", [&] {
    impl.forward(run.scales(), run.query, run.key, run.value, small_cache, *run.step_metadata,
                 run.output, {}, run.output_lse);
  });
  // output of the wrong dtype
  Tensor f32_output(run.output.shape(), DType::f32);
  expect_error("output", [&] {
    impl.forward(run.scales(), run.query, run.key, run.value, run.kv_cache, *run.step_metadata,
                 f32_output, {}, run.output_lse);
  });
  // output_scale that is not positive
  Tensor fp8_output(run.output.shape(), DType::fp8_e4m3);
  Tensor zero_scale(Shape{1}, DType::f32);
  zero_scale.data_as<float>()[0] = 0.f;
  expect_error("output_scale", [&] {
    impl.forward(run.scales(), run.query, run.key, run.value, run.kv_cache, *run.step_metadata,
                 fp8_output, zero_scale, run.output_lse);
  });
}

TEST(CpuBadInput, BuilderAndImplParametersAreChecked) {
  KVCacheSpec spec = KVCacheSpec::full_attention(16, 2, 64, DType::bf16);
  BuilderConfig config;  // num_heads = 0
  try {
    cpu_backend().make_builder(spec, config, Device::cpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "config.num_heads");
  }
  config.num_heads = 4;
  config.head_size = 72;
  try {
    cpu_backend().make_builder(spec, config, Device::cpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "config.head_size");
  }
  AttentionImplParams params;
  params.num_heads = 4;
  params.head_size = 100;
  try {
    cpu_backend().make_impl(params);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "head_size");
  }
}

}  // namespace
}  // namespace pagedattn::cpu
