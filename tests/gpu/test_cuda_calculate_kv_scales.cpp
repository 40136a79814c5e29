// calculate_kv_scales on the CUDA backend (the amax kernel, src/backends/cuda/ops/kv_amax.cu):
// the first batch written into an fp8 cache sets k_scale / v_scale = amax / fp8 max, the amax
// taken on the device over the rows the write stores (a padding row and a token with slot -1
// hold large values that must not count), exactly the host's f32 amax; the layer then computes
// the same bits as a CUDA layer given those scales; a NaN among the written keys is an Error
// naming key with the cache byte-identical. Strided key / value views (a fused QKV buffer) too.
// CUDA_MLA: k_scale = amax(|kv_c_normed|, |k_pe|) / 448 over the written rows, the same cache bits
// as a layer given it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

constexpr int kBlocks = 16, kBlockSize = 16, kHq = 8, kHkv = 2, kD = 128;

AttentionLayerParams params(const char* kv_cache_dtype, bool calculate) {
  AttentionLayerParams p;
  p.num_heads = kHq;
  p.num_kv_heads = kHkv;
  p.head_size = kD;
  p.dtype = DType::bf16;
  p.kv_cache_dtype = kv_cache_dtype;
  p.block_size = kBlockSize;
  p.device = Device::cuda;
  p.backend = "CUDA";
  p.prefix = "model.layers.0.self_attn.attn";
  p.calculate_kv_scales = calculate;
  return p;
}

// Two prefills (37 and 20 tokens) in blocks 0-2 and 5-6, then a padding row (slot -1); token 11
// is not cached (slot -1). Host tensors: q (rows, Hq, D); kv (rows, 2, Hkv, D), key and value
// interleaved per row, so the layer reads strided views; the padding row and token 11 hold +-900.
struct Step {
  int rows = 0;
  Tensor q, kv;
  OwnedCommonAttentionMetadata common;
};

Step make_step(uint64_t seed, float v_amplitude) {
  Step s;
  CommonAttentionMetadataArgs args;
  const int lens[] = {37, 20};
  const int first_block[] = {0, 5};
  args.query_start_loc = {0};
  for (int r = 0; r < 2; ++r) {
    for (int t = 0; t < lens[r]; ++t) args.slot_mapping.push_back(int64_t{first_block[r]} * kBlockSize + t);
    args.query_start_loc.push_back(args.query_start_loc.back() + lens[r]);
    args.seq_lens.push_back(lens[r]);
    for (int b = 0; b < 3; ++b) args.block_table.push_back(first_block[r] + b);
  }
  args.max_num_blocks_per_req = 3;
  args.slot_mapping.at(11) = -1;
  const int tokens = args.query_start_loc.back();
  args.num_tokens_padded = tokens + 1;
  s.rows = tokens + 1;
  s.common = make_common_attention_metadata(args, Device::cuda, kBlocks, kBlockSize);
  s.q = gpu_test::random_host(Shape{s.rows, kHq, kD}, DType::bf16, seed);
  s.kv = gpu_test::random_host(Shape{s.rows, 2, kHkv, kD}, DType::bf16, seed + 1, -2.5f, 2.5f);
  for (int64_t i = 0; i < s.kv.numel(); ++i) {
    const int64_t row = i / (2 * kHkv * kD), which = i / (kHkv * kD) % 2;
    if (row == tokens || row == 11) {
      store_f32(s.kv.data(), DType::bf16, i, i % 2 ? 900.f : -900.f);
    } else if (which == 1) {
      store_f32(s.kv.data(), DType::bf16, i, v_amplitude * load_f32(s.kv.data(), DType::bf16, i));
    }
  }
  return s;
}

// max |kv[:, which]| over the rows the write stores (not token 11, not the padding row).
float written_amax(const Step& s, int which) {
  float m = 0.f;
  for (int64_t i = 0; i < s.kv.numel(); ++i) {
    const int64_t row = i / (2 * kHkv * kD);
    if (row == s.rows - 1 || row == 11 || i / (kHkv * kD) % 2 != which) continue;
    m = std::max(m, std::fabs(load_f32(s.kv.data(), DType::bf16, i)));
  }
  return m;
}

std::vector<uint8_t> host_bytes(const Tensor& t) {
  const Tensor h = t.to(Device::cpu);
  const auto* p = static_cast<const uint8_t*>(h.data());
  return {p, p + h.nbytes()};
}

// Runs one step of `layer` on the device; returns the output (rows, Hq, D), poisoned before.
Tensor run(Attention& layer, const Tensor& cache, const Step& s) {
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 64, 256),
                                              Device::cuda);
  auto md = builder->build(0, s.common.common);
  const Tensor q = s.q.to(Device::cuda), kv = s.kv.to(Device::cuda);
  const TensorView key = kv.view().select(1, 0), value = kv.view().select(1, 1);
  Tensor out(Shape{s.rows, kHq, kD}, DType::bf16, Device::cuda);
  out.fill_bytes(0xff);
  layer.forward(q, key, value, cache, *md, out);
  return out;
}

TEST(CudaCalculateKvScales, DeviceAmaxOfTheWrittenRowsAndTheSameBitsAsGivenScales) {
  PAGEDATTN_REQUIRE_GPU();
  for (const auto& [kv_dtype, fp8_max] : {std::pair{"fp8_e4m3", 448.f}, std::pair{"fp8_e5m2", 57344.f}}) {
    SCOPED_TRACE(kv_dtype);
    const Step s = make_step(17, 0.3f);
    Attention measuring(params(kv_dtype, true));
    Tensor cache = measuring.allocate_kv_cache(kBlocks);
    cache.fill_bytes(0);
    const Tensor out = run(measuring, cache, s);
    const float want_k = written_amax(s, 0) / fp8_max, want_v = written_amax(s, 1) / fp8_max;
    EXPECT_EQ(measuring.scales().k_scale, want_k);
    EXPECT_EQ(measuring.scales().v_scale, want_v);
    EXPECT_FALSE(measuring.kv_scales_pending());

    Attention given(params(kv_dtype, false));
    given.scales().k_scale = want_k;
    given.scales().v_scale = want_v;
    Tensor given_cache = given.allocate_kv_cache(kBlocks);
    given_cache.fill_bytes(0);
    const Tensor given_out = run(given, given_cache, s);
    EXPECT_EQ(host_bytes(cache), host_bytes(given_cache));
    // The padding row is not computed by either layer (poison kept in both).
    EXPECT_EQ(host_bytes(out), host_bytes(given_out));

    // A second batch with larger values leaves the scales as measured.
    const Step larger = make_step(29, 3.f);
    run(measuring, cache, larger);
    EXPECT_EQ(measuring.scales().k_scale, want_k);
    EXPECT_EQ(measuring.scales().v_scale, want_v);
  }
}

TEST(CudaCalculateKvScales, NanAmongTheWrittenKeysIsRejectedBeforeAnyWrite) {
  PAGEDATTN_REQUIRE_GPU();
  Step s = make_step(41, 1.f);
  store_f32(s.kv.data(), DType::bf16, int64_t{20} * 2 * kHkv * kD + 5, std::numeric_limits<float>::quiet_NaN());
  Attention layer(params("fp8_e4m3", true));
  Tensor cache = layer.allocate_kv_cache(kBlocks);
  cache.fill_bytes(0x3c);
  const std::vector<uint8_t> before = host_bytes(cache);
  try {
    run(layer, cache, s);
    ADD_FAILURE() << "a NaN key was measured";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "key") << e.what();
  }
  EXPECT_EQ(host_bytes(cache), before);
  EXPECT_TRUE(layer.kv_scales_pending());
  EXPECT_EQ(layer.scales().k_scale, 1.f);
}

// MLAAttention on CUDA_MLA (DeepSeek dimensions): the device amax of the written latent rows.
TEST(CudaCalculateKvScales, MlaLatentRowsOnCudaMla) {
  PAGEDATTN_REQUIRE_GPU();
  constexpr int kL = 512, kR = 64, kHeads = 16, kT = 40;
  const auto mla_params = [&](bool calculate) {
    MLAAttentionLayerParams p;
    p.num_heads = kHeads;
    p.kv_lora_rank = kL;
    p.qk_nope_head_dim = 128;
    p.qk_rope_head_dim = kR;
    p.qk_head_dim = 128 + kR;
    p.v_head_dim = 128;
    p.block_size = 64;
    p.kv_cache_dtype = "fp8_e4m3";
    p.dtype = DType::bf16;
    p.device = Device::cuda;
    p.backend = "CUDA_MLA";
    p.prefix = "model.layers.0.self_attn.mla";
    p.calculate_kv_scales = calculate;
    return p;
  };
  // One 39-token prefill (slots 64..102) and a padding row (slot -1, values +-900, not counted).
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  const auto host = [&](Shape shape, float amplitude) {
    Tensor t(shape, DType::bf16);
    for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), DType::bf16, i, amplitude * dist(rng));
    return t;
  };
  Tensor q = host(Shape{kT, kHeads, 128 + kR}, 1.f), kv = host(Shape{kT, kL}, 1.f), pe = host(Shape{kT, kR}, 1.5f);
  const Tensor w = host(Shape{kHeads * 256, kL}, 0.05f);
  for (int i = 0; i < kL; ++i) store_f32(kv.data(), DType::bf16, int64_t{kT - 1} * kL + i, i % 2 ? 900.f : -900.f);
  float want = 0.f;
  for (int t = 0; t < kT - 1; ++t) {
    for (int i = 0; i < kL; ++i) want = std::max(want, std::fabs(load_f32(kv.data(), DType::bf16, int64_t{t} * kL + i)));
    for (int i = 0; i < kR; ++i) want = std::max(want, std::fabs(load_f32(pe.data(), DType::bf16, int64_t{t} * kR + i)));
  }
  want /= 448.f;
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, kT - 1};
  args.seq_lens = {kT - 1};
  args.block_table = {1};
  args.max_num_blocks_per_req = 1;
  for (int t = 0; t < kT - 1; ++t) args.slot_mapping.push_back(64 + t);
  args.slot_mapping.push_back(-1);
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda);
  std::vector<std::vector<uint8_t>> caches;
  for (const bool calculate : {true, false}) {
    MLAAttention layer(mla_params(calculate));
    if (!calculate) layer.scales().k_scale = want;
    layer.process_weights_after_loading(w.to(Device::cuda));
    Tensor cache = layer.allocate_kv_cache(4);
    cache.fill_bytes(0);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(4, 64, 256), Device::cuda);
    auto md = builder->build(0, common.common);
    Tensor out(Shape{kT, kHeads, 128}, DType::bf16, Device::cuda);
    layer.forward(q.to(Device::cuda), kv.to(Device::cuda), pe.to(Device::cuda), cache, *md, out);
    EXPECT_EQ(layer.scales().k_scale, want) << (calculate ? "measured" : "given");
    EXPECT_FALSE(layer.kv_scales_pending());
    caches.push_back(host_bytes(cache));
  }
  EXPECT_EQ(caches[0], caches[1]);
}

}  // namespace
}  // namespace pagedattn
