// The REFERENCE backend's interface: selector reasons, capabilities, builder (plan) rules and
// bad-input errors of forward / do_kv_cache_update (the cache stays byte-identical on error).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "conformance/harness.h"

namespace pagedattn::conformance {
namespace {

bool mentions(const std::vector<std::string>& reasons, std::string_view text) {
  for (const std::string& r : reasons) {
    if (r.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(ReferenceBackend, IsRegisteredLastWithItsName) {
  const auto& backends = registered_backends();
  ASSERT_FALSE(backends.empty());
  // The last standard backend (MLA backends such as REFERENCE_MLA come after it).
  const AttentionBackend* last_standard = nullptr;
  for (const AttentionBackend* b : backends) {
    if (b->as_mla() == nullptr) last_standard = b;
  }
  ASSERT_NE(last_standard, nullptr);
  EXPECT_EQ(last_standard->name(), "REFERENCE");
  EXPECT_EQ(&reference(), last_standard);
  EXPECT_EQ(find_backend("reference"), last_standard);
}

TEST(ReferenceBackend, AcceptsEveryDocumentedConfiguration) {
  SelectorConfig config;
  config.device = Device::cpu;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const char* kv :
         {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"}) {
      for (int head_size : {1, 64, 80, 1024}) {
        for (int block_size : {1, 7, 16, 544}) {
          for (AttentionType type : {AttentionType::decoder, AttentionType::encoder,
                                     AttentionType::encoder_only, AttentionType::encoder_decoder}) {
            config.dtype = dtype;
            config.kv_cache_dtype = kv;
            config.head_size = head_size;
            config.block_size = block_size;
            config.attn_type = type;
            config.has_sink = true;
            config.use_logits_soft_cap = true;
            config.fp8_output = true;
            config.head_size_v = head_size == 1 ? 3 : head_size / 2;
            config.use_alibi = config.use_sliding_window = type != AttentionType::encoder_decoder;
            const auto reasons = reference().validate_configuration(config);
            EXPECT_TRUE(reasons.empty()) << reasons.front();
          }
        }
      }
    }
  }
}

TEST(ReferenceBackend, RejectsWithReasonsNamingTheValue) {
  const auto reasons_for = [](auto edit) {
    SelectorConfig config;
    config.device = Device::cpu;
    config.dtype = DType::f32;
    edit(config);
    return reference().validate_configuration(config);
  };
  auto r = reasons_for([](SelectorConfig& c) { c.device = Device::cuda; });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(mentions(r, "device = cuda"));
  r = reasons_for([](SelectorConfig& c) { c.use_mla = true; });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(mentions(r, "use_mla = true")) << r[0];
  EXPECT_TRUE(mentions(r, "MLA")) << r[0];
  r = reasons_for([](SelectorConfig& c) { c.use_sparse = true; });
  EXPECT_TRUE(mentions(r, "use_sparse = true"));
  r = reasons_for([](SelectorConfig& c) { c.dtype = DType::fp8_e4m3; });
  EXPECT_TRUE(mentions(r, "dtype = fp8_e4m3"));
  r = reasons_for([](SelectorConfig& c) { c.kv_cache_dtype = "int8"; });
  EXPECT_TRUE(mentions(r, "kv_cache_dtype = 'int8'"));
  EXPECT_TRUE(mentions(r, "fp8_e5m2"));
  r = reasons_for([](SelectorConfig& c) { c.head_size = 0; });
  EXPECT_TRUE(mentions(r, "head_size = 0"));
  r = reasons_for([](SelectorConfig& c) { c.head_size = 1025; });
  EXPECT_TRUE(mentions(r, "head_size = 1025"));
  r = reasons_for([](SelectorConfig& c) { c.head_size_v = 2048; });
  EXPECT_TRUE(mentions(r, "head_size_v = 2048"));
  r = reasons_for([](SelectorConfig& c) { c.block_size = 0; });
  EXPECT_TRUE(mentions(r, "block_size = 0"));
  r = reasons_for([](SelectorConfig& c) {
    c.attn_type = AttentionType::encoder_decoder;
    c.use_sliding_window = true;
    c.use_alibi = true;
  });
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(mentions(r, "encoder_decoder"));
  // Several problems: one reason each, every reason a sentence.
  r = reasons_for([](SelectorConfig& c) {
    c.device = Device::cuda;
    c.head_size = 0;
    c.kv_cache_dtype = "int4";
  });
  EXPECT_EQ(r.size(), 3u);
  for (const std::string& reason : r) EXPECT_EQ(reason.back(), '.') << reason;
}

TEST(ReferenceBackend, CapabilitiesListEveryFeature) {
  const BackendCapabilities caps = reference().capabilities();
  EXPECT_EQ(caps.devices, std::vector<Device>{Device::cpu});
  EXPECT_EQ(caps.dtypes.size(), 3u);
  EXPECT_EQ(caps.kv_cache_dtypes.size(), 7u);
  EXPECT_TRUE(caps.head_sizes.empty());
  EXPECT_EQ(caps.attn_types.size(), 4u);
  for (const char* feature : {"alibi", "sliding_window", "soft_cap", "sinks", "lse", "cascade",
                              "fp8_output", "head_size_v", "per_head_kv_scales"}) {
    EXPECT_NE(std::find(caps.features.begin(), caps.features.end(), feature), caps.features.end())
        << feature;
  }
  const auto sizes = reference().supported_kernel_block_sizes();
  ASSERT_EQ(sizes.size(), 1u);
  EXPECT_EQ(std::get<MultipleOf>(sizes[0]).base, 1);
}

TEST(ReferenceBackend, ImplAndBuilderRejectBadParameters) {
  AttentionImplParams p;
  p.num_heads = 4;
  p.head_size = 16;
  p.dtype = DType::f32;
  EXPECT_NO_THROW(reference().make_impl(p));
  const auto expect_error = [&](auto edit, const char* argument) {
    AttentionImplParams bad = p;
    edit(bad);
    try {
      reference().make_impl(bad);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  expect_error([](AttentionImplParams& q) { q.device = Device::cuda; }, "device");
  expect_error([](AttentionImplParams& q) { q.num_kv_heads = 3; }, "num_kv_heads");
  expect_error([](AttentionImplParams& q) { q.head_size = 2000; }, "head_size");
  expect_error([](AttentionImplParams& q) { q.alibi_slopes = {1.f}; }, "alibi_slopes");
  expect_error([](AttentionImplParams& q) { q.sinks = {1.f, 2.f}; }, "sinks");
  expect_error([](AttentionImplParams& q) { q.sliding_window = 0; }, "sliding_window");
  expect_error([](AttentionImplParams& q) { q.logits_soft_cap = -1.f; }, "logits_soft_cap");
  expect_error([](AttentionImplParams& q) { q.kv_cache_dtype = "fp4"; }, "kv_cache_dtype");
  expect_error([](AttentionImplParams& q) { q.dtype = DType::i32; }, "dtype");
  expect_error(
      [](AttentionImplParams& q) {
        q.attn_type = AttentionType::encoder_decoder;
        q.sliding_window = 4;
      },
      "sliding_window");

  const KVCacheSpec spec = KVCacheSpec::full_attention(16, 4, 16, DType::f32);
  BuilderConfig config;
  EXPECT_THROW(reference().make_builder(spec, config, Device::cuda), Error);
  const auto builder = reference().make_builder(spec, config, Device::cpu);
  EXPECT_TRUE(builder->supports_cascade());
  EXPECT_EQ(builder->reorder_batch_threshold(), 0);
  EXPECT_EQ(builder->cudagraph_support(), CudaGraphSupport::never);
  EXPECT_EQ(builder->workspace_bytes(), 0u);
}

// ---- builder (plan) ---------------------------------------------------------------------------

ConformanceCase small_decoder() {
  ConformanceCase c;
  c.head_size = 8;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.block_size = 4;
  c.return_lse = true;
  c.batch = {{9, 2}, {8, 1}, {12, 3}};
  return c;
}

TEST(ReferenceBuilder, CascadeRules) {
  ConformanceCase c = small_decoder();
  c.cascade_prefix = 8;
  const CaseInputs in = make_inputs(c, 11);
  // Accepted: 8 tokens = 2 shared blocks, cached by every request.
  EXPECT_TRUE(run_backend(reference(), Device::cpu, in).used_cascade);
  // Not a multiple of block_size.
  EXPECT_THROW(run_backend(reference(), Device::cpu, in, RunOptions{6}), Error);
  // Longer than request 1's num_computed_tokens (8).
  EXPECT_THROW(run_backend(reference(), Device::cpu, in, RunOptions{12}), Error);
  // Blocks not shared: the same batch without a prefix has distinct blocks per request.
  ConformanceCase unshared = small_decoder();
  const CaseInputs in2 = make_inputs(unshared, 12);
  try {
    run_backend(reference(), Device::cpu, in2, RunOptions{4});
    ADD_FAILURE() << "unshared prefix blocks accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "common_prefix_len");
    EXPECT_NE(std::string(e.what()).find("shared"), std::string::npos) << e.what();
  }
  // A window or ALiBi turns cascade off (the plain path runs).
  ConformanceCase windowed = c;
  windowed.sliding_window = 5;
  EXPECT_FALSE(run_backend(reference(), Device::cpu, make_inputs(windowed, 13)).used_cascade);
  ConformanceCase alibi = c;
  alibi.alibi = true;
  EXPECT_FALSE(run_backend(reference(), Device::cpu, make_inputs(alibi, 14)).used_cascade);
}

TEST(ReferenceBuilder, EncoderSeqLensMustEqualQueryLens) {
  ConformanceCase c = small_decoder();
  c.attn_type = AttentionType::encoder_only;
  c.batch = {{0, 3}, {0, 5}};
  PreparedRun run = prepare_run(reference(), Device::cpu, make_inputs(c, 3));
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 3, 8};
  args.seq_lens = {3, 6};
  args.max_num_blocks_per_req = 1;
  args.block_table = {0, 0};
  args.slot_mapping.assign(8, -1);
  args.causal = false;
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args);
  try {
    run.builder->build(0, common.common);
    ADD_FAILURE() << "seq_len != query_len accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "common.seq_lens");
  }
}

// The plan owns copies: changing the caller's arrays after build() changes nothing.
TEST(ReferenceBuilder, PlanCopiesTheHostArrays) {
  const CaseInputs in = make_inputs(small_decoder(), 21);
  const BackendOutputs expected = run_backend(reference(), Device::cpu, in);
  PreparedRun run = prepare_run(reference(), Device::cpu, in);
  OwnedCommonAttentionMetadata& common = run.step_common;
  std::memset(common.block_table.data(), 0, common.block_table.nbytes());
  std::memset(common.seq_lens_cpu.data(), 0, common.seq_lens_cpu.nbytes());
  std::memset(common.query_start_loc_cpu.data(), 0, common.query_start_loc_cpu.nbytes());
  execute(run);
  const BackendOutputs got = collect(run);
  const ConformanceResult r = compare(in, got, expected);
  EXPECT_EQ(r.output_rel_error, 0.0);
  EXPECT_EQ(r.lse_rel_error, 0.0);
}

// ---- bad inputs: Error naming the argument, cache untouched ---------------------------------

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

class ReferenceBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    inputs_ = make_inputs(small_decoder(), 31);
    run_ = prepare_run(reference(), Device::cpu, inputs_);
    cache_before_ = bytes_of(run_.kv_cache);
    output_before_ = bytes_of(run_.output);
  }
  // Calls the impl's forward with one argument replaced; expects an Error naming `argument` and
  // no byte of the cache or the output changed.
  template <typename Call>
  void expect_rejected(Call call, const char* argument) {
    try {
      call();
      ADD_FAILURE() << "accepted a bad " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_NE(std::string(e.what()).size(), 0u);
    }
    EXPECT_EQ(bytes_of(run_.kv_cache), cache_before_) << "cache changed on error";
    EXPECT_EQ(bytes_of(run_.output), output_before_) << "output changed on error";
  }
  AttentionImpl& impl() { return run_.impl(); }
  const LayerScales& scales() { return run_.scales(); }
  void forward(const TensorView& query, const TensorView& kv_cache, const TensorView& output,
               const TensorView& output_scale = {}, const TensorView& output_lse = {}) {
    impl().forward(scales(), query, run_.key, run_.value, kv_cache, *run_.step_metadata, output,
                   output_scale, output_lse);
  }
  CaseInputs inputs_;
  PreparedRun run_;
  std::vector<uint8_t> cache_before_, output_before_;
};

TEST_F(ReferenceBadInput, ForwardChecksEveryTensor) {
  const TensorView q = run_.query, cache = run_.kv_cache, out = run_.output;
  Tensor q_f16(q.shape(), DType::f16);
  expect_rejected([&] { forward(q_f16, cache, out); }, "query");
  Tensor q_heads(Shape{q.size(0), 3, q.size(2)}, DType::f32);
  expect_rejected([&] { forward(q_heads, cache, out); }, "query");
  Tensor q_short(Shape{1, q.size(1), q.size(2)}, DType::f32);
  expect_rejected([&] { forward(q_short, cache, out); }, "query");
  Tensor out_dv(Shape{out.size(0), out.size(1), out.size(2) + 1}, DType::f32);
  expect_rejected([&] { forward(q, cache, out_dv); }, "output");
  Tensor out_bf16(out.shape(), DType::bf16);
  expect_rejected([&] { forward(q, cache, out_bf16); }, "output");
  Tensor scale(Shape{1}, DType::f32);
  scale.data_as<float>()[0] = 0.5f;
  expect_rejected([&] { forward(q, cache, out, scale); }, "output");  // not fp8
  Tensor out_fp8(out.shape(), DType::fp8_e4m3);
  scale.data_as<float>()[0] = 0.f;
  expect_rejected([&] { forward(q, cache, out_fp8, scale); }, "output_scale");
  Tensor lse_bad(Shape{3, out.size(0)}, DType::f32);
  expect_rejected([&] { forward(q, cache, out, {}, lse_bad); }, "output_lse");
  Tensor cache_f16(cache.shape(), DType::f16);
  expect_rejected([&] { forward(q, cache_f16, out); }, "kv_cache");
  Tensor cache_bs(Shape{2, cache.size(1), cache.size(2) * 2, cache.size(3), cache.size(4)},
                  DType::f32);
  expect_rejected([&] { forward(q, cache_bs, out); }, "kv_cache");
  expect_rejected([&] { forward(q, TensorView(), out); }, "kv_cache");
  // A cache with fewer blocks than the block table names.
  const TensorView few_blocks = cache.narrow(1, 0, 2);
  expect_rejected([&] { forward(q, few_blocks, out); }, "metadata");
}

TEST_F(ReferenceBadInput, ForwardRejectsForeignMetadataAndBadScales) {
  struct ForeignMetadata : AttentionMetadata {};
  ForeignMetadata foreign;
  foreign.num_actual_tokens = run_.step_metadata->num_actual_tokens;
  expect_rejected(
      [&] {
        impl().forward(scales(), run_.query, run_.key, run_.value, run_.kv_cache, foreign,
                       run_.output);
      },
      "metadata");
  LayerScales per_head = scales();
  Tensor wrong(Shape{3}, DType::f32);
  per_head.k_scale_per_head = wrong;
  expect_rejected(
      [&] {
        impl().forward(per_head, run_.query, run_.key, run_.value, run_.kv_cache,
                       *run_.step_metadata, run_.output);
      },
      "scales.k_scale_per_head");
}

TEST_F(ReferenceBadInput, CacheUpdateChecksBeforeWriting) {
  const TensorView key = run_.key, value = run_.value, cache = run_.kv_cache;
  const AttentionMetadata& md = *run_.step_metadata;
  Tensor key_heads(Shape{key.size(0), 2, key.size(2)}, DType::f32);
  expect_rejected([&] { impl().do_kv_cache_update(scales(), key_heads, value, cache, md); }, "key");
  Tensor key_f16(key.shape(), DType::f16);
  expect_rejected([&] { impl().do_kv_cache_update(scales(), key_f16, value, cache, md); }, "key");
  // Fewer rows than live slots.
  const TensorView key_short = key.narrow(0, 0, 1), value_short = value.narrow(0, 0, 1);
  expect_rejected([&] { impl().do_kv_cache_update(scales(), key_short, value_short, cache, md); },
                  "key");
  Tensor cache_f16(cache.shape(), DType::f16);
  expect_rejected([&] { impl().do_kv_cache_update(scales(), key, value, cache_f16, md); },
                  "kv_cache");
  expect_rejected([&] { impl().do_kv_cache_update(scales(), key, TensorView(), cache, md); },
                  "value");
  // No key/value while slots are live.
  expect_rejected(
      [&] { impl().do_kv_cache_update(scales(), TensorView(), TensorView(), cache, md); }, "key");
  // Blocks and slots beyond the cache: the same step metadata on a 2-block cache (the plan's
  // footprint names the first entry that does not fit: a block id or a slot).
  const TensorView few_blocks = cache.narrow(1, 0, 2);
  try {
    impl().do_kv_cache_update(scales(), key, value, few_blocks, md);
    ADD_FAILURE() << "slot outside the cache accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is out of range"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bytes_of(run_.kv_cache), cache_before_);
  // And the good call still works afterwards and writes.
  impl().do_kv_cache_update(scales(), key, value, cache, md);
  EXPECT_NE(bytes_of(run_.kv_cache), cache_before_);
}

}  // namespace
}  // namespace pagedattn::conformance
