// The cross-backend conformance suite: every registered backend (except the REFERENCE itself)
// that is usable on the CPU runs the grid against the REFERENCE. The grid is the CI one unless
// PAGEDATTN_FULL_GRID=1. GPU backends plug in from tests/gpu with the same harness.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <sstream>

#include "conformance/harness.h"

namespace pagedattn::conformance {
namespace {

uint64_t case_seed(size_t index) { return 0xC0FFEE + 7919 * static_cast<uint64_t>(index); }

bool is_reference(const AttentionBackend& backend) { return backend.name() == "REFERENCE"; }

TEST(Conformance, EveryCpuBackendMatchesTheReference) {
  const std::vector<ConformanceCase> grid = conformance_grid();
  int backends_run = 0;
  std::ostringstream not_run;
  for (const AttentionBackend* backend : registered_backends()) {
    if (is_reference(*backend)) continue;
    int cases_run = 0;
    std::string first_reason;
    for (size_t i = 0; i < grid.size(); ++i) {
      const std::vector<std::string> reasons = unsupported_reasons(*backend, Device::cpu, grid[i]);
      if (!reasons.empty()) {
        if (first_reason.empty()) first_reason = reasons.front();
        continue;
      }
      ++cases_run;
      try {
        const ConformanceResult result = run_case(*backend, Device::cpu, grid[i], case_seed(i));
        EXPECT_TRUE(result.passed()) << result.describe();
      } catch (const std::exception& e) {
        ADD_FAILURE() << backend->name() << " [" << grid[i].describe() << "] threw: " << e.what();
      }
    }
    if (cases_run > 0) {
      ++backends_run;
      std::cout << "[ conformance ] " << backend->name() << ": " << cases_run << " of "
                << grid.size() << " cases run on the cpu\n";
    } else {
      not_run << " " << backend->name() << " (" << first_reason << ")";
    }
  }
  if (backends_run == 0) {
    GTEST_SKIP() << "no backend: no registered backend other than REFERENCE is usable on the cpu "
                    "for any case of the grid;"
                 << (not_run.str().empty() ? " none registered" : not_run.str());
  }
}

// The harness itself: REFERENCE against REFERENCE must agree exactly on every grid case, write
// every element, and take the cascade path exactly when the case has a prefix.
TEST(ConformanceHarness, ReferenceAgainstItselfIsExact) {
  const std::vector<ConformanceCase> grid = conformance_grid();
  ASSERT_GE(grid.size(), 40u);
  for (size_t i = 0; i < grid.size(); ++i) {
    const ConformanceResult result = run_case(reference(), Device::cpu, grid[i], case_seed(i));
    SCOPED_TRACE(result.describe());
    EXPECT_TRUE(result.passed());
    EXPECT_EQ(result.output_rel_error, 0.0);
    EXPECT_EQ(result.lse_rel_error, 0.0);
    EXPECT_TRUE(result.all_written);
    EXPECT_EQ(result.cache_compared, uses_kv_cache(grid[i].attn_type));
    EXPECT_EQ(result.used_cascade, grid[i].cascade_prefix > 0);
  }
}

// The grid covers what DESIGN §6 lists.
TEST(ConformanceHarness, CiGridCoversTheFeatureAxes) {
  const std::vector<ConformanceCase> grid = conformance_grid(false);
  const auto any = [&grid](auto predicate) {
    return std::any_of(grid.begin(), grid.end(), predicate);
  };
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    EXPECT_TRUE(any([dtype](const ConformanceCase& c) { return c.dtype == dtype; }));
  }
  for (AttentionType type : {AttentionType::decoder, AttentionType::encoder,
                             AttentionType::encoder_only, AttentionType::encoder_decoder}) {
    EXPECT_TRUE(any([type](const ConformanceCase& c) { return c.attn_type == type; }));
  }
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.num_kv_heads < c.num_heads; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.num_kv_heads == 1; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.layout == KVCacheLayout::HND; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.block_size == 1; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.sliding_window.has_value(); }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.soft_cap.has_value(); }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.alibi; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.sinks; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.return_lse; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.fp8_output; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.kv_cache_dtype == "fp8_e4m3"; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.kv_cache_dtype == "fp8_e5m2"; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.per_head_kv_scales; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.value_head_size() < c.head_size; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.value_head_size() > c.head_size; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.cascade_prefix > 0; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.pad_tokens > 0; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.head_size >= 128; }));
  const auto has_shape = [&any](auto predicate) {
    return any([&predicate](const ConformanceCase& c) {
      return std::any_of(c.batch.begin(), c.batch.end(), predicate);
    });
  };
  EXPECT_TRUE(has_shape([](const RequestShape& s) { return s.query_len == 0; }));
  EXPECT_TRUE(
      has_shape([](const RequestShape& s) { return s.query_len == 1 && s.context_len > 0; }));
  EXPECT_TRUE(has_shape([](const RequestShape& s) { return s.query_len >= 32; }));
  EXPECT_TRUE(
      has_shape([](const RequestShape& s) { return s.query_len > 1 && s.context_len > 0; }));
  EXPECT_GT(conformance_grid(true).size(), grid.size() * 10);
}

// The comparison can fail: a wrong element, an unwritten element, a wrong LSE and a wrong cache
// entry are each caught.
TEST(ConformanceHarness, CompareDetectsEveryKindOfError) {
  ConformanceCase c;
  c.head_size = 16;
  c.return_lse = true;
  c.batch = {{5, 3}, {0, 2}};
  const CaseInputs inputs = make_inputs(c, 42);
  const BackendOutputs ref = run_backend(reference(), Device::cpu, inputs);
  ASSERT_TRUE(compare(inputs, ref, ref).passed());

  const auto rerun = [&] { return run_backend(reference(), Device::cpu, inputs); };
  {
    BackendOutputs bad = rerun();
    store_f32(bad.output.data(), bad.output.dtype(), 7,
              load_f32(bad.output.data(), bad.output.dtype(), 7) + 0.5f);
    const ConformanceResult r = compare(inputs, bad, ref);
    EXPECT_FALSE(r.passed());
    EXPECT_GT(r.output_rel_error, tolerance(c));
  }
  {
    BackendOutputs bad = rerun();
    bad.output.data_as<uint32_t>()[3] = 0xFFFFFFFFu;  // poison left behind
    const ConformanceResult r = compare(inputs, bad, ref);
    EXPECT_FALSE(r.passed());
    EXPECT_EQ(r.unwritten, 1);
  }
  {
    BackendOutputs bad = rerun();
    bad.output_lse.data_as<float>()[1] = -std::numeric_limits<float>::infinity();
    EXPECT_EQ(compare(inputs, bad, ref).lse_inf_mismatches, 1);
    bad = rerun();
    bad.output_lse.data_as<float>()[2] += 0.25f;
    EXPECT_FALSE(compare(inputs, bad, ref).passed());
  }
  {
    BackendOutputs bad = rerun();
    const int64_t slot = inputs.step_slot_mapping[0];
    const TensorView cache = bad.kv_cache.view();
    const int64_t offset =
        (slot / c.block_size) * cache.stride(1) + (slot % c.block_size) * cache.stride(2);
    store_f32(cache.data(), cache.dtype(), offset,
              load_f32(cache.data(), cache.dtype(), offset) + 1.f);
    const ConformanceResult r = compare(inputs, bad, ref);
    EXPECT_TRUE(r.cache_compared);
    EXPECT_EQ(r.cache_mismatches, 1);
    EXPECT_FALSE(r.passed());
  }
}

// Inputs are random, never zero, shuffled into distinct blocks, and the cascade prefix blocks
// are shared.
TEST(ConformanceHarness, InputsArePagedRandomAndShared) {
  ConformanceCase c;
  c.head_size = 8;
  c.block_size = 4;
  c.cascade_prefix = 8;
  c.batch = {{9, 2}, {12, 1}, {8, 0}};
  const CaseInputs in = make_inputs(c, 5);
  int64_t zeros = 0;
  for (int64_t i = 0; i < in.query.numel(); ++i)
    zeros += load_f32(in.query.data(), c.dtype, i) == 0.f;
  EXPECT_EQ(zeros, 0);
  const int cols = in.block_table_cols;
  std::vector<int> owners(static_cast<size_t>(in.num_blocks), 0);
  for (int r = 0; r < in.num_reqs(); ++r) {
    const int used = (in.seq_lens[r] + c.block_size - 1) / c.block_size;
    for (int b = 0; b < used; ++b) {
      const int32_t id = in.block_table[static_cast<size_t>(r * cols + b)];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, in.num_blocks);
      if (b < 2) {
        EXPECT_EQ(id, in.block_table[static_cast<size_t>(b)]) << "prefix block not shared";
      } else {
        ++owners[static_cast<size_t>(id)];
      }
    }
  }
  for (int owners_of_block : owners) EXPECT_LE(owners_of_block, 1);
  bool sorted = true;
  for (int b = 1; b < 3; ++b) sorted = sorted && in.block_table[b] == in.block_table[b - 1] + 1;
  EXPECT_FALSE(sorted && in.block_table[0] == 0) << "block ids were not shuffled";
}

// ---- test doubles: backends that are the REFERENCE with one property changed ----------------

struct DoubleOptions {
  bool decodes_first = false;  // its builder reorders (threshold 1) and rejects unordered batches
  bool hnd_only = false;       // its cache is always HND, whatever the layout setting
  std::function<void(AttentionImplParams&)> break_params;  // a feature the impl "forgets"
  bool leave_last_row = false;  // the last live output row is left unwritten
};

class DoubleImpl final : public AttentionImpl {
 public:
  DoubleImpl(const AttentionImplParams& params, std::unique_ptr<AttentionImpl> inner,
             bool leave_last_row)
      : AttentionImpl(params), inner_(std::move(inner)), leave_last_row_(leave_last_row) {}
  void do_kv_cache_update(const LayerScales& scales, const TensorView& key, const TensorView& value,
                          const TensorView& kv_cache, const AttentionMetadata& metadata) override {
    inner_->do_kv_cache_update(scales, key, value, kv_cache, metadata);
  }
  void check_forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
                     const TensorView& value, const TensorView& kv_cache,
                     const AttentionMetadata& metadata, const TensorView& output,
                     const TensorView& output_scale,
                     const TensorView& output_lse) const override {
    inner_->check_forward(scales, query, key, value, kv_cache, metadata, output, output_scale,
                          output_lse);
  }
  void forward(const LayerScales& scales, const TensorView& query, const TensorView& key,
               const TensorView& value, const TensorView& kv_cache,
               const AttentionMetadata& metadata, const TensorView& output,
               const TensorView& output_scale, const TensorView& output_lse) override {
    inner_->forward(scales, query, key, value, kv_cache, metadata, output, output_scale,
                    output_lse);
    if (leave_last_row_ && metadata.num_actual_tokens > 0) {
      const TensorView row = output.select(0, metadata.num_actual_tokens - 1);
      std::memset(row.data(), 0xFF, row.span_bytes());
    }
  }
  bool fused_output_quant_supported(const QuantKey& key) const override {
    return inner_->fused_output_quant_supported(key);
  }

 private:
  std::unique_ptr<AttentionImpl> inner_;
  bool leave_last_row_;
};

class DoubleBuilder final : public AttentionMetadataBuilder {
 public:
  explicit DoubleBuilder(std::unique_ptr<AttentionMetadataBuilder> inner)
      : AttentionMetadataBuilder(inner->kv_cache_spec()), inner_(std::move(inner)) {}
  std::shared_ptr<const AttentionMetadata> build(int common_prefix_len,
                                                 const CommonAttentionMetadata& common,
                                                 bool fast_build) override {
    // A backend that relies on decodes coming first (as vLLM's reorder contract promises).
    bool seen_prefill = false;
    for (int r = 0; r < common.num_reqs; ++r) {
      const bool decode = common.query_len(r) <= 1;
      PAGEDATTN_CHECK(!(decode && seen_prefill), "common", "DOUBLE: request ", r,
                      " is a decode after a prefill: the batch was not reordered");
      seen_prefill = seen_prefill || !decode;
    }
    ++builds;
    return inner_->build(common_prefix_len, common, fast_build);
  }
  int reorder_batch_threshold() const override { return 1; }
  bool supports_cascade() const override { return true; }
  static inline int builds = 0;

 private:
  std::unique_ptr<AttentionMetadataBuilder> inner_;
};

class DoubleBackend final : public AttentionBackend {
 public:
  explicit DoubleBackend(DoubleOptions options) : options_(std::move(options)) {}
  std::string_view name() const override { return "TEST_DOUBLE"; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    AttentionImplParams changed = params;
    if (options_.break_params) options_.break_params(changed);
    return std::make_unique<DoubleImpl>(params, reference().make_impl(changed),
                                        options_.leave_last_row);
  }
  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    auto inner = reference().make_builder(spec, config, device);
    if (!options_.decodes_first) return inner;
    return std::make_unique<DoubleBuilder>(std::move(inner));
  }
  std::vector<int> kv_cache_stride_order() const override {
    return options_.hnd_only ? standard_kv_cache_stride_order(KVCacheLayout::HND)
                             : reference().kv_cache_stride_order();
  }
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return reference().supported_kernel_block_sizes();
  }
  std::vector<std::string> validate_configuration(const SelectorConfig& config) const override {
    return reference().validate_configuration(config);
  }
  BackendCapabilities capabilities() const override { return reference().capabilities(); }

 private:
  DoubleOptions options_;
};

// A correct backend with a different cache layout and a decodes-first builder passes exactly:
// the harness reorders the batch for it and reads its cache through its own strides.
TEST(ConformanceHarness, ReorderingHndBackendPassesExactly) {
  const DoubleBackend backend(DoubleOptions{.decodes_first = true, .hnd_only = true});
  const std::vector<ConformanceCase> grid = conformance_grid(false);
  DoubleBuilder::builds = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    const ConformanceResult result = run_case(backend, Device::cpu, grid[i], case_seed(i));
    EXPECT_TRUE(result.passed()) << result.describe();
    EXPECT_EQ(result.output_rel_error, 0.0) << result.describe();
  }
  EXPECT_GT(DoubleBuilder::builds, static_cast<int>(grid.size()));
}

// A backend that forgets a feature, or leaves a row unwritten, fails the cases that use it.
TEST(ConformanceHarness, BrokenBackendsFail) {
  const auto fails_on = [](const DoubleBackend& backend, auto select) {
    const std::vector<ConformanceCase> grid = conformance_grid(false);
    int checked = 0;
    for (size_t i = 0; i < grid.size(); ++i) {
      if (!select(grid[i])) continue;
      const ConformanceResult result = run_case(backend, Device::cpu, grid[i], case_seed(i));
      EXPECT_FALSE(result.passed()) << "not caught: " << result.describe();
      ++checked;
    }
    EXPECT_GT(checked, 0);
  };
  fails_on(DoubleBackend({.break_params = [](AttentionImplParams& p) { p.sinks.clear(); }}),
           [](const ConformanceCase& c) { return c.sinks; });
  fails_on(
      DoubleBackend({.break_params = [](AttentionImplParams& p) { p.sliding_window.reset(); }}),
      [](const ConformanceCase& c) { return c.sliding_window.has_value(); });
  fails_on(
      DoubleBackend({.break_params = [](AttentionImplParams& p) { p.logits_soft_cap.reset(); }}),
      [](const ConformanceCase& c) { return c.soft_cap.has_value(); });
  fails_on(DoubleBackend({.break_params =
                              [](AttentionImplParams& p) {
                                for (float& slope : p.alibi_slopes) slope *= 1.05f;
                              }}),
           [](const ConformanceCase& c) { return c.alibi; });
  fails_on(DoubleBackend({.break_params = [](AttentionImplParams& p) { p.scale *= 1.001f; }}),
           [](const ConformanceCase& c) {
             return c.dtype == DType::f32 && !c.fp8_kv() && !c.fp8_output;
           });
  fails_on(DoubleBackend({.leave_last_row = true}),
           [](const ConformanceCase& c) { return c.attn_type == AttentionType::decoder; });
}

}  // namespace
}  // namespace pagedattn::conformance
