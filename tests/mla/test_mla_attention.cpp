// The MLA run: the REFERENCE_MLA oracle on hand-checkable cases, the MLACommonImpl driver (through
// a TEST-ONLY backend whose latent decode is a naive loop written here) against REFERENCE_MLA on
// the harness grid, the harness's ability to catch a wrong backend, the prefill selector, and
// the MLAAttention layer's argument checks.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../../src/backends/mla/mla_common.h"
#include "conformance/mla_harness.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

namespace cm = conformance::mla;

void expect_error(const std::function<void()>& fn, const std::string& argument,
                  const std::string& part = "") {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    if (!part.empty()) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// ---- the test-only MLA backend: MLACommonImpl + a naive latent decode ----------------------

// forward_decode as a plain loop: per decode request i, head h, keys = cache rows [0, seq_len)
// (fp8 * k_scale), logits scale * q_latent · row, values = row[:L]. `drop_last_key` makes it
// wrong on purpose (the harness must notice). It declares fused fp8 output, so the grid's
// fp8-output cases run MLACommonImpl's staged writes and quantize pass on the host.
class NaiveDecodeImpl final : public mla::MLACommonImpl {
 public:
  NaiveDecodeImpl(MLAImplParams p, bool drop_last_key)
      : MLACommonImpl(std::move(p)), drop_last_key_(drop_last_key) {}
  bool fused_output_quant_supported(const QuantKey&) const override { return true; }

 protected:
  void check_decode(const LayerScales&, const TensorView& kv_cache, const MLAMetadata&,
                    const TensorView&) const override {
    check_defined(kv_cache, "kv_cache");
  }
  void forward_decode(const LayerScales& scales, const TensorView& q_latent,
                      const TensorView& kv_cache, const MLAMetadata& md, const TensorView& o_latent,
                      const TensorView& lse) override {
    const int64_t H = params_.num_heads, L = params_.dims.kv_lora_rank;
    const int64_t D = params_.dims.latent_head_size();
    const int64_t bs = kv_cache.size(1);
    const DType cdt = kv_cache.dtype();
    const double ks = is_fp8(cdt) ? scales.k_scale : 1.0;
    const TensorView& bt = md.decode.block_table;
    int request = 0;  // token i's decode request (its block-table row)
    for (int i = 0; i < md.decode.num_decode_tokens; ++i) {  // token i: its own keys
      while (md.decode.query_start_loc[request + 1] <= i) ++request;
      const int64_t seen = md.decode.token_seq_lens[i];
      const int64_t keys = seen - (drop_last_key_ && seen > 1);
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> logit(keys), acc(L, 0.0);
        double m = -std::numeric_limits<double>::infinity();
        const auto row_at = [&](int64_t pos) {
          const int64_t block = bt.data_as<int32_t>()[request * bt.stride(0) + (pos / bs) * bt.stride(1)];
          return block * kv_cache.stride(0) + (pos % bs) * kv_cache.stride(1);
        };
        for (int64_t pos = 0; pos < keys; ++pos) {
          double s = 0;
          for (int64_t x = 0; x < D; ++x) {
            s += load_f64(q_latent.data(), q_latent.dtype(), i * q_latent.stride(0) + h * q_latent.stride(1) + x) *
                 load_f64(kv_cache.data(), cdt, row_at(pos) + x) * ks;
          }
          logit[pos] = s * params_.scale;
          m = std::max(m, logit[pos]);
        }
        double denom = 0;
        for (int64_t pos = 0; pos < keys; ++pos) {
          const double w = std::exp(logit[pos] - m);
          denom += w;
          for (int64_t x = 0; x < L; ++x) acc[x] += w * load_f64(kv_cache.data(), cdt, row_at(pos) + x) * ks;
        }
        for (int64_t x = 0; x < L; ++x) {
          store_f32(o_latent.data(), o_latent.dtype(),
                    i * o_latent.stride(0) + h * o_latent.stride(1) + x,
                    static_cast<float>(acc[x] / denom));
        }
        if (lse.defined()) {
          lse.data_as<float>()[h * lse.stride(0) + i * lse.stride(1)] =
              static_cast<float>(m + std::log(denom));
        }
      }
    }
  }

 private:
  bool drop_last_key_;
};

class TestMLABackend final : public MLABackend {
 public:
  explicit TestMLABackend(bool broken = false) : broken_(broken) {}
  std::string_view name() const override { return broken_ ? "TEST_BROKEN_MLA" : "TEST_NAIVE_MLA"; }
  std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& p) const override {
    return std::make_unique<NaiveDecodeImpl>(p, broken_);
  }
  std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& spec,
                                                                 const BuilderConfig& config,
                                                                 Device device) const override {
    return std::make_unique<mla::MLACommonMetadataBuilder>(spec, config, device);
  }
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override {
    return {MultipleOf{1}};
  }
  std::vector<std::string> validate_configuration(const SelectorConfig& c) const override {
    std::vector<std::string> reasons;
    mla::add_mla_common_reasons(name(), c, reasons, /*fp8_output_supported=*/true);
    return reasons;
  }
  BackendCapabilities capabilities() const override { return {}; }

 private:
  bool broken_;
};

TEST(MLADriver, MatchesTheOracleOnTheGrid) {
  const TestMLABackend backend;
  int fp8_output_cases = 0;
  for (const cm::MLAResult& r : cm::run_mla_grid(backend, "REFERENCE", Device::cpu, cm::mla_grid(), 11)) {
    EXPECT_TRUE(r.passed()) << r.describe();
    EXPECT_FALSE(r.skipped) << r.describe();
    EXPECT_EQ(r.prefill_backend_name, "REFERENCE");
    fp8_output_cases += r.case_description.find("fp8-out") != std::string::npos;
    std::printf("%s\n", r.describe().c_str());
  }
  EXPECT_GE(fp8_output_cases, 3);  // MLACommonImpl's staged fp8 writes, every kind
}

// MLACommonImpl's fp8 output is its own activation-dtype output quantized, bit for bit: the
// staged rows (decode gemm, new-token prefill, final merge) hold the bytes the unquantized run
// writes, and the quantize pass is the host's saturate_e4m3(x / scale) in f32.
TEST(MLADriver, Fp8OutputIsItsOwnOutputQuantized) {
  const TestMLABackend backend;
  int cases = 0;
  for (cm::MLACase c : cm::mla_grid(false)) {
    if (!c.fp8_output()) continue;
    SCOPED_TRACE(c.describe());
    const float scale = c.output_scale;
    const cm::MLAOutputs fp8 = cm::run_mla_outputs(backend, "REFERENCE", Device::cpu, c, 31);
    c.output_scale = 0.f;
    const cm::MLAOutputs act = cm::run_mla_outputs(backend, "REFERENCE", Device::cpu, c, 31);
    const int64_t n = act.num_actual_tokens * c.num_heads * c.dims.v_head_dim;
    const cm::QuantizedComparison r = cm::compare_with_quantized(fp8.output, act.output, scale, n);
    EXPECT_EQ(r.unwritten, 0) << r.describe();
    EXPECT_EQ(r.mismatches, 0) << r.describe();
    ++cases;
  }
  EXPECT_GE(cases, 3);
}

TEST(MLADriver, HarnessCatchesAWrongDecode) {
  const TestMLABackend broken(true);
  cm::MLACase c;
  c.batch = {{12, 1}, {30, 1}};
  const cm::MLAResult r = cm::run_mla_case(broken, "REFERENCE", Device::cpu, c, 3);
  EXPECT_FALSE(r.passed()) << r.describe();
  EXPECT_GT(r.output_rel_error, 1e-3);
}

TEST(MLADriver, HarnessCatchesUnwrittenRows) {
  // A prefill that writes nothing leaves the NaN poison: counted as unwritten.
  class SilentImpl final : public MLAAttentionImpl {
   public:
    explicit SilentImpl(MLAImplParams p) : MLAAttentionImpl(std::move(p)) {}
    void process_weights_after_loading(const TensorView&) override {}
    void do_kv_cache_update(const LayerScales& s, const TensorView& kv, const TensorView& pe,
                            const TensorView& cache, const AttentionMetadata& md) override {
      concat_and_cache_mla(kv, pe, cache, md.slot_mapping, params_.kv_cache_dtype, s.k_scale);
    }
    void forward(const LayerScales&, const TensorView&, const TensorView&, const TensorView&,
                 const TensorView&, const AttentionMetadata&, const TensorView&,
                 const TensorView&, const TensorView&) override {}
    void check_forward(const LayerScales&, const TensorView&, const TensorView&,
                       const TensorView&, const TensorView&, const AttentionMetadata&,
                       const TensorView&, const TensorView&, const TensorView&) const override {}
    std::string_view prefill_backend_name() const override { return "none"; }
  };
  class SilentBackend final : public MLABackend {
   public:
    std::string_view name() const override { return "TEST_SILENT_MLA"; }
    std::unique_ptr<MLAAttentionImpl> make_mla_impl(const MLAImplParams& p) const override {
      return std::make_unique<SilentImpl>(p);
    }
    std::unique_ptr<AttentionMetadataBuilder> make_backend_builder(const KVCacheSpec& s,
                                                                   const BuilderConfig& c,
                                                                   Device d) const override {
      return std::make_unique<mla::MLACommonMetadataBuilder>(s, c, d);
    }
    std::vector<KernelBlockSize> supported_kernel_block_sizes() const override { return {1}; }
    std::vector<std::string> validate_configuration(const SelectorConfig&) const override {
      return {};
    }
    BackendCapabilities capabilities() const override { return {}; }
  };
  const SilentBackend silent;
  cm::MLACase c;
  c.batch = {{0, 3}};
  const cm::MLAResult r = cm::run_mla_case(silent, "", Device::cpu, c, 4);
  EXPECT_FALSE(r.passed());
  EXPECT_EQ(r.unwritten, 3 * 4 * 32 + 4 * 3);  // every output element and LSE of 3 tokens
}

TEST(MLAReference, RegisteredLastAndSelfConsistentThroughTheHarness) {
  const auto& all = registered_backends();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.back()->name(), "REFERENCE_MLA");
  const AttentionBackend* ref = find_backend("REFERENCE_MLA");
  ASSERT_NE(ref, nullptr);
  cm::MLACase c;
  c.dtype = DType::bf16;
  c.kv_cache_dtype = "fp8";
  c.batch = {{20, 1}, {33, 4}};
  const cm::MLAResult r = cm::run_mla_case(*ref, "", Device::cpu, c, 9);
  EXPECT_TRUE(r.passed()) << r.describe();
  EXPECT_EQ(r.output_rel_error, 0.0);
}

// ---- REFERENCE_MLA on hand-checkable cases -------------------------------------------------

// L = 2, P = 1, R = 1, V = 1, H = 1, block size 4, f32. kv_b_proj rows: W_UK = [a0, a1],
// W_UV = [b0, b1]. Tokens' latents kv_c = [c0, c1], k_pe = e; q = [qn, qp].
struct TinyMLA {
  MLAAttentionLayerParams params() const {
    MLAAttentionLayerParams p;
    p.num_heads = 1;
    p.kv_lora_rank = 2;
    p.qk_nope_head_dim = 1;
    p.qk_rope_head_dim = 1;
    p.qk_head_dim = 2;
    p.v_head_dim = 1;
    p.block_size = 4;
    p.scale = 0.5f;
    p.kv_cache_dtype = kv_dtype;
    p.dtype = DType::f32;
    p.backend = "REFERENCE_MLA";
    p.prefix = "tiny";
    return p;
  }
  std::string kv_dtype = "auto";
  float w[4] = {0.5f, -1.f, 2.f, 0.25f};  // a0 a1 b0 b1

  // Runs one step of requests (context, query) whose context latents are `ctx` rows and whose
  // new tokens are `kv`/`pe`/`q`; returns output and LSE.
  std::pair<std::vector<float>, std::vector<float>> run(
      const std::vector<std::pair<int, int>>& reqs, const std::vector<std::array<float, 3>>& ctx,
      const std::vector<std::array<float, 3>>& tokens, const std::vector<std::array<float, 2>>& q,
      float k_scale = 1.f) {
    MLAAttention layer(params());
    layer.scales().k_scale = k_scale;
    Tensor weight(Shape{2, 2}, DType::f32);
    std::memcpy(weight.data(), w, sizeof(w));
    layer.process_weights_after_loading(weight);
    Tensor cache = layer.allocate_kv_cache(8);
    cache.fill_bytes(0);
    CommonAttentionMetadataArgs a;
    a.query_start_loc = {0};
    a.max_num_blocks_per_req = 2;
    std::vector<int64_t> ctx_slots;
    int32_t block = 0;
    for (const auto& [c, n] : reqs) {
      a.query_start_loc.push_back(a.query_start_loc.back() + n);
      a.seq_lens.push_back(c + n);
      const int32_t b0 = block++, b1 = block++;
      a.block_table.push_back(b0);
      a.block_table.push_back(b1);
      for (int pos = 0; pos < c + n; ++pos) {
        (pos < c ? ctx_slots : a.slot_mapping).push_back(int64_t{pos < 4 ? b0 : b1} * 4 + pos % 4);
      }
    }
    const int64_t T = a.query_start_loc.back();
    const auto fill = [](Tensor& t, const auto& rows, int offset, int n) {
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int j = 0; j < n; ++j) t.data_as<float>()[i * n + j] = rows[i][offset + j];
      }
    };
    if (!ctx.empty()) {
      Tensor kv(Shape{static_cast<int64_t>(ctx.size()), 2}, DType::f32),
          pe(Shape{static_cast<int64_t>(ctx.size()), 1}, DType::f32);
      fill(kv, ctx, 0, 2);
      fill(pe, ctx, 2, 1);
      Tensor slots(Shape{static_cast<int64_t>(ctx_slots.size())}, DType::i64);
      std::memcpy(slots.data(), ctx_slots.data(), ctx_slots.size() * 8);
      concat_and_cache_mla(kv, pe, cache, slots, kv_dtype, k_scale);
    }
    const auto common = make_common_attention_metadata(a, Device::cpu);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 16, 8),
                                                Device::cpu);
    const auto md = builder->build(0, common.common);
    Tensor kv(Shape{T, 2}, DType::f32), pe(Shape{T, 1}, DType::f32), qt(Shape{T, 1, 2}, DType::f32);
    fill(kv, tokens, 0, 2);
    fill(pe, tokens, 2, 1);
    fill(qt, q, 0, 2);
    Tensor out(Shape{T, 1, 1}, DType::f32), lse(Shape{1, T}, DType::f32);
    out.fill_bytes(0xFF);
    lse.fill_bytes(0xFF);
    layer.forward(qt, kv, pe, cache, *md, out, lse);
    return {std::vector<float>(out.data_as<float>(), out.data_as<float>() + T),
            std::vector<float>(lse.data_as<float>(), lse.data_as<float>() + T)};
  }
  double k_nope(const std::array<float, 3>& t) const { return w[0] * t[0] + w[1] * t[1]; }
  double value(const std::array<float, 3>& t) const { return w[2] * t[0] + w[3] * t[1]; }
  double logit(const std::array<float, 2>& q, const std::array<float, 3>& t) const {
    return 0.5 * (q[0] * k_nope(t) + q[1] * t[2]);
  }
};

// A speculative decode is the same function in the absorbed form as in the up-projected prefill
// form: REFERENCE_MLA with num_speculative_tokens = 3 (requests of 2 to 4 tokens run as decodes)
// against the same inputs with k = 0 (they run as prefills), on a 16-bit cache that holds the
// given latent exactly. Both are fp64 with one rounding, so they agree to the output dtype's last
// bits; a wrong causal offset among a decode's tokens would differ by far more.
TEST(MLAReference, SpeculativeDecodeEqualsThePrefillForm) {
  namespace cm = conformance::mla;
  cm::MLACase c;
  c.dtype = DType::f32;
  c.num_heads = 3;
  c.workspace_tokens = 80;  // k = 0: 3 prefills with context, chunks of 16 (40 keys: 3 chunks)
  c.batch = {{31, 1}, {40, 4}, {17, 2}, {0, 3}, {20, 6}};
  c.num_speculative_tokens = 3;
  const AttentionBackend& ref = *find_backend("REFERENCE_MLA");
  const cm::MLAOutputs as_decode = cm::run_mla_outputs(ref, "", Device::cpu, c, 5);
  c.num_speculative_tokens = 0;
  const cm::MLAOutputs as_prefill = cm::run_mla_outputs(ref, "", Device::cpu, c, 5);
  ASSERT_EQ(as_decode.num_actual_tokens, 16);
  const auto* a = as_decode.output.data_as<float>();
  const auto* b = as_prefill.output.data_as<float>();
  const int64_t n = as_decode.num_actual_tokens * c.num_heads * c.dims.v_head_dim;
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << "element " << i;
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += double(b[i]) * b[i];
  }
  EXPECT_GT(norm, 0.0);
  EXPECT_LT(std::sqrt(diff / norm), 1e-6);
  const auto* la = as_decode.lse.data_as<float>();
  const auto* lb = as_prefill.lse.data_as<float>();
  for (int64_t h = 0; h < c.num_heads; ++h) {
    for (int64_t t = 0; t < as_decode.num_actual_tokens; ++t) {
      const int64_t at = h * as_decode.lse.shape()[1] + t;
      EXPECT_NEAR(la[at], lb[at], 1e-5) << "head " << h << " token " << t;
    }
  }
}

TEST(MLAReference, OneKeyGivesItsValueRow) {
  TinyMLA m;
  const std::array<float, 3> tok = {1.5f, -0.5f, 2.f};
  const std::array<float, 2> q = {0.75f, -1.25f};
  const auto [out, lse] = m.run({{0, 1}}, {}, {tok}, {q});  // a decode of a fresh sequence
  EXPECT_FLOAT_EQ(out[0], static_cast<float>(m.value(tok)));  // 2 * 1.5 + 0.25 * -0.5
  EXPECT_FLOAT_EQ(lse[0], static_cast<float>(m.logit(q, tok)));
}

TEST(MLAReference, CausalPrefillWithContextByHand) {
  TinyMLA m;
  const std::array<float, 3> c0 = {0.25f, 1.f, -1.f}, t0 = {1.f, 0.5f, 0.5f}, t1 = {-0.5f, 2.f, 1.f};
  const std::array<float, 2> q0 = {1.f, 0.5f}, q1 = {-0.75f, 1.5f};
  const auto [out, lse] = m.run({{1, 2}}, {c0}, {t0, t1}, {q0, q1});
  // token 0 sees c0, t0; token 1 sees c0, t0, t1.
  const auto expect = [&](const std::array<float, 2>& q,
                          const std::vector<std::array<float, 3>>& keys, float got_out,
                          float got_lse) {
    double denom = 0, acc = 0;
    for (const auto& k : keys) {
      denom += std::exp(m.logit(q, k));
      acc += std::exp(m.logit(q, k)) * m.value(k);
    }
    EXPECT_NEAR(got_out, acc / denom, 1e-6);
    EXPECT_NEAR(got_lse, std::log(denom), 1e-6);
  };
  expect(q0, {c0, t0}, out[0], lse[0]);
  expect(q1, {c0, t0, t1}, out[1], lse[1]);
}

TEST(MLAReference, Fp8DecodeReadsTheQuantizedCachePrefillTheGivenLatent) {
  TinyMLA m;
  m.kv_dtype = "fp8";
  const std::array<float, 3> tok = {0.3f, -0.7f, 0.9f};  // none is exact in e4m3
  const std::array<float, 2> q = {1.f, 1.f};
  const float ks = 0.5f;
  const auto quant = [&](float x) { return fp8_e4m3_bits_to_f32(f32_to_fp8_e4m3_bits(x / ks)) * ks; };
  const std::array<float, 3> tok_q = {quant(tok[0]), quant(tok[1]), quant(tok[2])};
  // Decode (query_len 1): its own key comes from the fp8 cache.
  const auto [dout, dlse] = m.run({{0, 1}}, {}, {tok}, {q}, ks);
  EXPECT_FLOAT_EQ(dout[0], static_cast<float>(m.value(tok_q)));
  EXPECT_NE(dout[0], static_cast<float>(m.value(tok)));
  // Prefill (query_len 2): the new tokens' keys are the given, unquantized latents.
  const std::array<float, 3> tok2 = {1.f, 1.f, 1.f};
  const auto [pout, plse] = m.run({{0, 2}}, {}, {tok, tok2}, {q, q}, ks);
  EXPECT_FLOAT_EQ(pout[0], static_cast<float>(m.value(tok)));
}

// ---- prefill selector ------------------------------------------------------------------------

class FakePrefillClass final : public MLAPrefillBackendClass {
 public:
  std::string_view get_name() const override { return "FAKE"; }
  Device device() const override { return Device::cuda; }
  std::vector<MLADimensions> supported_mla_dimensions() const override {
    return {MLADimensions{512, 128, 64, 128}};
  }
  bool supports_compute_capability(const DeviceCapability& c) const override { return c.major >= 9; }
  bool is_available() const override { return false; }
  std::unique_ptr<MLAPrefillBackend> create(const MLAPrefillParams&) const override {
    return nullptr;
  }
};

TEST(MLAPrefillSelector, BaseReasonsAsVllm) {
  const FakePrefillClass fake;
  MLAPrefillSelectorConfig cfg;
  cfg.dtype = DType::f32;
  cfg.mla_dimensions = {64, 32, 16, 32};
  cfg.device = Device::cpu;
  const std::vector<std::string> reasons = fake.validate_configuration({8, 0}, cfg);
  ASSERT_EQ(reasons.size(), 5u);
  EXPECT_EQ(reasons[0], "device cpu not supported (the FAKE prefill backend runs on cuda).");
  EXPECT_EQ(reasons[1], "compute capability 8.0 not supported.");
  EXPECT_EQ(reasons[2], "dtype float32 not supported (supported: float16, bfloat16).");
  EXPECT_EQ(reasons[3], "required dependencies not available.");
  EXPECT_EQ(reasons[4],
            "Model does not have supported MLA dimensions (got MLADimensions(kv_lora_rank=64, "
            "qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32); supported: "
            "MLADimensions(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, "
            "v_head_dim=128)).");
}

TEST(MLAPrefillSelector, RegistryExplainForce) {
  const auto& all = registered_mla_prefill_backends();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.back()->get_name(), "REFERENCE");
  EXPECT_EQ(find_mla_prefill_backend("reference"), all.back());
  EXPECT_EQ(find_mla_prefill_backend("nope"), nullptr);
  MLAPrefillSelectorConfig cfg;
  cfg.dtype = DType::f32;
  cfg.mla_dimensions = {64, 32, 16, 32};
  const DeviceCapability cpu = device_capability(Device::cpu);
  EXPECT_EQ(cpu.to_string(), "0.0");
  bool reference_usable = false;
  for (const auto& r : explain_mla_prefill_backends(cpu, cfg)) {
    if (r.backend->get_name() == "REFERENCE") reference_usable = r.usable();
  }
  EXPECT_TRUE(reference_usable);
  EXPECT_EQ(get_mla_prefill_backend(cpu, cfg, "REFERENCE").get_name(), "REFERENCE");
  expect_error([&] { get_mla_prefill_backend(cpu, cfg, "nope"); }, "prefill_backend", "REFERENCE");
  cfg.device = Device::cuda;
  expect_error([&] { get_mla_prefill_backend(cpu, cfg, "REFERENCE"); }, "prefill_backend",
               "device cuda not supported");
  cfg.device = Device::cpu;
  ::setenv("PAGEDATTN_MLA_PREFILL_BACKEND", "nope", 1);
  expect_error([&] { get_mla_prefill_backend(cpu, cfg); }, "PAGEDATTN_MLA_PREFILL_BACKEND");
  ::setenv("PAGEDATTN_MLA_PREFILL_BACKEND", "REFERENCE", 1);
  EXPECT_EQ(get_mla_prefill_backend(cpu, cfg).get_name(), "REFERENCE");
  ::unsetenv("PAGEDATTN_MLA_PREFILL_BACKEND");
  cfg.dtype = DType::fp8_e4m3;
  try {
    get_mla_prefill_backend(cpu, cfg);
    ADD_FAILURE() << "fp8 activations selected a prefill backend";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("REFERENCE: dtype fp8_e4m3 not supported"), std::string::npos)
        << e.what();
  }
}

// ---- MLAAttention layer and MLABackend defaults --------------------------------------------

MLAAttentionLayerParams small_layer() { return cm::small_mla_layer_params(); }

TEST(MLALayer, SelectsAnMLABackendAndReportsItsSpec) {
  MLAAttention layer(small_layer());
  EXPECT_NE(layer.backend().as_mla(), nullptr);
  EXPECT_FLOAT_EQ(layer.params().scale.value(), 1.f / std::sqrt(48.f));
  EXPECT_EQ(layer.kv_cache_spec(), mla_attention_spec(16, {64, 32, 16, 32}, DType::f32));
  const SelectorConfig sc = layer.selector_config();
  EXPECT_TRUE(sc.use_mla);
  EXPECT_EQ(sc.head_size, 80);
  EXPECT_EQ(sc.num_heads, 4);
  EXPECT_EQ(layer.allocate_kv_cache(3).shape(), (Shape{3, 16, 80}));
  const BuilderConfig bc = layer.builder_config(8, 256, 1024);
  EXPECT_EQ(bc.mla_chunked_prefill_workspace_tokens, 8192);
  EXPECT_EQ(bc.mla_dimensions, (MLADimensions{64, 32, 16, 32}));
  // A standard layer configuration never gets an MLA backend, and vice versa.
  SelectorConfig standard;
  standard.head_size = 80;
  standard.dtype = DType::f32;
  standard.device = Device::cpu;
  EXPECT_EQ(get_attn_backend(standard).as_mla(), nullptr);
  for (const BackendReport& r : explain_backends(sc)) {
    if (r.usable()) EXPECT_NE(r.backend->as_mla(), nullptr) << r.backend->name();
  }
}

TEST(MLALayer, ParameterErrorsNameTheArgument) {
  auto p = small_layer();
  p.qk_head_dim = 47;
  expect_error([&] { MLAAttention l(p); }, "qk_head_dim");
  p = small_layer();
  p.num_heads = 0;
  expect_error([&] { MLAAttention l(p); }, "num_heads");
  p = small_layer();
  p.kv_lora_rank = -1;
  expect_error([&] { MLAAttention l(p); }, "kv_lora_rank");
  p = small_layer();
  p.dtype = DType::i32;
  expect_error([&] { MLAAttention l(p); }, "dtype");
  p = small_layer();
  p.scale = std::nanf("");
  expect_error([&] { MLAAttention l(p); }, "scale");
  p.scale = 0.f;  // unset means qk_head_dim^-0.5; an explicit 0 is an error (as in Python)
  expect_error([&] { MLAAttention l(p); }, "scale", "scale = 0");
  p = small_layer();
  p.backend = "REFERENCE";  // a standard backend refuses use_mla
  expect_error([&] { MLAAttention l(p); }, "backend", "use_mla");
  p = small_layer();
  p.prefill_backend = "CPU";
  p.backend = "REFERENCE_MLA";  // the oracle runs its own fp64 prefill: a forced one is refused
  expect_error([&] { MLAAttention l(p); }, "prefill_backend", "fp64 prefill");
  p.prefill_backend = "reference";  // ... except the fp64 one itself
  EXPECT_NO_THROW(MLAAttention l(p));
}

TEST(MLALayer, ForwardChecks) {
  auto p = small_layer();
  p.backend = "REFERENCE_MLA";
  MLAAttention layer(p);
  Tensor cache = layer.allocate_kv_cache(4);
  Tensor q(Shape{2, 4, 48}, DType::f32), kv(Shape{2, 64}, DType::f32), pe(Shape{2, 16}, DType::f32),
      out(Shape{2, 4, 32}, DType::f32);
  CommonAttentionMetadataArgs a;
  a.query_start_loc = {0, 2};
  a.seq_lens = {2};
  a.block_table = {0};
  a.max_num_blocks_per_req = 1;
  a.slot_mapping = {0, 1};
  const auto common = make_common_attention_metadata(a, Device::cpu);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2, 8, 64),
                                              Device::cpu);
  const auto md = builder->build(0, common.common);
  expect_error([&] { layer.forward(q, kv, pe, cache, *md, out); }, "kv_b_proj_weight");
  Tensor w(Shape{4 * 64, 64}, DType::f32);
  w.fill_bytes(0);
  expect_error([&] { layer.process_weights_after_loading(Tensor(Shape{4 * 64, 63}, DType::f32)); },
               "kv_b_proj_weight");
  layer.process_weights_after_loading(w);
  Tensor bad_q(Shape{2, 4, 47}, DType::f32);
  expect_error([&] { layer.forward(bad_q, kv, pe, cache, *md, out); }, "q");
  Tensor bad_pe(Shape{2, 2, 16}, DType::f32);
  expect_error([&] { layer.forward(q, kv, bad_pe, cache, *md, out); }, "k_pe");
  Tensor bad_out(Shape{2, 4, 33}, DType::f32);
  expect_error([&] { layer.forward(q, kv, pe, cache, *md, bad_out); }, "output");
  Tensor bad_lse(Shape{4, 3}, DType::f32);
  expect_error([&] { layer.forward(q, kv, pe, cache, *md, out, bad_lse); }, "output_lse");
  Tensor bf_cache(Shape{4, 16, 80}, DType::bf16);
  expect_error([&] { layer.forward(q, kv, pe, bf_cache, *md, out); }, "kv_cache");
  AttentionMetadata plain;
  expect_error([&] { layer.forward(q, kv, pe, cache, plain, out); }, "metadata");
  Tensor out2d(Shape{2, 128}, DType::f32);
  EXPECT_NO_THROW(layer.forward(q, kv, pe, cache, *md, out2d));
}

TEST(MLABackendDefaults, CacheShapeAndNoStandardImpl) {
  const AttentionBackend* ref = find_backend("REFERENCE_MLA");
  ASSERT_NE(ref, nullptr);
  EXPECT_EQ(ref->kv_cache_shape(10, 64, 1, 576), (Shape{10, 64, 576}));
  EXPECT_EQ(ref->kv_cache_stride_order(), (std::vector<int>{0, 1, 2}));
  expect_error([&] { ref->kv_cache_shape(10, 64, 2, 576); }, "num_kv_heads");
  expect_error([&] { ref->make_impl(AttentionImplParams{}); }, "params");
  SelectorConfig sc;
  sc.head_size = 80;
  sc.dtype = DType::f32;
  sc.use_mla = true;
  sc.mla_dimensions = {64, 32, 16, 32};
  sc.use_alibi = true;
  sc.head_size = 81;
  const auto reasons = ref->validate_configuration(sc);
  ASSERT_EQ(reasons.size(), 2u);
  EXPECT_NE(reasons[0].find("head_size = 81"), std::string::npos);
  EXPECT_NE(reasons[1].find("use_alibi"), std::string::npos);
  sc.use_mla = false;  // a standard layer: that is the one reason, nothing else is listed
  const auto standard = ref->validate_configuration(sc);
  ASSERT_EQ(standard.size(), 1u);
  EXPECT_NE(standard[0].find("use_mla = false"), std::string::npos);
}

}  // namespace
}  // namespace pagedattn
