// Rejected calls leave the KV cache byte-identical (rejected_calls.h). The batch is the one of
// the data-safety report: two requests (a decode at position 20 and a 5-token prefill with 9
// cached tokens), block size 16, a cache of 5 blocks; each case changes one value the call
// reads and expects an Error with every cache byte unchanged.
#include "conformance/rejected_calls.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/mla.h"

namespace pagedattn::testing {
namespace {

constexpr int kBlockSize = 16;
constexpr int kCacheBlocks = 5;
constexpr int kCols = 3;
constexpr int32_t kHuge = std::numeric_limits<int32_t>::max();

// Random values of `dtype` on `device` (never zeros: a write of zeros would go unseen).
Tensor random_tensor(const Shape& shape, DType dtype, Device device, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Tensor host(shape, dtype, Device::cpu);
  for (int64_t i = 0; i < host.numel(); ++i) store_f32(host.data(), dtype, i, dist(rng) + 0.01f);
  return device == Device::cpu ? std::move(host) : host.to(device);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor host = t.to(Device::cpu);
  const auto* p = static_cast<const uint8_t*>(host.data());
  return {p, p + host.nbytes()};
}

struct Batch {
  std::vector<int32_t> block_table;  // (2, kCols)
  std::vector<int64_t> slots;        // (6,)
};

// A valid batch for the 5-block cache: request 0 reads blocks {1, 0}, request 1 block {4}.
Batch valid_batch() { return {{1, 0, 3, 4, 3, 3}, {4, 73, 74, 75, 76, 77}}; }

OwnedCommonAttentionMetadata make_metadata(const Batch& b, Device device) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 1, 6};
  args.seq_lens = {21, 14};
  args.block_table = b.block_table;
  args.max_num_blocks_per_req = kCols;
  args.slot_mapping = b.slots;
  // No cache size: the ranges are checked against the cache the forward gets.
  return make_common_attention_metadata(args, device);
}

struct Case {
  const char* name;
  Batch batch;
  std::optional<float> output_scale;  // fp8 output with this divisor (backends that fuse it)
};

std::vector<Case> rejected_cases() {
  return {
      {"block id = num_blocks", {{5, 0, 3, 4, 3, 3}, valid_batch().slots}, {}},
      {"block id -1", {{1, -1, 3, 4, 3, 3}, valid_batch().slots}, {}},
      {"block id 2^31-1", {{1, 0, 3, kHuge, 3, 3}, valid_batch().slots}, {}},
      // Valid for a 9-block cache, run on the 5-block one.
      {"plan for a larger cache", {{8, 0, 3, 4, 3, 3}, valid_batch().slots}, {}},
      {"slot past the cache", {valid_batch().block_table, {4, 73, 74, 75, 76, 8 * 16 + 3}}, {}},
  };
}

// Runs `call` and expects an Error with the cache unchanged (`label` names the case).
void expect_rejected(const char* label, const Tensor& kv_cache, const std::function<void()>& call) {
  const std::vector<uint8_t> before = bytes_of(kv_cache);
  EXPECT_THROW(call(), Error) << label;
  EXPECT_TRUE(before == bytes_of(kv_cache)) << label << ": the rejected call changed the cache";
}

}  // namespace

void expect_rejected_forwards_leave_cache_untouched(const std::string& backend, Device device) {
  std::mt19937 rng(20261126);
  AttentionLayerParams p;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_size = 64;
  p.block_size = kBlockSize;
  p.dtype = DType::bf16;
  p.device = device;
  p.backend = backend;
  p.prefix = "layers.0.attn";
  Attention layer(p);
  const Tensor kv_cache = [&] {
    const Tensor shape_only = layer.allocate_kv_cache(kCacheBlocks);
    Tensor filled = random_tensor(shape_only.shape(), shape_only.dtype(), device, rng);
    return filled;
  }();
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 512),
                                              device);
  const Tensor q = random_tensor(Shape{6, 4, 64}, DType::bf16, device, rng);
  const Tensor k = random_tensor(Shape{6, 2, 64}, DType::bf16, device, rng);
  const Tensor v = random_tensor(Shape{6, 2, 64}, DType::bf16, device, rng);
  const Tensor out = random_tensor(Shape{6, 4, 64}, DType::bf16, device, rng);
  const bool fused_fp8 = layer.impl().fused_output_quant_supported(QuantKey{});

  Tensor fp8_out(Shape{6, 4, 64}, DType::fp8_e4m3, device);
  const auto forward = [&](const Batch& b, std::optional<float> output_scale) {
    const OwnedCommonAttentionMetadata common = make_metadata(b, device);
    const auto plan = builder->build(0, common.common);
    if (!output_scale) {
      layer.forward(q, k, v, kv_cache, *plan, out);
      return;
    }
    Tensor scale(Shape{1}, DType::f32, Device::cpu);
    scale.data_as<float>()[0] = *output_scale;
    layer.forward(q, k, v, kv_cache, *plan, fp8_out, {}, scale.to(device));
  };

  for (const Case& c : rejected_cases()) {
    expect_rejected(c.name, kv_cache, [&] { forward(c.batch, c.output_scale); });
  }
  // Control: the valid call runs and writes the cache (so the comparisons above could fail).
  const std::vector<uint8_t> before = bytes_of(kv_cache);
  EXPECT_NO_THROW(forward(valid_batch(), std::nullopt));
  EXPECT_FALSE(before == bytes_of(kv_cache)) << "the valid call wrote nothing";
  if (fused_fp8) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (const float bad : {0.f, -1.f, nan, std::numeric_limits<float>::infinity()}) {
      if (device == Device::cpu) {
        expect_rejected("output_scale", kv_cache, [&] { forward(valid_batch(), bad); });
        continue;
      }
      // A device scale is read by the kernels (graph-safe, no host sync): an invalid one is not
      // rejected but makes every output element NaN (e4m3 0x7F / 0xFF), never a finite value.
      fp8_out.fill_bytes(0);
      EXPECT_NO_THROW(forward(valid_batch(), bad));
      const Tensor host = fp8_out.to(Device::cpu);
      int64_t finite = 0;
      for (int64_t i = 0; i < host.numel(); ++i) finite += (static_cast<const uint8_t*>(host.data())[i] & 0x7F) != 0x7F;
      EXPECT_EQ(finite, 0) << backend << ": output_scale = " << bad << " left finite output elements";
    }
    EXPECT_NO_THROW(forward(valid_batch(), 0.5f)) << "fp8 output control";
  }
}

void expect_rejected_mla_forwards_leave_cache_untouched(const std::string& backend, Device device) {
  std::mt19937 rng(20261127);
  MLAAttentionLayerParams p;
  // The CUDA decode kernel needs DeepSeek's latent rows (512 + 64); the host ones take any.
  const bool deepseek = device == Device::cuda;
  p.num_heads = deepseek ? 16 : 4;
  p.kv_lora_rank = deepseek ? 512 : 64;
  p.qk_nope_head_dim = deepseek ? 128 : 32;
  p.qk_rope_head_dim = deepseek ? 64 : 16;
  p.qk_head_dim = p.qk_nope_head_dim + p.qk_rope_head_dim;
  p.v_head_dim = deepseek ? 128 : 32;
  p.block_size = kBlockSize;
  p.dtype = DType::bf16;
  p.device = device;
  p.backend = backend;
  p.prefix = "layers.0.mla";
  MLAAttention layer(p);
  const int64_t H = p.num_heads, L = p.kv_lora_rank, R = p.qk_rope_head_dim;
  const Tensor weight = random_tensor(Shape{H * (p.qk_nope_head_dim + p.v_head_dim), L},
                                      DType::bf16, device, rng);
  layer.process_weights_after_loading(weight);
  const Tensor kv_cache = [&] {
    const Tensor shape_only = layer.allocate_kv_cache(kCacheBlocks);
    return random_tensor(shape_only.shape(), shape_only.dtype(), device, rng);
  }();
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 512),
                                              device);
  const Tensor q = random_tensor(Shape{6, H, p.qk_head_dim}, DType::bf16, device, rng);
  const Tensor kv_c = random_tensor(Shape{6, L}, DType::bf16, device, rng);
  const Tensor k_pe = random_tensor(Shape{6, R}, DType::bf16, device, rng);
  const Tensor out = random_tensor(Shape{6, H, p.v_head_dim}, DType::bf16, device, rng);
  const auto forward = [&](const Batch& b) {
    const OwnedCommonAttentionMetadata common = make_metadata(b, device);
    const auto plan = builder->build(0, common.common);
    layer.forward(q, kv_c, k_pe, kv_cache, *plan, out);
  };
  for (const Case& c : rejected_cases()) {
    expect_rejected(c.name, kv_cache, [&] { forward(c.batch); });
  }
  const std::vector<uint8_t> before = bytes_of(kv_cache);
  EXPECT_NO_THROW(forward(valid_batch()));
  EXPECT_FALSE(before == bytes_of(kv_cache)) << "the valid call wrote nothing";
}

}  // namespace pagedattn::testing
