// Fused fp8 e4m3 output of MLA layers (output_scale): REFERENCE_MLA's e4m3 output against its own
// activation-dtype output quantized on the host, on decode, prefill and mixed batches with
// chunked context, into poisoned outputs; the argument errors (each naming its argument, the
// cache left byte-identical); the selector (fp8_output picks a backend that supports it, CPU_MLA
// says why it does not); the host quantize pass of MLACommonImpl. MLACommonImpl's staged writes
// against REFERENCE_MLA run in test_mla_attention.cpp (MLADriver, the grid's fp8-output cases);
// CUDA_MLA in tests/gpu/test_gpu_mla_fp8_output.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../../src/backends/mla/mla_common.h"
#include "backends/ops_test_util.h"
#include "conformance/mla_harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

namespace cm = conformance::mla;

using testing_ops::expect_error;

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

cm::MLACase make_case(const char* name, DType dtype, std::vector<cm::MLARequest> batch,
                      int64_t workspace_tokens = 0) {
  cm::MLACase c;
  c.name = name;
  c.dtype = dtype;
  c.batch = std::move(batch);
  c.workspace_tokens = workspace_tokens;
  return c;
}

// The batches of the checks: decodes only, new tokens only, and decodes + a prefill without
// context + one whose context takes 3 chunks (W = 64 tokens).
std::vector<cm::MLACase> batches(DType dtype) {
  return {make_case("decode", dtype, {{40, 1}, {17, 1}, {3, 1}}),
          make_case("prefill", dtype, {{0, 7}, {0, 3}}),
          make_case("mixed-chunked", dtype, {{30, 1}, {5, 1}, {0, 4}, {140, 3}}, 64)};
}

// ---- REFERENCE_MLA: e4m3 output = its own output quantized ------------------------------------

// REFERENCE_MLA stores saturate_e4m3(o / scale) from the fp64 o, rounded once; the host quantizes
// the activation-dtype output (o rounded once to f32 / bf16), so the two may differ by one e4m3
// step where that first rounding crossed an e4m3 rounding boundary: rarely from f32 (2^-24
// relative), about 1 element in 32 from bf16 (a bf16 value on an e4m3 midpoint).
TEST(MLAFp8Output, ReferenceMlaIsItsOwnOutputQuantized) {
  const AttentionBackend* ref = find_backend("REFERENCE_MLA");
  ASSERT_NE(ref, nullptr);
  uint64_t seed = 41;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (cm::MLACase c : batches(dtype)) {
      for (const float scale : {1.f / 64.f, 1.f / 2048.f}) {  // the second saturates many
        SCOPED_TRACE(c.describe() + " scale " + std::to_string(scale));
        c.output_scale = 0.f;
        const cm::MLAOutputs act = cm::run_mla_outputs(*ref, "", Device::cpu, c, seed);
        c.output_scale = scale;
        const cm::MLAOutputs fp8 = cm::run_mla_outputs(*ref, "", Device::cpu, c, seed);
        ASSERT_EQ(fp8.output.dtype(), DType::fp8_e4m3);
        const int64_t n = act.num_actual_tokens * c.num_heads * c.dims.v_head_dim;
        const cm::QuantizedComparison r = cm::compare_with_quantized(fp8.output, act.output, scale, n);
        std::printf("%s scale %g: %s\n", c.describe().c_str(), scale, r.describe().c_str());
        EXPECT_EQ(r.unwritten, 0) << r.describe();  // the output was poisoned with NaN bytes
        EXPECT_LE(r.max_steps, 1) << r.describe();
        EXPECT_LE(r.mismatches, dtype == DType::f32 ? n / 200 : n / 8) << r.describe();
        if (scale < 1.f / 1024.f) {
          EXPECT_GT(r.saturated, 0) << r.describe();
        }
        // The LSE and the cache do not depend on the output's quantization.
        EXPECT_TRUE(same_bytes(act.lse, fp8.lse));
        EXPECT_TRUE(same_bytes(act.cache, fp8.cache));
        ++seed;
      }
    }
  }
}

// The same function through the harness (REFERENCE_MLA against itself): exact.
TEST(MLAFp8Output, ReferenceMlaThroughTheHarness) {
  const AttentionBackend* ref = find_backend("REFERENCE_MLA");
  ASSERT_NE(ref, nullptr);
  for (cm::MLACase c : batches(DType::bf16)) {
    c.output_scale = 1.f / 32.f;
    const cm::MLAResult r = cm::run_mla_case(*ref, "", Device::cpu, c, 5);
    EXPECT_TRUE(r.passed()) << r.describe();
    EXPECT_EQ(r.output_rel_error, 0.0) << r.describe();
  }
}

// ---- argument errors ----------------------------------------------------------------------


Tensor filled(Shape shape, DType dtype, float value) {
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, value + 0.001f * static_cast<float>(i % 97));
  return t;
}

Tensor scalar(float value, DType dtype = DType::f32) {
  Tensor t(Shape{1}, dtype);
  store_f32(t.data(), dtype, 0, value);
  return t;
}

// A decode and a 2-token prefill over a 4-block cache, on `backend` (REFERENCE_MLA or CPU_MLA).
struct Fixture {
  explicit Fixture(const std::string& backend)
      : layer(cm::small_mla_layer_params(backend, DType::bf16)),
        cache(layer.allocate_kv_cache(4)),
        q(filled(Shape{3, 4, 48}, DType::bf16, 0.1f)),
        kv(filled(Shape{3, 64}, DType::bf16, -0.2f)),
        pe(filled(Shape{3, 16}, DType::bf16, 0.3f)),
        out(Shape{3, 4, 32}, DType::bf16),
        out8(Shape{3, 4, 32}, DType::fp8_e4m3) {
    layer.process_weights_after_loading(filled(Shape{4 * 64, 64}, DType::bf16, 0.01f));
    cache.fill_bytes(0x11);
    common = std::make_unique<OwnedCommonAttentionMetadata>(cm::small_mla_step_metadata());
    builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2, 8, 64), Device::cpu);
    plan = builder->build(0, common->common);
  }
  // Runs the layer's forward and expects an Error naming `argument`, the cache unchanged.
  void expect_rejected(const TensorView& output, const TensorView& scale, const std::string& argument,
                       const std::string& part = "") {
    const Tensor before = cache.to(Device::cpu);
    expect_error([&] { layer.forward(q, kv, pe, cache, *plan, output, {}, scale); }, argument, part);
    EXPECT_TRUE(same_bytes(before, cache)) << "a rejected forward wrote the cache";
  }
  MLAAttention layer;
  Tensor cache, q, kv, pe, out, out8;
  std::unique_ptr<OwnedCommonAttentionMetadata> common;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  std::shared_ptr<const AttentionMetadata> plan;
};

TEST(MLAFp8Output, ArgumentErrorsNameTheArgumentAndLeaveTheCache) {
  Fixture f("REFERENCE_MLA");
  EXPECT_TRUE(f.layer.impl().fused_output_quant_supported(QuantKey{}));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float bad : {0.f, -1.f, nan, std::numeric_limits<float>::infinity()}) {
    f.expect_rejected(f.out8, scalar(bad), "output_scale", "positive finite");
  }
  f.expect_rejected(f.out8, scalar(0.5f, DType::f16), "output_scale", "float32 (1,)");
  f.expect_rejected(f.out8, Tensor(Shape{2}, DType::f32), "output_scale", "float32 (1,)");
  f.expect_rejected(f.out, scalar(0.5f), "output", "expected fp8_e4m3 when output_scale is given");
  f.expect_rejected(f.out8, {}, "output", "expected the layer dtype");
  // The impl's own checks (a direct caller of forward): the same errors.
  MLAAttentionImpl& impl = f.layer.impl();
  expect_error([&] { impl.forward(f.layer.scales(), f.q, f.kv, f.pe, f.cache, *f.plan, f.out8, scalar(-2.f)); },
               "output_scale");
  expect_error([&] { impl.forward(f.layer.scales(), f.q, f.kv, f.pe, f.cache, *f.plan, f.out, scalar(2.f)); },
               "output");
  // Valid: every element written, no error.
  f.out8.fill_bytes(0x7F);
  EXPECT_NO_THROW(f.layer.forward(f.q, f.kv, f.pe, f.cache, *f.plan, f.out8, {}, scalar(0.25f)));
  for (int64_t i = 0; i < f.out8.numel(); ++i) {
    ASSERT_NE(static_cast<const uint8_t*>(f.out8.data())[i] & 0x7F, 0x7F) << "element " << i << " unwritten";
  }
}

TEST(MLAFp8Output, BackendWithoutItIsAnErrorNamingOutputScale) {
  Fixture f("CPU_MLA");
  EXPECT_FALSE(f.layer.impl().fused_output_quant_supported(QuantKey{}));
  f.expect_rejected(f.out8, scalar(0.5f), "output_scale", "CPU_MLA does not support fused fp8 output");
  // MLACommonImpl refuses it too when called directly.
  expect_error([&] {
    f.layer.impl().forward(f.layer.scales(), f.q, f.kv, f.pe, f.cache, *f.plan, f.out8, scalar(0.5f));
  }, "output_scale", "does not support fused fp8 output");
}

// ---- selector ------------------------------------------------------------------------------

TEST(MLAFp8Output, SelectorTakesABackendThatSupportsIt) {
  // DeepSeek dims on the cpu: CPU_MLA comes first without fp8_output.
  MLAAttentionLayerParams p = cm::small_mla_layer_params("", DType::bf16);
  p.kv_lora_rank = 512;
  p.qk_nope_head_dim = 128;
  p.qk_rope_head_dim = 64;
  p.qk_head_dim = 192;
  p.v_head_dim = 128;
  p.block_size = 64;
  EXPECT_EQ(MLAAttention(p).backend().name(), "CPU_MLA");
  p.fp8_output = true;
  MLAAttention layer(p);
  EXPECT_EQ(layer.backend().name(), "REFERENCE_MLA");
  EXPECT_TRUE(layer.selector_config().fp8_output);
  EXPECT_TRUE(layer.impl().fused_output_quant_supported(QuantKey{}));
  const std::string expected =
      "fp8_output = true is not supported: CPU_MLA writes its output in the activation dtype.";
  bool explained = false;
  for (const BackendReport& r : explain_backends(layer.selector_config())) {
    if (r.backend->name() == "CPU_MLA") {
      explained = std::find(r.reasons.begin(), r.reasons.end(), expected) != r.reasons.end();
    }
    if (r.backend->name() == "REFERENCE_MLA") EXPECT_TRUE(r.usable());
  }
  EXPECT_TRUE(explained) << "CPU_MLA's reasons do not say why it cannot write fp8 output";
  p.backend = "CPU_MLA";  // forced without the feature: an Error listing the reason
  expect_error([&] { MLAAttention l(p); }, "backend", "CPU_MLA writes its output in the activation dtype");
  const auto features = [](const char* name) { return find_backend(name)->capabilities().features; };
  const auto has = [](const std::vector<std::string>& v, const char* f) {
    return std::find(v.begin(), v.end(), f) != v.end();
  };
  EXPECT_TRUE(has(features("REFERENCE_MLA"), "fp8_output"));
  EXPECT_FALSE(has(features("CPU_MLA"), "fp8_output"));
}

// ---- the quantize pass (host) -----------------------------------------------------------------

TEST(MLAFp8Output, HostQuantizePass) {
  // src (2, 2, 4) bf16 viewed with a padded row stride; dst (2, 2, 4) e4m3.
  Tensor src(Shape{2, 2, 6}, DType::bf16);
  const float values[] = {1.f, -1.f, 0.3f, 1000.f, -1000.f, 0.f, 0.01f, 3.f};
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t x = 0; x < 6; ++x) {
      store_f32(src.data(), DType::bf16, r * 6 + x, x < 4 ? values[(r * 4 + x) % 8] : 7.f);
    }
  }
  const TensorView src_view = src.view().narrow(2, 0, 4);
  Tensor dst(Shape{2, 2, 4}, DType::fp8_e4m3);
  const float scale = 0.5f;
  mla::quantize_e4m3_3d(src_view, dst, scalar(scale));
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      for (int64_t x = 0; x < 4; ++x) {
        const float v = load_f32(src.data(), DType::bf16, (i * 2 + j) * 6 + x);
        EXPECT_EQ(static_cast<const uint8_t*>(dst.data())[(i * 2 + j) * 4 + x], f32_to_fp8_e4m3_bits(v / scale));
      }
    }
  }
  EXPECT_EQ(fp8_e4m3_bits_to_f32(static_cast<const uint8_t*>(dst.data())[3]), 448.f);  // saturated
  EXPECT_EQ(fp8_e4m3_bits_to_f32(static_cast<const uint8_t*>(dst.data())[4]), -448.f);
  for (const float bad : {0.f, -1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    dst.fill_bytes(0);
    mla::quantize_e4m3_3d(src_view, dst, scalar(bad));
    for (int64_t i = 0; i < dst.numel(); ++i) {
      EXPECT_EQ(static_cast<const uint8_t*>(dst.data())[i], 0x7F) << "scale " << bad;
    }
  }
  expect_error([&] { mla::quantize_e4m3_3d(src_view, Tensor(Shape{2, 2, 4}, DType::bf16), scalar(1.f)); }, "dst");
  expect_error([&] { mla::quantize_e4m3_3d(src_view, dst, Tensor(Shape{2}, DType::f32)); }, "scale");
}

}  // namespace
}  // namespace pagedattn
