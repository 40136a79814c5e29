// The Attention layer end to end: a decode step and a mixed prefill/decode step through
// layer.forward (cache write + attention) against a naive fp64 attention written here; the
// ForwardContext lookups; kv-sharing (a layer that shares a cache never writes it); and the
// layer's input validation (errors name the argument, the cache stays untouched).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/ops.h"

namespace pagedattn {
namespace {

constexpr int kNumBlocks = 24;

Tensor random_tensor(Shape shape, DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

std::vector<uint8_t> snapshot(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

bool unchanged(const Tensor& t, const std::vector<uint8_t>& bytes) {
  return std::memcmp(t.data(), bytes.data(), bytes.size()) == 0;
}

// One step of a batch: request r has num_computed[r] cached tokens and query_lens[r] new ones.
// Holds every request's full K/V (context + new), the step's q/k/v, the block table, the cache.
struct Step {
  std::vector<int> num_computed, query_lens;
  int block_size = 0;
  int cols = 0;
  std::vector<int32_t> block_table;            // (num_reqs, cols)
  std::vector<Tensor> full_k, full_v;          // per request (seq_len, Hkv, D / Dv)
  Tensor query, key, value;                    // (T, Hq, D), (T, Hkv, D), (T, Hkv, Dv)
  std::vector<int64_t> step_slots;             // (T,)
  OwnedCommonAttentionMetadata common;

  int num_reqs() const { return static_cast<int>(query_lens.size()); }
  int seq_len(int r) const { return num_computed[r] + query_lens[r]; }
  int64_t slot(int r, int pos) const {
    return static_cast<int64_t>(block_table[r * cols + pos / block_size]) * block_size +
           pos % block_size;
  }
};

// Builds the step, fills the cache with every request's context (reshape_and_cache).
Step make_step(const Attention& layer, const Tensor& kv_cache, std::vector<int> num_computed,
               std::vector<int> query_lens, std::mt19937& rng) {
  const AttentionLayerParams& p = layer.params();
  const int hq = p.num_heads, hkv = *p.num_kv_heads;  // resolved by the layer
  const int d = p.head_size, dv = p.head_size_v > 0 ? p.head_size_v : p.head_size;
  Step s;
  s.num_computed = std::move(num_computed);
  s.query_lens = std::move(query_lens);
  s.block_size = p.block_size;
  int max_blocks = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    max_blocks = std::max(max_blocks, (s.seq_len(r) + s.block_size - 1) / s.block_size);
  }
  s.cols = max_blocks;
  std::vector<int32_t> ids(kNumBlocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.block_table.assign(static_cast<size_t>(s.num_reqs()) * s.cols, 0);
  size_t next = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    const int blocks = (s.seq_len(r) + s.block_size - 1) / s.block_size;
    for (int b = 0; b < blocks; ++b) s.block_table[r * s.cols + b] = ids.at(next++);
  }
  int total = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    s.full_k.push_back(random_tensor(Shape{s.seq_len(r), hkv, d}, p.dtype, rng));
    s.full_v.push_back(random_tensor(Shape{s.seq_len(r), hkv, dv}, p.dtype, rng));
    // Context tokens go into the cache now (a previous step).
    const int ctx = s.num_computed[r];
    if (ctx > 0) {
      Tensor slots(Shape{ctx}, DType::i64);
      for (int i = 0; i < ctx; ++i) slots.data_as<int64_t>()[i] = s.slot(r, i);
      reshape_and_cache(s.full_k[r].view().narrow(0, 0, ctx), s.full_v[r].view().narrow(0, 0, ctx),
                        kv_cache, slots, p.kv_cache_dtype, layer.scales().k_scale,
                        layer.scales().v_scale);
    }
    total += s.query_lens[r];
  }
  s.query = random_tensor(Shape{total, hq, d}, p.dtype, rng);
  s.key = Tensor(Shape{total, hkv, d}, p.dtype);
  s.value = Tensor(Shape{total, hkv, dv}, p.dtype);
  CommonAttentionMetadataArgs args;
  args.query_start_loc.push_back(0);
  int row = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    for (int i = 0; i < s.query_lens[r]; ++i, ++row) {
      const int pos = s.num_computed[r] + i;
      Tensor& k = s.full_k[r];
      Tensor& v = s.full_v[r];
      std::memcpy(static_cast<char*>(s.key.data()) + row * hkv * d * dtype_size(p.dtype),
                  static_cast<const char*>(k.data()) + pos * hkv * d * dtype_size(p.dtype),
                  hkv * d * dtype_size(p.dtype));
      std::memcpy(static_cast<char*>(s.value.data()) + row * hkv * dv * dtype_size(p.dtype),
                  static_cast<const char*>(v.data()) + pos * hkv * dv * dtype_size(p.dtype),
                  hkv * dv * dtype_size(p.dtype));
      s.step_slots.push_back(s.slot(r, pos));
    }
    args.query_start_loc.push_back(args.query_start_loc.back() + s.query_lens[r]);
    args.seq_lens.push_back(s.seq_len(r));
  }
  args.block_table = s.block_table;
  args.max_num_blocks_per_req = s.cols;
  args.slot_mapping = s.step_slots;
  s.common = make_common_attention_metadata(args, Device::cpu, kNumBlocks, s.block_size);
  return s;
}

// Naive causal attention in fp64 over the unquantized K/V (GQA, scale, no other feature).
// Returns out (T, Hq, Dv) and lse (Hq, T).
void naive_attention(const Attention& layer, const Step& s, std::vector<double>& out,
                     std::vector<double>& lse) {
  const AttentionLayerParams& p = layer.params();
  const int hq = p.num_heads, hkv = *p.num_kv_heads;  // resolved by the layer
  const int d = p.head_size, dv = p.head_size_v > 0 ? p.head_size_v : p.head_size;
  const int total = static_cast<int>(s.query.shape()[0]);
  out.assign(static_cast<size_t>(total) * hq * dv, 0.0);
  lse.assign(static_cast<size_t>(hq) * total, 0.0);
  int row = 0;
  for (int r = 0; r < s.num_reqs(); ++r) {
    for (int i = 0; i < s.query_lens[r]; ++i, ++row) {
      const int pos = s.num_computed[r] + i;
      for (int h = 0; h < hq; ++h) {
        const int kvh = h / (hq / hkv);
        std::vector<double> logits(static_cast<size_t>(pos) + 1);
        double m = -std::numeric_limits<double>::infinity();
        for (int j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int e = 0; e < d; ++e) {
            dot += load_f64(s.query.data(), p.dtype, (static_cast<int64_t>(row) * hq + h) * d + e) *
                   load_f64(s.full_k[r].data(), p.dtype, (static_cast<int64_t>(j) * hkv + kvh) * d + e);
          }
          logits[j] = dot * *p.scale;
          m = std::max(m, logits[j]);
        }
        double sum = 0;
        for (double& l : logits) sum += (l = std::exp(l - m));
        for (int e = 0; e < dv; ++e) {
          double acc = 0;
          for (int j = 0; j <= pos; ++j) {
            acc += logits[j] *
                   load_f64(s.full_v[r].data(), p.dtype, (static_cast<int64_t>(j) * hkv + kvh) * dv + e);
          }
          out[(static_cast<size_t>(row) * hq + h) * dv + e] = acc / sum;
        }
        lse[static_cast<size_t>(h) * total + row] = std::log(sum) + m;
      }
    }
  }
}

double tolerance(DType dtype, const std::string& kv_cache_dtype) {
  if (kv_cache_dtype.rfind("fp8", 0) == 0) return 6e-2;
  switch (dtype) {
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    default: return 8e-3;
  }
}

struct ForwardCase {
  const char* backend;  // "" = the selector's choice
  DType dtype;
  const char* kv_cache_dtype;
  KVCacheLayout layout;
  int num_heads, num_kv_heads, head_size, head_size_v, block_size;
  std::vector<int> num_computed, query_lens;
  const char* name;
};

void PrintTo(const ForwardCase& c, std::ostream* os) { *os << c.name; }

class LayerForward : public ::testing::TestWithParam<ForwardCase> {
 protected:
  void TearDown() override { set_kv_cache_layout(std::nullopt); }
};

TEST_P(LayerForward, MatchesNaiveAttention) {
  const ForwardCase c = GetParam();
  set_kv_cache_layout(c.layout);
  AttentionLayerParams p;
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_size = c.head_size;
  p.head_size_v = c.head_size_v;
  p.dtype = c.dtype;
  p.kv_cache_dtype = c.kv_cache_dtype;
  p.block_size = c.block_size;
  p.backend = c.backend;
  p.prefix = "model.layers.3.self_attn.attn";
  Attention layer(p);
  if (is_quantized_kv_cache(c.kv_cache_dtype) && std::string(c.kv_cache_dtype).rfind("fp8", 0) == 0) {
    layer.scales().k_scale = 0.01f;
    layer.scales().v_scale = 0.005f;
  }
  std::mt19937 rng(2024 + c.head_size + c.num_heads);
  Tensor cache = layer.allocate_kv_cache(kNumBlocks);
  cache.fill_bytes(0x7E);
  Step s = make_step(layer, cache, c.num_computed, c.query_lens, rng);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(16, 512, 512),
                                              Device::cpu);
  std::shared_ptr<const AttentionMetadata> md = builder->build(0, s.common.common);
  const int total = static_cast<int>(s.query.shape()[0]);
  const int dv = c.head_size_v > 0 ? c.head_size_v : c.head_size;
  Tensor out(Shape{total, c.num_heads, dv}, c.dtype);
  out.fill_bytes(0xFF);
  const bool want_lse = layer.backend().name() == "REFERENCE";
  Tensor lse(Shape{c.num_heads, total}, DType::f32);
  lse.fill_bytes(0xFF);

  layer.forward(s.query, s.key, s.value, cache, *md, out, want_lse ? lse.view() : TensorView{});

  // The step's keys landed in the cache at their slots.
  const KVCacheViews halves = split_kv_cache(cache, c.head_size, dv);
  const DType cache_dtype = layer.kv_cache_storage_dtype();
  const int hkv = c.num_kv_heads > 0 ? c.num_kv_heads : c.num_heads;
  for (int row = 0; row < total; ++row) {
    const int64_t slot = s.step_slots[row];
    for (int h = 0; h < hkv; ++h) {
      const int64_t idx[] = {slot / c.block_size, slot % c.block_size, h, 0};
      const float x = load_f32(s.key.data(), c.dtype,
                               (static_cast<int64_t>(row) * hkv + h) * c.head_size);
      const float stored = load_f32(halves.key_cache.element_ptr(idx), cache_dtype, 0);
      const float want = is_fp8(cache_dtype) ? x / layer.scales().k_scale : x;
      Tensor rounded(Shape{1}, cache_dtype);
      store_f32(rounded.data(), cache_dtype, 0, want);
      EXPECT_EQ(stored, load_f32(rounded.data(), cache_dtype, 0)) << "row " << row;
    }
  }

  std::vector<double> ref_out, ref_lse;
  naive_attention(layer, s, ref_out, ref_lse);
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    const double got = load_f64(out.data(), c.dtype, static_cast<int64_t>(i));
    ASSERT_TRUE(std::isfinite(got)) << "output element " << i << " not written";
    err2 += (got - ref_out[i]) * (got - ref_out[i]);
    ref2 += ref_out[i] * ref_out[i];
  }
  EXPECT_LE(std::sqrt(err2 / ref2), tolerance(c.dtype, c.kv_cache_dtype));
  if (want_lse) {
    for (size_t i = 0; i < ref_lse.size(); ++i) {
      EXPECT_NEAR(lse.data_as<float>()[i], ref_lse[i],
                  is_fp8(cache_dtype) ? 5e-2 : 1e-4 * std::max(1.0, std::fabs(ref_lse[i])))
          << "lse " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, LayerForward,
    ::testing::Values(
        ForwardCase{"REFERENCE", DType::f32, "auto", KVCacheLayout::NHD, 4, 2, 32, 0, 16,
                    {5, 17, 33}, {1, 1, 1}, "reference_f32_decode"},
        ForwardCase{"REFERENCE", DType::bf16, "auto", KVCacheLayout::HND, 8, 2, 64, 0, 16,
                    {9, 0, 20}, {1, 7, 4}, "reference_bf16_mixed_hnd"},
        ForwardCase{"REFERENCE", DType::f16, "fp8", KVCacheLayout::NHD, 4, 4, 32, 16, 8,
                    {12, 3}, {1, 1}, "reference_f16_fp8_decode_dv16"},
        ForwardCase{"", DType::bf16, "auto", KVCacheLayout::NHD, 8, 1, 64, 0, 16,
                    {30, 1, 44}, {1, 1, 1}, "selected_bf16_decode_mqa"},
        ForwardCase{"", DType::f32, "auto", KVCacheLayout::HND, 4, 2, 64, 0, 16,
                    {7, 0}, {1, 12}, "selected_f32_mixed"}),
    [](const ::testing::TestParamInfo<ForwardCase>& info) { return std::string(info.param.name); });

// ---- ForwardContext and kv-sharing -------------------------------------------------------

AttentionLayerParams small_params(const std::string& name) {
  AttentionLayerParams p;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_size = 16;
  p.dtype = DType::f32;
  p.block_size = 8;
  p.prefix = name;
  p.backend = "REFERENCE";
  return p;
}

TEST(ForwardContext, LookupsAndKvSharingNeverWrites) {
  const std::string owner_name = "model.layers.0.attn", sharer_name = "model.layers.1.attn";
  StaticForwardContext model;
  Attention owner(small_params(owner_name), &model);
  AttentionLayerParams sp = small_params(sharer_name);
  sp.kv_sharing_target_layer_name = owner_name;
  Attention sharer(sp, &model);
  std::mt19937 rng(11);
  Tensor cache = owner.allocate_kv_cache(kNumBlocks);
  cache.fill_bytes(0x11);
  Step s = make_step(owner, cache, {6, 13}, {1, 3}, rng);
  auto builder = owner.backend().make_builder(owner.kv_cache_spec(), owner.builder_config(8, 64, 64),
                                              Device::cpu);
  const auto md = builder->build(0, s.common.common);

  ForwardContext ctx;
  // Missing metadata / cache: Errors naming the layer.
  try {
    (void)ctx.metadata_for(owner);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "attn_metadata");
    EXPECT_NE(std::string(e.what()).find(owner_name), std::string::npos) << e.what();
  }
  ctx.attn_metadata[owner_name] = md;
  ctx.attn_metadata[sharer_name] = md;
  try {
    (void)ctx.kv_cache_for(sharer);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_caches");
    EXPECT_NE(std::string(e.what()).find(owner_name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(sharer_name), std::string::npos) << e.what();
  }
  ctx.kv_caches[owner_name] = cache.view();
  EXPECT_EQ(&ctx.metadata_for(sharer), md.get());
  EXPECT_EQ(&ctx.kv_cache_for(sharer), &ctx.kv_caches.at(owner_name));
  EXPECT_EQ(&ctx.kv_cache_for(owner), &ctx.kv_caches.at(owner_name));

  const int total = static_cast<int>(s.query.shape()[0]);
  Tensor out_owner(Shape{total, 4, 16}, DType::f32), out_sharer(Shape{total, 4, 16}, DType::f32);
  out_owner.fill_bytes(0xFF);
  out_sharer.fill_bytes(0xFF);
  const auto before_owner = snapshot(cache);
  ctx.forward(owner, s.query, s.key, s.value, out_owner);
  EXPECT_FALSE(unchanged(cache, before_owner)) << "the owner must write its new tokens";

  // The sharer gets different key/value: it must not write them, and reads the owner's cache.
  Tensor other_k = random_tensor(s.key.shape(), DType::f32, rng);
  Tensor other_v = random_tensor(s.value.shape(), DType::f32, rng);
  const auto before_sharer = snapshot(cache);
  ctx.forward(sharer, s.query, other_k, other_v, out_sharer);
  EXPECT_TRUE(unchanged(cache, before_sharer)) << "a kv-sharing layer wrote the cache";
  EXPECT_EQ(std::memcmp(out_owner.data(), out_sharer.data(), out_owner.nbytes()), 0)
      << "same query over the same cache must give the same output";
  // Also without key/value at all.
  Tensor out_empty_kv(Shape{total, 4, 16}, DType::f32);
  out_empty_kv.fill_bytes(0xFF);
  ctx.forward(sharer, s.query, TensorView{}, TensorView{}, out_empty_kv);
  EXPECT_TRUE(unchanged(cache, before_sharer));
  EXPECT_EQ(std::memcmp(out_owner.data(), out_empty_kv.data(), out_owner.nbytes()), 0);
}

TEST(ForwardContext, EncoderOnlyLayerNeedsNoCache) {
  AttentionLayerParams p = small_params("encoder.layers.0.attn");
  p.attn_type = AttentionType::encoder_only;
  Attention layer(p);
  std::mt19937 rng(12);
  const std::vector<int> lens{5, 3};
  const int total = 8;
  Tensor q = random_tensor(Shape{total, 4, 16}, DType::f32, rng);
  Tensor k = random_tensor(Shape{total, 2, 16}, DType::f32, rng);
  Tensor v = random_tensor(Shape{total, 2, 16}, DType::f32, rng);
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 5, 8};
  args.seq_lens = {5, 3};
  args.block_table = {0, 0};
  args.max_num_blocks_per_req = 1;
  args.slot_mapping.assign(total, -1);
  args.causal = false;
  const auto common = make_common_attention_metadata(args, Device::cpu);
  BuilderConfig bc = layer.builder_config(4, 64, 64);
  auto builder = layer.backend().make_builder(KVCacheSpec::full_attention(8, 2, 16, DType::f32), bc,
                                              Device::cpu);
  ForwardContext ctx;
  ctx.attn_metadata[layer.name()] = builder->build(0, common.common);
  Tensor out(Shape{total, 4, 16}, DType::f32);
  out.fill_bytes(0xFF);
  ctx.forward(layer, q, k, v, out);
  // Non-causal attention within each sequence, fp64.
  double err2 = 0, ref2 = 0;
  int start = 0;
  for (const int len : lens) {
    for (int i = 0; i < len; ++i) {
      for (int h = 0; h < 4; ++h) {
        const int kvh = h / 2;
        std::vector<double> w(len);
        double m = -1e300, sum = 0;
        for (int j = 0; j < len; ++j) {
          double dot = 0;
          for (int e = 0; e < 16; ++e) {
            dot += static_cast<double>(q.data_as<float>()[((start + i) * 4 + h) * 16 + e]) *
                   k.data_as<float>()[((start + j) * 2 + kvh) * 16 + e];
          }
          w[j] = dot * *layer.params().scale;
          m = std::max(m, w[j]);
        }
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int e = 0; e < 16; ++e) {
          double acc = 0;
          for (int j = 0; j < len; ++j) acc += w[j] * v.data_as<float>()[((start + j) * 2 + kvh) * 16 + e];
          const double want = acc / sum;
          const double got = out.data_as<float>()[((start + i) * 4 + h) * 16 + e];
          err2 += (got - want) * (got - want);
          ref2 += want * want;
        }
      }
    }
    start += len;
  }
  EXPECT_LE(std::sqrt(err2 / ref2), 1e-5);
}

// ---- input validation in the layer ---------------------------------------------------------

class LayerForwardErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    layer = std::make_unique<Attention>(small_params("model.layers.5.attn"));
    cache = layer->allocate_kv_cache(kNumBlocks);
    cache.fill_bytes(0x42);
    step = make_step(*layer, cache, {4, 9}, {1, 1}, rng);
    builder = layer->backend().make_builder(layer->kv_cache_spec(), layer->builder_config(8, 64, 64),
                                            Device::cpu);
    md = builder->build(0, step.common.common);
    out = Tensor(Shape{2, 4, 16}, DType::f32);
    before = snapshot(cache);
  }

  void expect_rejected(const std::function<void()>& fn, const std::string& argument) {
    try {
      fn();
      ADD_FAILURE() << "expected an Error naming '" << argument << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("model.layers.5.attn"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(unchanged(cache, before)) << "cache modified by a rejected forward";
  }

  std::mt19937 rng{21};
  std::unique_ptr<Attention> layer;
  Tensor cache, out;
  Step step;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  std::shared_ptr<const AttentionMetadata> md;
  std::vector<uint8_t> before;
};

TEST_F(LayerForwardErrors, ValidInputsRun) {
  EXPECT_NO_THROW(layer->forward(step.query, step.key, step.value, cache, *md, out));
}

TEST_F(LayerForwardErrors, Query) {
  Tensor q_heads = random_tensor(Shape{2, 2, 16}, DType::f32, rng);
  expect_rejected([&] { layer->forward(q_heads, step.key, step.value, cache, *md, out); }, "query");
  Tensor q_bf16 = random_tensor(Shape{2, 4, 16}, DType::bf16, rng);
  expect_rejected([&] { layer->forward(q_bf16, step.key, step.value, cache, *md, out); }, "query");
  // Fewer query rows than metadata.num_actual_tokens.
  expect_rejected([&] {
    layer->forward(step.query.view().narrow(0, 0, 1), step.key, step.value, cache, *md,
                   out.view().narrow(0, 0, 1));
  }, "query");
}

TEST_F(LayerForwardErrors, OutputAndLse) {
  Tensor out_bf16(Shape{2, 4, 16}, DType::bf16);
  expect_rejected([&] { layer->forward(step.query, step.key, step.value, cache, *md, out_bf16); },
                  "output");
  Tensor out_small(Shape{2, 4, 8}, DType::f32);
  expect_rejected([&] { layer->forward(step.query, step.key, step.value, cache, *md, out_small); },
                  "output");
  Tensor lse_wrong(Shape{2, 4}, DType::f32);
  expect_rejected([&] {
    layer->forward(step.query, step.key, step.value, cache, *md, out, lse_wrong);
  }, "output_lse");
}

TEST_F(LayerForwardErrors, KeyValueAndCache) {
  expect_rejected([&] { layer->forward(step.query, TensorView{}, TensorView{}, cache, *md, out); },
                  "key");
  expect_rejected([&] { layer->forward(step.query, step.key, TensorView{}, cache, *md, out); },
                  "value");
  Tensor k_heads = random_tensor(Shape{2, 4, 16}, DType::f32, rng);
  expect_rejected([&] { layer->forward(step.query, k_heads, step.value, cache, *md, out); }, "key");
  Tensor wrong_dtype_cache(cache.shape(), DType::bf16);
  expect_rejected([&] {
    layer->forward(step.query, step.key, step.value, wrong_dtype_cache, *md, out);
  }, "kv_cache");
  expect_rejected([&] {
    layer->forward(step.query, step.key, step.value, cache.view().select(0, 0), *md, out);
  }, "kv_cache");
  expect_rejected([&] { layer->forward(step.query, step.key, step.value, TensorView{}, *md, out); },
                  "kv_cache");
}

}  // namespace
}  // namespace pagedattn
