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

// Runs `call` and expects an Error with the cache unchanged (`label` names the case); when
// `argument` is given, the Error must name it.
void expect_rejected(const char* label, const Tensor& kv_cache, const std::function<void()>& call,
                     const char* argument = nullptr) {
  const std::vector<uint8_t> before = bytes_of(kv_cache);
  try {
    call();
    ADD_FAILURE() << label << ": expected an Error";
  } catch (const Error& e) {
    if (argument != nullptr) EXPECT_EQ(e.argument(), argument) << label << ": " << e.what();
  }
  EXPECT_TRUE(before == bytes_of(kv_cache)) << label << ": the rejected call changed the cache";
}

// output_scale values that are not a positive finite number.
std::vector<float> bad_scales() {
  return {0.f, -1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()};
}

// Counts the e4m3 bytes of `out` that are not NaN (0x7F / 0xFF).
int64_t finite_e4m3(const Tensor& out) {
  const Tensor host = out.to(Device::cpu);
  int64_t finite = 0;
  for (int64_t i = 0; i < host.numel(); ++i) finite += (static_cast<const uint8_t*>(host.data())[i] & 0x7F) != 0x7F;
  return finite;
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
      EXPECT_EQ(finite_e4m3(fp8_out), 0) << backend << ": output_scale = " << bad << " left finite output elements";
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
  Tensor fp8_out(Shape{6, H, p.v_head_dim}, DType::fp8_e4m3, device);
  const bool fused_fp8 = layer.impl().fused_output_quant_supported(QuantKey{});
  // output_scale: a float32 (1,) scale with this value (nullopt: none); scale_tensor: the one to
  // pass instead (a malformed one); output: the output to write (default: bf16 without a scale,
  // fp8 with one).
  const auto forward = [&](const Batch& b, std::optional<float> output_scale = std::nullopt,
                           const Tensor* output = nullptr, const Tensor* scale_tensor = nullptr) {
    const OwnedCommonAttentionMetadata common = make_metadata(b, device);
    const auto plan = builder->build(0, common.common);
    if (!output_scale && scale_tensor == nullptr) {
      layer.forward(q, kv_c, k_pe, kv_cache, *plan, output != nullptr ? *output : out);
      return;
    }
    Tensor scale(Shape{1}, DType::f32, Device::cpu);
    scale.data_as<float>()[0] = output_scale.value_or(1.f);
    const Tensor dev_scale = scale.to(device);
    layer.forward(q, kv_c, k_pe, kv_cache, *plan, output != nullptr ? *output : fp8_out, {},
                  scale_tensor != nullptr ? *scale_tensor : dev_scale);
  };
  for (const Case& c : rejected_cases()) {
    expect_rejected(c.name, kv_cache, [&] { forward(c.batch); });
    // With fused fp8 output, the same block-table checks run before the cache write.
    if (fused_fp8) expect_rejected(c.name, kv_cache, [&] { forward(c.batch, 0.5f); });
  }
  // fp8 output arguments, checked before the cache write (the valid batch otherwise).
  if (!fused_fp8) {
    expect_rejected("output_scale on a backend without fused fp8 output", kv_cache,
                    [&] { forward(valid_batch(), 0.5f); }, "output_scale");
  } else {
    expect_rejected("output_scale with a bfloat16 output", kv_cache,
                    [&] { forward(valid_batch(), 0.5f, &out); }, "output");
    expect_rejected("fp8 output without output_scale", kv_cache,
                    [&] { forward(valid_batch(), std::nullopt, &fp8_out); }, "output");
    const Tensor f16_scale = random_tensor(Shape{1}, DType::f16, device, rng);
    const Tensor two_scales = random_tensor(Shape{2}, DType::f32, device, rng);
    expect_rejected("float16 output_scale", kv_cache,
                    [&] { forward(valid_batch(), std::nullopt, nullptr, &f16_scale); }, "output_scale");
    expect_rejected("output_scale of shape (2,)", kv_cache,
                    [&] { forward(valid_batch(), std::nullopt, nullptr, &two_scales); }, "output_scale");
    if (device != Device::cpu) {
      const Tensor host_scale = random_tensor(Shape{1}, DType::f32, Device::cpu, rng);
      expect_rejected("output_scale on the host", kv_cache,
                      [&] { forward(valid_batch(), std::nullopt, nullptr, &host_scale); }, "output_scale");
    }
    if (device == Device::cpu) {
      for (const float bad : bad_scales()) {
        expect_rejected("output_scale value", kv_cache, [&] { forward(valid_batch(), bad); },
                        "output_scale");
      }
    }
  }
  // Control: the valid call runs and writes the cache (so the comparisons above could fail).
  const std::vector<uint8_t> before = bytes_of(kv_cache);
  EXPECT_NO_THROW(forward(valid_batch()));
  EXPECT_FALSE(before == bytes_of(kv_cache)) << "the valid call wrote nothing";
  if (!fused_fp8) return;
  if (device != Device::cpu) {
    // A device scale is read by the quantize pass (graph-safe, no host sync): an invalid one
    // makes every output element NaN instead of a finite value.
    for (const float bad : bad_scales()) {
      fp8_out.fill_bytes(0);
      EXPECT_NO_THROW(forward(valid_batch(), bad));
      EXPECT_EQ(finite_e4m3(fp8_out), 0) << backend << ": output_scale = " << bad << " left finite output elements";
    }
  }
  fp8_out.fill_bytes(0x7F);  // NaN: every element must be written
  EXPECT_NO_THROW(forward(valid_batch(), 0.5f)) << "fp8 output control";
  EXPECT_EQ(finite_e4m3(fp8_out), fp8_out.numel()) << backend << ": fp8 output elements left unwritten";
}

}  // namespace pagedattn::testing
