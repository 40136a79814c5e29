// The CUDA backend against the REFERENCE (fp64) through the conformance harness: the harness's
// own grid (the cases CUDA supports) plus a CUDA grid that walks every head size, both activation
// dtypes, every KV dtype, block sizes 16..64 and 48, both layouts, every feature, GQA groups up to
// 32, and the batch shapes that exercise the kernel's paths: 1-token decodes (decode path),
// spec-decode rows, long prefill chunks with context (several 128-row tiles), split-KV (few long
// requests) and no split (many requests), empty requests and padding.
// Cascade (a shared prefix attended once for the whole batch, then merged) and head_size_v !=
// head_size have their own grids; a host-only test checks the cascade plan's coverage.
// PAGEDATTN_FULL_GRID=1 also runs the harness's full grid; PAGEDATTN_GPU_SMALL_GRID=1 runs every
// 8th CUDA case only (every 3rd cascade / head_size_v case; the sanitizer runs of
// scripts/gpu-check).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "../../src/backends/cuda/attention/cuda_backend_internal.h"
#include "../../src/backends/cuda/attention/planner.h"
#include "conformance/harness.h"
#include "gpu_test_util.h"

namespace pagedattn {
namespace {

using conformance::ConformanceCase;
using conformance::RequestShape;

std::vector<std::vector<RequestShape>> cuda_batches() {
  return {
      {{0, 5}, {17, 1}, {9, 0}, {33, 7}, {5, 1}},           // mixed, an empty query
      {{700, 1}, {1500, 1}, {64, 1}, {2100, 1}},            // long decodes: split-KV
      {{40, 100}, {130, 1}, {0, 0}},                        // a 100-token chunk with context
      {{300, 4}, {77, 3}, {500, 2}},                        // spec-decode style rows
      {{0, 150}},                                           // plain causal prefill, several tiles
  };
}

// Many requests (no split): more work items than resident CTAs.
std::vector<RequestShape> wide_batch() {
  std::vector<RequestShape> batch;
  for (int i = 0; i < 72; ++i) batch.push_back({40 + (i * 37) % 200, i % 9 == 0 ? 3 : 1});
  return batch;
}

std::vector<ConformanceCase> cuda_grid() {
  std::vector<ConformanceCase> cases;
  const int head_sizes[] = {64, 80, 96, 128, 192, 256};
  const int block_sizes[] = {16, 32, 64, 48};
  const std::pair<int, int> heads[] = {{8, 2}, {4, 4}, {16, 1}, {32, 1}, {16, 2}};
  const char* kv_dtypes[] = {"auto", "fp8_e4m3", "fp8_e5m2"};
  const auto batches = cuda_batches();
  size_t index = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int d : head_sizes) {
      for (int variant = 0; variant < 6; ++variant, ++index) {
        ConformanceCase c;
        c.dtype = dtype;
        c.head_size = d;
        c.block_size = block_sizes[index % 4];
        c.layout = index % 3 == 0 ? KVCacheLayout::HND : KVCacheLayout::NHD;
        const auto [hq, hkv] = heads[index % 5];
        c.num_heads = hq;
        c.num_kv_heads = hkv;
        c.kv_cache_dtype = kv_dtypes[(index / 2) % 3];
        c.per_head_kv_scales = c.kv_cache_dtype != "auto" && index % 4 == 1;
        c.batch = batches[index % batches.size()];
        c.distribution = index % 2 ? conformance::Distribution::normal : conformance::Distribution::uniform;
        c.return_lse = index % 2 == 0;
        switch (variant) {
          case 0:
            break;
          case 1:
            c.sliding_window = 1 + static_cast<int>(index * 13 % 90);
            break;
          case 2:
            c.alibi = true;
            c.soft_cap = 5.f;
            break;
          case 3:
            c.sinks = true;
            c.return_lse = true;
            c.pad_tokens = 5;
            break;
          case 4:
            c.attn_type = index % 2 ? AttentionType::encoder_only : AttentionType::encoder;
            c.kv_cache_dtype = "auto";
            c.per_head_kv_scales = false;
            c.batch = {{0, 70}, {0, 1}, {0, 0}, {0, 33}};
            c.sliding_window = index % 4 == 0 ? std::optional<int>(9) : std::nullopt;
            c.alibi = index % 4 == 2;
            break;
          case 5:
            c.attn_type = AttentionType::encoder_decoder;
            c.batch = {{120, 1}, {300, 4}, {7, 0}, {65, 65}};
            c.sinks = index % 2 == 0;
            c.soft_cap = index % 2 ? std::optional<float>(3.f) : std::nullopt;
            c.return_lse = true;
            break;
        }
        cases.push_back(c);
      }
    }
  }
  // Paths that need specific shapes.
  ConformanceCase wide;
  wide.dtype = DType::bf16;
  wide.head_size = 128;
  wide.num_heads = 8;
  wide.num_kv_heads = 2;
  wide.batch = wide_batch();
  wide.return_lse = true;
  cases.push_back(wide);
  ConformanceCase cascade = wide;  // a shared prefix: the cascade path (asserted in run_cases)
  cascade.batch = {{64, 3}, {80, 1}, {96, 9}, {64, 1}, {70, 1}, {66, 2}, {65, 1}, {99, 1}};
  cascade.cascade_prefix = 64;
  cases.push_back(cascade);
  ConformanceCase non_causal = wide;
  non_causal.batch = {{30, 20}, {5, 1}};
  cases.push_back(non_causal);
  return cases;
}

// Decode-only batch: n requests sharing `prefix` tokens, each with up to `spread` more.
std::vector<RequestShape> shared_prefix_decodes(int n, int prefix, int spread, int query_len = 1) {
  std::vector<RequestShape> batch;
  for (int i = 0; i < n; ++i) batch.push_back({prefix + (i * 37 + 11) % spread, query_len});
  return batch;
}

// Cascade: decode-only batches of 8..64 requests over 256..1024 shared tokens, mixed prefill +
// decode, sinks + soft-cap, LSE, fp8 KV (per tensor and per head), block sizes 16 / 32 / 64, GQA
// 1 / 4 / 8, both layouts, padding, an empty request, a prefix short enough that its items split,
// head_size_v != head_size; and requests the plan must refuse (window, ALiBi: one pass).
std::vector<ConformanceCase> cascade_grid() {
  std::vector<ConformanceCase> cases;
  const auto base = [](DType dtype, int d, int hq, int hkv, int bs) {
    ConformanceCase c;
    c.dtype = dtype;
    c.head_size = d;
    c.num_heads = hq;
    c.num_kv_heads = hkv;
    c.block_size = bs;
    return c;
  };
  {  // 8 decodes, GQA 1, prefix 256, LSE
    ConformanceCase c = base(DType::bf16, 128, 8, 8, 16);
    c.batch = shared_prefix_decodes(8, 256, 100);
    c.cascade_prefix = 256;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // 32 decodes, GQA 4, block 64, prefix 512, HND
    ConformanceCase c = base(DType::f16, 128, 16, 4, 64);
    c.batch = shared_prefix_decodes(32, 512, 300);
    c.cascade_prefix = 512;
    c.layout = KVCacheLayout::HND;
    cases.push_back(c);
  }
  {  // 64 decodes, GQA 8, prefix 1024 (prefix items of 128 rows), LSE
    ConformanceCase c = base(DType::bf16, 64, 16, 2, 16);
    c.batch = shared_prefix_decodes(64, 1024, 200);
    c.cascade_prefix = 1024;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // mixed: decodes, a 150-token chunk, a 40-token chunk, spec rows, an empty request, padding
    ConformanceCase c = base(DType::bf16, 128, 8, 2, 16);
    c.batch = {{300, 1}, {256, 150}, {270, 1}, {280, 40}, {400, 3}, {257, 0}, {333, 1}, {290, 1}, {256, 1}};
    c.cascade_prefix = 256;
    c.pad_tokens = 3;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // sinks + soft-cap + LSE, block 32, spec rows
    ConformanceCase c = base(DType::f16, 96, 8, 2, 32);
    c.batch = shared_prefix_decodes(10, 256, 150);
    c.batch.push_back({300, 4});
    c.cascade_prefix = 256;
    c.sinks = true;
    c.soft_cap = 5.f;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // fp8 e4m3 KV, per-head scales, GQA 8, 16 decodes
    ConformanceCase c = base(DType::bf16, 128, 16, 2, 16);
    c.batch = shared_prefix_decodes(16, 512, 250);
    c.cascade_prefix = 512;
    c.kv_cache_dtype = "fp8_e4m3";
    c.per_head_kv_scales = true;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // fp8 e5m2 KV, D = 256 (64-row prefill items), block 64, mixed
    ConformanceCase c = base(DType::bf16, 256, 8, 2, 64);
    c.batch = shared_prefix_decodes(8, 256, 120);
    c.batch.push_back({256, 70});
    c.cascade_prefix = 256;
    c.kv_cache_dtype = "fp8_e5m2";
    c.layout = KVCacheLayout::HND;
    cases.push_back(c);
  }
  {  // few rows, long prefix: prefix and request items are split (flash-decoding) and merged
    ConformanceCase c = base(DType::bf16, 128, 2, 1, 16);
    c.batch = shared_prefix_decodes(8, 1024, 600);
    c.cascade_prefix = 1024;
    c.sinks = true;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // head_size 192 -> value head 128, GQA 4, 12 decodes + a chunk
    ConformanceCase c = base(DType::bf16, 192, 8, 2, 16);
    c.head_size_v = 128;
    c.batch = shared_prefix_decodes(12, 256, 90);
    c.batch.push_back({256, 20});
    c.cascade_prefix = 256;
    c.return_lse = true;
    cases.push_back(c);
  }
  {  // head_size 64 -> value head 128, fp8 e4m3, GQA 1
    ConformanceCase c = base(DType::f16, 64, 4, 4, 32);
    c.head_size_v = 128;
    c.batch = shared_prefix_decodes(9, 320, 100, 2);
    c.cascade_prefix = 320;
    c.kv_cache_dtype = "fp8_e4m3";
    cases.push_back(c);
  }
  {  // more tokens than the cascade states are sized for (kCascadeMaxTokens): one pass
    ConformanceCase c = base(DType::bf16, 128, 8, 2, 16);
    c.batch = std::vector<RequestShape>(8, RequestShape{256, 300});
    c.cascade_prefix = 256;
    cases.push_back(c);
  }
  {  // a sliding window: cascade is not allowed, the prefix is attended in one pass
    ConformanceCase c = base(DType::bf16, 128, 8, 2, 16);
    c.batch = shared_prefix_decodes(8, 256, 100);
    c.cascade_prefix = 256;
    c.sliding_window = 100;
    cases.push_back(c);
  }
  {  // ALiBi: one pass as well
    ConformanceCase c = base(DType::bf16, 80, 8, 2, 16);
    c.batch = shared_prefix_decodes(8, 256, 100);
    c.cascade_prefix = 256;
    c.alibi = true;
    c.return_lse = true;
    cases.push_back(c);
  }
  return cases;
}

// head_size_v != head_size: the kernel of the larger size with the narrower dim zero-padded.
// Pairs (192, 128), (128, 64), (64, 128), (96, 80), (80, 40), (256, 192), (128, 96) over decode,
// prefill with context, split-KV, spec rows, many items, fp8 KV, both layouts, encoder types.
std::vector<ConformanceCase> head_size_v_grid() {
  std::vector<ConformanceCase> cases;
  const auto batches = cuda_batches();
  const struct {
    int d, dv;
    DType dtype;
    const char* kv;
    KVCacheLayout layout;
    int bs, hq, hkv;
    AttentionType type;
  } specs[] = {
      {192, 128, DType::bf16, "auto", KVCacheLayout::NHD, 16, 8, 2, AttentionType::decoder},
      {192, 128, DType::f16, "fp8_e4m3", KVCacheLayout::HND, 32, 4, 4, AttentionType::decoder},
      {128, 64, DType::f16, "auto", KVCacheLayout::HND, 32, 8, 2, AttentionType::decoder},
      {128, 64, DType::bf16, "fp8_e5m2", KVCacheLayout::NHD, 16, 16, 2, AttentionType::decoder},
      {64, 128, DType::bf16, "fp8_e4m3", KVCacheLayout::NHD, 64, 8, 2, AttentionType::decoder},
      {64, 128, DType::f16, "auto", KVCacheLayout::HND, 16, 32, 1, AttentionType::decoder},
      {96, 80, DType::f16, "fp8_e5m2", KVCacheLayout::HND, 48, 8, 2, AttentionType::decoder},
      {96, 80, DType::bf16, "auto", KVCacheLayout::NHD, 16, 4, 4, AttentionType::decoder},
      {80, 40, DType::bf16, "auto", KVCacheLayout::NHD, 32, 8, 2, AttentionType::decoder},
      {256, 192, DType::bf16, "auto", KVCacheLayout::HND, 16, 8, 1, AttentionType::decoder},
      {128, 96, DType::bf16, "auto", KVCacheLayout::NHD, 16, 8, 2, AttentionType::encoder_only},
      {64, 128, DType::f16, "auto", KVCacheLayout::NHD, 16, 8, 2, AttentionType::encoder_decoder},
  };
  size_t index = 0;
  for (const auto& sp : specs) {
    for (int b = 0; b < 2; ++b, ++index) {
      ConformanceCase c;
      c.dtype = sp.dtype;
      c.head_size = sp.d;
      c.head_size_v = sp.dv;
      c.kv_cache_dtype = sp.type == AttentionType::decoder || sp.type == AttentionType::encoder_decoder ? sp.kv : "auto";
      c.layout = sp.layout;
      c.block_size = sp.bs;
      c.num_heads = sp.hq;
      c.num_kv_heads = sp.hkv;
      c.attn_type = sp.type;
      c.return_lse = index % 2 == 0;
      c.distribution = index % 3 == 0 ? conformance::Distribution::normal : conformance::Distribution::uniform;
      if (sp.type == AttentionType::decoder) {
        c.batch = batches[index % batches.size()];
        if (index % 5 == 3) {
          c.sinks = true;
          c.soft_cap = 4.f;
        }
        if (index % 7 == 2) c.sliding_window = 50;
      } else if (sp.type == AttentionType::encoder_only) {
        c.batch = b == 0 ? std::vector<RequestShape>{{0, 70}, {0, 1}, {0, 0}, {0, 33}}
                         : std::vector<RequestShape>{{0, 150}, {0, 9}};
      } else {
        c.batch = b == 0 ? std::vector<RequestShape>{{120, 1}, {300, 4}, {7, 0}, {65, 65}}
                         : std::vector<RequestShape>{{1500, 1}, {900, 2}};
        c.sinks = b == 1;
      }
      cases.push_back(c);
    }
  }
  ConformanceCase wide;  // many items, no split
  wide.dtype = DType::bf16;
  wide.head_size = 128;
  wide.head_size_v = 96;
  wide.num_heads = 8;
  wide.num_kv_heads = 1;
  wide.batch = wide_batch();
  wide.return_lse = true;
  cases.push_back(wide);
  return cases;
}

bool small_grid() {
  const char* v = std::getenv("PAGEDATTN_GPU_SMALL_GRID");
  return v != nullptr && std::string(v) == "1";
}

std::vector<ConformanceCase> every_nth(const std::vector<ConformanceCase>& cases, size_t n) {
  std::vector<ConformanceCase> out;
  for (size_t i = 0; i < cases.size(); i += n) out.push_back(cases[i]);
  return out;
}

// The plan takes the cascade path exactly when the REFERENCE does: a prefix on a causal decoder
// case without window or ALiBi.
bool expects_cascade(const ConformanceCase& c) {
  int tokens = 0;
  for (const RequestShape& r : c.batch) tokens += r.query_len;
  return c.cascade_prefix > 0 && c.attn_type == AttentionType::decoder && !c.sliding_window && !c.alibi &&
         !c.batch.empty() && tokens <= cuda::kCascadeMaxTokens;
}

void run_cases(const std::vector<ConformanceCase>& cases, uint64_t seed0, int* run, int* skipped) {
  const AttentionBackend& cuda = cuda_backend();
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!conformance::unsupported_reasons(cuda, Device::cuda, cases[i]).empty()) {
      ++*skipped;
      continue;
    }
    ++*run;
    try {
      const conformance::ConformanceResult result =
          conformance::run_case(cuda, Device::cuda, cases[i], seed0 + 7919 * i);
      EXPECT_TRUE(result.passed()) << result.describe();
      EXPECT_EQ(result.used_cascade, expects_cascade(cases[i])) << result.describe();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CUDA [" << cases[i].describe() << "] threw: " << e.what();
    }
  }
}

TEST(CudaConformance, CudaGridMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  std::vector<ConformanceCase> grid = cuda_grid();
  if (small_grid()) {
    std::vector<ConformanceCase> small;
    for (size_t i = 0; i < grid.size(); i += 8) small.push_back(grid[i]);
    grid = small;
  }
  int run = 0, skipped = 0;
  run_cases(grid, 0xC0DA, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " CUDA-grid cases run, " << skipped << " unsupported\n";
  EXPECT_EQ(skipped, 0) << "every case of the CUDA grid is in the backend's capabilities";
}

TEST(CudaConformance, CascadeMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  const std::vector<ConformanceCase> grid = small_grid() ? every_nth(cascade_grid(), 3) : cascade_grid();
  int run = 0, skipped = 0;
  run_cases(grid, 0xCA5CADE, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " cascade cases run, " << skipped << " unsupported\n";
  EXPECT_EQ(skipped, 0);
}

TEST(CudaConformance, HeadSizeVMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  const std::vector<ConformanceCase> grid =
      small_grid() ? every_nth(head_size_v_grid(), 3) : head_size_v_grid();
  int run = 0, skipped = 0;
  run_cases(grid, 0xD1FF, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " head_size_v cases run, " << skipped << " unsupported\n";
  EXPECT_EQ(skipped, 0);
}

// bf16, d 128, 8 query / 2 kv heads, page 16: 8 decodes sharing a 256-token prefix, planned as
// a cascade over it.
ConformanceCase shared_prefix_cascade_case() {
  ConformanceCase c;
  c.dtype = DType::bf16;
  c.head_size = 128;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.block_size = 16;
  c.batch = shared_prefix_decodes(8, 256, 50);
  c.cascade_prefix = 256;
  return c;
}

// Bad prefixes are rejected at build() with an Error naming common_prefix_len.
TEST(CudaConformance, CascadeRejectsBadCommonPrefix) {
  PAGEDATTN_REQUIRE_GPU();
  const ConformanceCase c = shared_prefix_cascade_case();
  const conformance::CaseInputs inputs = conformance::make_inputs(c, 7);
  for (const int bad : {264, 512}) {  // not a multiple of block_size; longer than request 0's context
    conformance::RunOptions options;
    options.common_prefix_len = bad;
    try {
      (void)conformance::prepare_run(cuda_backend(), Device::cuda, inputs, options);
      ADD_FAILURE() << "common_prefix_len = " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "common_prefix_len") << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

// build(fast_build = true) and build_for_drafting plan without the cascade and without split-KV
// (no combine items) and compute what build() computes, within the dtype's tolerance, on random
// inputs: a batch the normal build runs as a cascade and one it splits along the keys.
TEST(CudaConformance, FastBuildAndDraftingMatchTheNormalBuild) {
  PAGEDATTN_REQUIRE_GPU();
  const ConformanceCase cascade = shared_prefix_cascade_case();
  ConformanceCase split = cascade;
  split.cascade_prefix = 0;
  split.batch = {{700, 1}, {1500, 1}, {64, 1}, {2100, 1}};
  for (const ConformanceCase& c : {cascade, split}) {
    SCOPED_TRACE(c.describe());
    const conformance::CaseInputs inputs = conformance::make_inputs(c, 11);
    conformance::PreparedRun run = conformance::prepare_run(cuda_backend(), Device::cuda, inputs);
    const auto& normal_plan = dynamic_cast<const cuda::CudaAttentionMetadata&>(*run.step_metadata);
    if (c.cascade_prefix > 0) {
      EXPECT_TRUE(normal_plan.use_cascade);
    } else {
      EXPECT_GT(normal_plan.num_combine_items, 0) << "the normal build splits this batch";
    }
    conformance::execute(run);
    const conformance::BackendOutputs normal = conformance::collect(run);
    const CommonAttentionMetadata& common = run.step_common.common;
    for (int variant = 0; variant < 2; ++variant) {
      run.step_metadata = variant == 0 ? run.builder->build(c.cascade_prefix, common, true)
                                       : run.builder->build_for_drafting(common, 1);
      const auto& plan = dynamic_cast<const cuda::CudaAttentionMetadata&>(*run.step_metadata);
      EXPECT_FALSE(plan.use_cascade);
      EXPECT_EQ(plan.num_combine_items, 0);
      run.output.fill_bytes(0xFF);  // NaN: every row must be written again
      conformance::execute(run);
      const conformance::ConformanceResult r = conformance::compare(inputs, conformance::collect(run), normal);
      EXPECT_TRUE(r.passed()) << r.describe();
      EXPECT_LE(r.output_rel_error, conformance::tolerance(c));
    }
  }
}

// Fused fp8 output (output_store.cuh): a layer that asks for it selects CUDA; the output equals the
// REFERENCE's e4m3 output within the fp8 tolerance on a decode-only batch, a split-KV mixed batch
// and a cascade batch; an output_scale that is not a positive finite number (0, -1, inf, NaN,
// read on the device) makes every element NaN (e4m3 0x7F / 0xFF), never a finite wrong value.
TEST(CudaFp8Output, MatchesReferenceAndAnInvalidScaleGivesNaN) {
  PAGEDATTN_REQUIRE_GPU();
  AttentionLayerParams lp;
  lp.num_heads = 8;
  lp.head_size = 128;
  lp.num_kv_heads = 2;
  lp.device = Device::cuda;
  lp.fp8_output = true;
  Attention layer(lp);
  EXPECT_EQ(layer.backend().name(), "CUDA");
  EXPECT_TRUE(layer.impl().fused_output_quant_supported(QuantKey{}));
  ConformanceCase base;
  base.dtype = DType::bf16;
  base.head_size = 128;
  base.num_heads = 8;
  base.num_kv_heads = 2;
  base.fp8_output = true;
  base.return_lse = true;
  std::vector<ConformanceCase> cases(3, base);
  cases[0].batch = {{700, 1}, {1500, 1}, {64, 1}, {2100, 1}};  // decode-only, split
  cases[1].batch = {{2000, 1}, {40, 100}, {300, 7}};           // mixed, the prefill path
  cases[2] = shared_prefix_cascade_case();
  cases[2].fp8_output = true;
  for (const ConformanceCase& c : cases) {
    SCOPED_TRACE(c.describe());
    const conformance::CaseInputs inputs = conformance::make_inputs(c, 23);
    conformance::PreparedRun run = conformance::prepare_run(cuda_backend(), Device::cuda, inputs);
    conformance::execute(run);
    const conformance::ConformanceResult r = conformance::compare(
        inputs, conformance::collect(run), conformance::run_backend(conformance::reference(), Device::cpu, inputs));
    EXPECT_TRUE(r.passed()) << r.describe();
    for (float bad : {0.f, -1.f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      Tensor scale(Shape{1}, DType::f32, Device::cpu);
      scale.data_as<float>()[0] = bad;
      run.output_scale = scale.to(Device::cuda);
      run.output.fill_bytes(0);
      conformance::execute(run);
      const Tensor out = run.output.to(Device::cpu);
      const auto* bytes = static_cast<const uint8_t*>(out.data());
      int64_t not_nan = 0;
      for (int64_t i = 0; i < static_cast<int64_t>(inputs.num_actual_tokens) * c.num_heads * 128; ++i) {
        not_nan += (bytes[i] & 0x7F) != 0x7F ? 1 : 0;
      }
      EXPECT_EQ(not_nan, 0) << "output_scale = " << bad;
    }
  }
}

TEST(CudaConformance, HarnessGridMatchesReference) {
  PAGEDATTN_REQUIRE_GPU();
  if (small_grid()) GTEST_SKIP() << "PAGEDATTN_GPU_SMALL_GRID=1: the CUDA grid's sample only";
  const std::vector<ConformanceCase> grid = conformance::conformance_grid();
  int run = 0, skipped = 0;
  run_cases(grid, 0xC0FFEE, &run, &skipped);
  std::cout << "[ conformance ] CUDA: " << run << " of " << grid.size()
            << " harness-grid cases run (the rest are outside its capabilities)\n";
  EXPECT_GT(run, 0);
}

TEST(CudaConformance, ValidateConfigurationNamesWhatIsMissing) {
  const AttentionBackend& cuda = cuda_backend();
  SelectorConfig ok;
  ok.device = Device::cuda;
  ok.dtype = DType::bf16;
  ok.head_size = 128;
  ok.block_size = 16;
  if (cuda_device_count() > 0) {
    EXPECT_TRUE(cuda.validate_configuration(ok).empty());
  }
  const auto reasons_for = [&](auto mutate) {
    SelectorConfig c = ok;
    mutate(c);
    std::ostringstream all;
    for (const std::string& r : cuda.validate_configuration(c)) all << r << "\n";
    return all.str();
  };
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.head_size = 72; }).find("head_size = 72"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.block_size = 8; }).find("block_size = 8"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.dtype = DType::f32; }).find("dtype = float32"), std::string::npos);
  EXPECT_EQ(reasons_for([](SelectorConfig& c) { c.head_size_v = 64; }).find("head_size_v"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.head_size_v = 320; }).find("head_size_v = 320"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.head_size_v = 36; }).find("multiples of 8"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) {
              c.head_size_v = 40;
              c.kv_cache_dtype = "fp8";
            }).find("multiples of 16"),
            std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) {
              c.head_size = 72;
              c.head_size_v = 64;
            }).find("max(head_size, head_size_v) = 72"),
            std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.kv_cache_dtype = "float32"; }).find("kv_cache_dtype"),
            std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.use_mla = true; }).find("use_mla"), std::string::npos);
  EXPECT_EQ(reasons_for([](SelectorConfig& c) { c.fp8_output = true; }).find("fp8_output"), std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) {
              c.fp8_output = true;
              c.head_size_v = 40;
            }).find("fp8_output = true with head_size_v = 40"),
            std::string::npos);
  EXPECT_NE(reasons_for([](SelectorConfig& c) { c.device = Device::cpu; }).find("device = cpu"), std::string::npos);
}

// Host-only: a decode batch planned for the decode-only kernel's CTAs balances the waves. 1024
// equal items (128 requests x 8 kv heads, 4096 keys) on 396 CTAs would run in 3 waves with the
// last one 59% full; cut in 3 they fill 8 waves of 396 (97%), each (request, kv head) keeps its
// keys [0, 4096) covered once and gets a combine item. Without the decode-only kernel (264 CTAs,
// 3.9 waves) nothing is split; a batch with a prefill chunk is not a decode-only plan.
TEST(CudaPlanner, DecodePlanBalancesWaves) {
  using namespace pagedattn::cuda;
  PlannerConfig config;
  config.group_size = 4;
  config.num_kv_heads = 8;
  config.prefill_rows = 128;
  config.resident_ctas = 264;
  config.partial_rows_capacity = 1 << 20;
  config.max_work_items = 1 << 16;
  config.max_combine_items = 1 << 16;
  std::vector<int32_t> qsl = {0}, seq_lens;
  for (int r = 0; r < 128; ++r) {
    qsl.push_back(qsl.back() + 1);
    seq_lens.push_back(4096);
  }
  const AttentionPlan unified = make_attention_plan(config, qsl, seq_lens);
  EXPECT_FALSE(unified.decode_kernel);
  EXPECT_EQ(unified.items.size(), 1024u);
  EXPECT_TRUE(unified.combine.empty());

  config.decode_resident_ctas = 396;
  const AttentionPlan plan = make_attention_plan(config, qsl, seq_lens);
  EXPECT_TRUE(plan.decode_kernel);
  EXPECT_EQ(plan.items.size(), 3072u);
  ASSERT_EQ(plan.combine.size(), 1024u);
  std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> ranges;
  std::set<int> written_rows;
  for (const WorkItem& it : plan.items) {
    EXPECT_NE(it.flags & kItemDecodePath, 0);
    ASSERT_GE(it.partial_row, 0);
    for (int r = 0; r < it.num_rows; ++r) EXPECT_TRUE(written_rows.insert(it.partial_row + r).second);
    ranges[{it.request, it.kv_head}].push_back({it.kv_start, it.kv_end});
  }
  EXPECT_EQ(written_rows.size(), static_cast<size_t>(plan.partial_rows));
  for (auto& [key, list] : ranges) {
    std::sort(list.begin(), list.end());
    ASSERT_EQ(list.size(), 3u);
    int at = 0;
    for (const auto& [a, b] : list) {
      EXPECT_EQ(a, at);
      at = b;
    }
    EXPECT_EQ(at, 4096);
  }
  for (const CombineItem& c : plan.combine) EXPECT_EQ(c.num_splits, 3);

  // One request of 8192 keys: the best split leaves 3-tile chunks, which the unified kernel runs
  // (unless the decode-only kernel is forced).
  const std::vector<int32_t> one_qsl = {0, 1}, one_len = {8192};
  EXPECT_FALSE(make_attention_plan(config, one_qsl, one_len).decode_kernel);
  config.force_decode_kernel = true;
  EXPECT_TRUE(make_attention_plan(config, one_qsl, one_len).decode_kernel);
  config.force_decode_kernel = false;

  std::vector<int32_t> mixed_qsl = qsl, mixed_lens = seq_lens;
  mixed_qsl.push_back(mixed_qsl.back() + 40);
  mixed_lens.push_back(200);
  EXPECT_FALSE(make_attention_plan(config, mixed_qsl, mixed_lens).decode_kernel);
}

// Host-only: the cascade plan covers every (kv head, query row) exactly once with keys [0, P)
// through prefix items and [P, visible end) through the request's items, writes each partial row
// once, and each combine item points at the prefix states of its own rows.
TEST(CudaPlanner, CascadePlanCoversEveryRowOnce) {
  using namespace pagedattn::cuda;
  for (const int resident : {4, 1000}) {          // many items (no split) / few items (splits)
    for (const int group : {1, 4, 8}) {
      PlannerConfig config;
      config.group_size = group;
      config.num_kv_heads = 2;
      config.prefill_rows = 128;
      config.resident_ctas = resident;
      config.partial_rows_capacity = 1 << 20;
      config.max_work_items = 1 << 16;
      config.max_combine_items = 1 << 16;
      const int prefix = 320;
      const std::vector<int32_t> query_lens = {1, 3, 0, 40, 1, 1, 200, 2};
      std::vector<int32_t> qsl = {0}, seq_lens;
      for (size_t r = 0; r < query_lens.size(); ++r) {
        qsl.push_back(qsl.back() + query_lens[r]);
        seq_lens.push_back(prefix + 17 * static_cast<int>(r) + query_lens[r]);
      }
      const int T = qsl.back();
      const AttentionPlan plan = make_attention_plan(config, qsl, seq_lens, prefix);
      ASSERT_EQ(plan.cascade_prefix, prefix);
      ASSERT_GT(plan.prefix_items, 0);
      // Keys seen per (kv head, global row): prefix items and request items separately.
      std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> prefix_keys, own_keys;
      std::set<int> written_rows;
      int sink_owners = 0;
      for (const WorkItem& it : plan.items) {
        ASSERT_GE(it.partial_row, 0) << "cascade items always write partials";
        const bool is_prefix = it.kv_end <= prefix && it.seq_len == prefix + T;
        for (int r = 0; r < it.num_rows; ++r) {
          EXPECT_TRUE(written_rows.insert(it.partial_row + r).second) << "partial row written twice";
          EXPECT_LT(it.partial_row + r, plan.partial_rows);
          const int global = it.query_start * group + it.row_start + r;
          (is_prefix ? prefix_keys : own_keys)[{it.kv_head, global}].push_back({it.kv_start, it.kv_end});
        }
        if (is_prefix) {
          EXPECT_EQ(it.request, 0);
          EXPECT_EQ(it.flags & kItemOwnsSink, 0) << "the sink belongs to the request's own keys";
        } else if (it.flags & kItemOwnsSink) {
          sink_owners += it.num_rows;
        }
      }
      EXPECT_EQ(sink_owners, 2 * T * group) << "one sink owner per row";
      // The item ranges of a row tile chain from lo without gaps or overlap and reach at least
      // hi (an item's range is the union of its rows' ranges; the kernel masks each row).
      const auto covers = [](std::vector<std::pair<int, int>> ranges, int lo, int hi) {
        std::sort(ranges.begin(), ranges.end());
        int at = lo;
        for (const auto& [a, b] : ranges) {
          if (a != at || b < a) return false;
          at = b;
        }
        return at >= hi;
      };
      for (int g = 0; g < 2; ++g) {
        for (size_t r = 0; r < query_lens.size(); ++r) {
          for (int t = 0; t < query_lens[r]; ++t) {
            for (int h = 0; h < group; ++h) {
              const int global = (qsl[r] + t) * group + h;
              EXPECT_TRUE(covers(prefix_keys[{g, global}], 0, prefix)) << "g " << g << " row " << global;
              const int pos = seq_lens[r] - query_lens[r] + t;
              EXPECT_TRUE(covers(own_keys[{g, global}], prefix, pos + 1)) << "g " << g << " row " << global;
            }
          }
        }
      }
      // Combine items: one per request item group; prefix states of the same rows.
      int combined_rows = 0;
      for (const CombineItem& c : plan.combine) {
        EXPECT_EQ(c.prefix_splits, plan.prefix_splits);
        EXPECT_EQ(c.prefix_stride, 2 * T * group);
        combined_rows += c.num_rows;
        for (int s = 0; s < c.prefix_splits; ++s) {
          for (int r = 0; r < c.num_rows; ++r) {
            const int global = c.query_start * group + c.row_start + r;
            EXPECT_EQ(c.prefix_row + s * c.prefix_stride + r,
                      s * c.prefix_stride + c.kv_head * T * group + global);
          }
        }
      }
      EXPECT_EQ(combined_rows, 2 * T * group);
      if (resident == 1000) EXPECT_GT(plan.prefix_splits, 1) << "few items: the prefix is split";
    }
  }
}

}  // namespace
}  // namespace pagedattn
