// MLA cache spec, concat_and_cache_mla, gather_and_maybe_dequant_cache and the workspace rule:
// hand-computed values, fp8, skipped slots, and bad inputs that must leave the cache untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

Tensor random_host(Shape shape, DType dtype, std::mt19937& rng, float lo = -2.f, float hi = 2.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

Tensor i64s(std::vector<int64_t> v) {
  Tensor t(Shape{static_cast<int64_t>(v.size())}, DType::i64);
  std::memcpy(t.data(), v.data(), v.size() * 8);
  return t;
}

Tensor i32s(std::vector<int32_t> v, Shape shape) {
  Tensor t(shape, DType::i32);
  std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

void expect_error(const std::function<void()>& fn, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
  }
}

// ---- spec ----------------------------------------------------------------------------------

TEST(MLASpec, PageSizeIsOneLatentRowPerToken) {
  const MLADimensions ds{512, 128, 64, 128};
  const KVCacheSpec bf16 = mla_attention_spec(16, ds, DType::bf16);
  EXPECT_EQ(bf16.kind, KVCacheSpecKind::mla);
  EXPECT_EQ(bf16.num_kv_heads, 1);
  EXPECT_EQ(bf16.head_size, 576);
  EXPECT_EQ(bf16.dtype, DType::bf16);
  EXPECT_EQ(bf16.page_size_bytes(), 16 * 576 * 2);
  const KVCacheSpec fp8 = mla_attention_spec(64, ds, DType::bf16, "fp8");
  EXPECT_EQ(fp8.dtype, DType::fp8_e4m3);
  EXPECT_EQ(fp8.page_size_bytes(), 64 * 576);
  EXPECT_EQ(mla_attention_spec(1, {64, 32, 16, 32}, DType::f32).page_size_bytes(), 80 * 4);
  EXPECT_EQ(mla_attention_spec(16, ds, DType::f16, "fp8_e5m2").dtype, DType::fp8_e5m2);
  EXPECT_EQ(bf16.max_num_blocks_per_request(1000, 64), 63);  // cdiv(1000, 16)
  expect_error([&] { mla_attention_spec(16, {0, 128, 64, 128}, DType::bf16); },
               "mla_dimensions.kv_lora_rank");
  expect_error([&] { mla_attention_spec(16, {512, 128, 0, 128}, DType::bf16); },
               "mla_dimensions.qk_rope_head_dim");
  expect_error([&] { mla_attention_spec(0, ds, DType::bf16); }, "block_size");
  expect_error([&] { mla_attention_spec(16, ds, DType::fp8_e4m3); }, "activation_dtype");
  expect_error([&] { mla_attention_spec(16, ds, DType::bf16, "int8"); }, "kv_cache_dtype");
}

// ---- concat_and_cache_mla --------------------------------------------------------------------

struct ConcatFixture {
  static constexpr int64_t kL = 8, kR = 4, kN = 5, kBlocks = 3, kBs = 4;
  std::mt19937 rng{7};
  Tensor kv_c = random_host(Shape{kN, kL}, DType::f32, rng);
  Tensor k_pe = random_host(Shape{kN, kR}, DType::f32, rng);
};

TEST(MLAConcat, WritesLatentThenRopeAndSkipsMinusOne) {
  ConcatFixture f;
  Tensor cache = random_host(Shape{3, 4, 12}, DType::f32, f.rng);
  const std::vector<uint8_t> before = bytes_of(cache);
  const std::vector<int64_t> slots = {5, -1, 0, 11, 7};
  concat_and_cache_mla(f.kv_c, f.k_pe, cache, i64s(slots), "auto");
  std::vector<bool> written(12, false);
  for (int t = 0; t < 5; ++t) {
    if (slots[t] < 0) continue;
    written[slots[t]] = true;
    const float* row = cache.data_as<float>() + slots[t] * 12;
    for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], f.kv_c.data_as<float>()[t * 8 + i]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(row[8 + i], f.k_pe.data_as<float>()[t * 4 + i]);
  }
  for (int s = 0; s < 12; ++s) {  // untouched rows keep their bytes
    if (!written[s]) EXPECT_EQ(std::memcmp(cache.data_as<float>() + s * 12, before.data() + s * 48, 48), 0);
  }
}

TEST(MLAConcat, ThreeDimRopeShortSlotMappingAndConversion) {
  ConcatFixture f;
  Tensor pe3 = Tensor(Shape{5, 1, 4}, DType::f32);
  std::memcpy(pe3.data(), f.k_pe.data(), f.k_pe.nbytes());
  Tensor kv_bf = random_host(Shape{5, 8}, DType::bf16, f.rng);
  Tensor pe_bf = random_host(Shape{5, 1, 4}, DType::bf16, f.rng);
  Tensor cache(Shape{2, 4, 12}, DType::f32);  // kv_cache_dtype "float32" with bf16 activations
  cache.fill_bytes(0);
  concat_and_cache_mla(kv_bf, pe_bf, cache, i64s({3, 4}), "float32");  // tokens 0, 1 only
  for (int t = 0; t < 2; ++t) {
    const float* row = cache.data_as<float>() + (3 + t) * 12;
    for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], load_f32(kv_bf.data(), DType::bf16, t * 8 + i));
    for (int i = 0; i < 4; ++i) EXPECT_EQ(row[8 + i], load_f32(pe_bf.data(), DType::bf16, t * 4 + i));
  }
  EXPECT_EQ(cache.data_as<float>()[5 * 12], 0.f);  // token 2 is past slot_mapping: not written
}

TEST(MLAConcat, Fp8StoresScaledSaturatedValues) {
  ConcatFixture f;
  const float scale = 0.004f;  // |x| / scale up to 500: e4m3 saturates at 448
  for (const char* kv : {"fp8", "fp8_e5m2"}) {
    const DType dt = kv_cache_storage_dtype(kv, DType::f32);
    Tensor cache(Shape{3, 4, 12}, dt);
    cache.fill_bytes(0);
    concat_and_cache_mla(f.kv_c, f.k_pe, cache, i64s({1, 2, 3, 4, 9}), kv, scale);
    const std::vector<int64_t> slots = {1, 2, 3, 4, 9};
    for (int t = 0; t < 5; ++t) {
      const auto* row = cache.data_as<uint8_t>() + slots[t] * 12;
      for (int i = 0; i < 12; ++i) {
        const float x = i < 8 ? f.kv_c.data_as<float>()[t * 8 + i]
                              : f.k_pe.data_as<float>()[t * 4 + i - 8];
        const uint8_t want = dt == DType::fp8_e4m3 ? f32_to_fp8_e4m3_bits(x / scale)
                                                   : f32_to_fp8_e5m2_bits(x / scale);
        EXPECT_EQ(row[i], want) << kv << " token " << t << " element " << i;
      }
    }
  }
}

TEST(MLAConcat, BadInputsThrowAndLeaveTheCacheUntouched) {
  ConcatFixture f;
  Tensor cache = random_host(Shape{3, 4, 12}, DType::f32, f.rng);
  const std::vector<uint8_t> before = bytes_of(cache);
  const Tensor good_slots = i64s({0, 1, 2, 3, 4});
  const auto run = [&](const std::function<void()>& fn, const std::string& arg) {
    expect_error(fn, arg);
    EXPECT_EQ(bytes_of(cache), before) << "cache changed by a call that failed on " << arg;
  };
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, i64s({0, 1, 2, 3, 12}), "auto"); },
      "slot_mapping");  // out of range, the last token: nothing written before the check
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, i64s({0, -2}), "auto"); }, "slot_mapping");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, i64s({0, 1, 2, 3, 4, 5}), "auto"); },
      "slot_mapping");  // longer than the tokens
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, i32s({0, 1}, Shape{2}), "auto"); },
      "slot_mapping");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, good_slots, "fp8"); }, "kv_cache");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, good_slots, "int4"); }, "kv_cache_dtype");
  Tensor short_pe = random_host(Shape{4, 4}, DType::f32, f.rng);
  run([&] { concat_and_cache_mla(f.kv_c, short_pe, cache, good_slots, "auto"); }, "k_pe");
  Tensor wide_pe = random_host(Shape{5, 2, 4}, DType::f32, f.rng);
  run([&] { concat_and_cache_mla(f.kv_c, wide_pe, cache, good_slots, "auto"); }, "k_pe");
  Tensor pe_bf = random_host(Shape{5, 4}, DType::bf16, f.rng);
  run([&] { concat_and_cache_mla(f.kv_c, pe_bf, cache, good_slots, "auto"); }, "k_pe");
  Tensor kv_wide = random_host(Shape{5, 9}, DType::f32, f.rng);
  run([&] { concat_and_cache_mla(kv_wide, f.k_pe, cache, good_slots, "auto"); }, "kv_cache");
  Tensor kv_int(Shape{5, 8}, DType::i32);
  run([&] { concat_and_cache_mla(kv_int, f.k_pe, cache, good_slots, "auto"); }, "kv_c");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, good_slots, "auto", 0.f); }, "scale");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, TensorView{}, good_slots, "auto"); }, "kv_cache");
  run([&] { concat_and_cache_mla(f.kv_c, f.k_pe, cache, TensorView{}, "auto"); }, "slot_mapping");
  // A non-contiguous last dim is refused (the CUDA kernel reads rows).
  const TensorView strided(f.kv_c.data(), DType::f32, Shape{5, 4}, Shape{8, 2});
  Tensor pe_small = random_host(Shape{5, 8}, DType::f32, f.rng);
  run([&] { concat_and_cache_mla(strided, pe_small, cache, good_slots, "auto"); }, "kv_c");
}

// ---- gather_and_maybe_dequant_cache -------------------------------------------------------

TEST(MLAGather, ReadsTokenPositionsThroughTheBlockTable) {
  std::mt19937 rng(3);
  const int bs = 4, row = 6;
  Tensor cache = random_host(Shape{5, bs, row}, DType::bf16, rng);
  // request 0: blocks 3, 1, 4; positions [2, 7); request 1: blocks 0, 2; positions [4, 7)
  Tensor bt = i32s({3, 1, 4, 0, 2, 0}, Shape{2, 3});
  Tensor cu = i32s({0, 5, 8}, Shape{3});
  Tensor starts = i32s({2, 4}, Shape{2});
  Tensor dst(Shape{10, row}, DType::f32);
  dst.fill_bytes(0xFF);
  gather_and_maybe_dequant_cache(cache, dst, bt, cu, 2, "bfloat16", 1.f, starts);
  const int blocks[2][3] = {{3, 1, 4}, {0, 2, 0}};
  const int start[2] = {2, 4}, begin[2] = {0, 5}, len[2] = {5, 3};
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < len[r]; ++i) {
      const int pos = start[r] + i;
      const int64_t src = (int64_t{blocks[r][pos / bs]} * bs + pos % bs) * row;
      for (int j = 0; j < row; ++j) {
        EXPECT_EQ(dst.data_as<float>()[(begin[r] + i) * row + j],
                  load_f32(cache.data(), DType::bf16, src + j));
      }
    }
  }
  for (int j = 0; j < 2 * row; ++j) EXPECT_TRUE(std::isnan(dst.data_as<float>()[8 * row + j]));
  // No seq_starts: positions from 0.
  gather_and_maybe_dequant_cache(cache, dst, bt, cu, 2, "bfloat16");
  for (int j = 0; j < row; ++j) {
    EXPECT_EQ(dst.data_as<float>()[5 * row + j], load_f32(cache.data(), DType::bf16, j));  // block 0
  }
}

TEST(MLAGather, DequantizesFp8WithTheScale) {
  std::mt19937 rng(5);
  Tensor cache(Shape{2, 4, 3}, DType::fp8_e4m3);
  for (int64_t i = 0; i < cache.numel(); ++i) {
    cache.data_as<uint8_t>()[i] = f32_to_fp8_e4m3_bits(std::uniform_real_distribution<float>(-40.f, 40.f)(rng));
  }
  Tensor bt = i32s({1, 0}, Shape{1, 2});
  Tensor cu = i32s({0, 6}, Shape{2});
  Tensor dst(Shape{6, 3}, DType::bf16);
  gather_and_maybe_dequant_cache(cache, dst, bt, cu, 1, "fp8", 0.25f);
  for (int pos = 0; pos < 6; ++pos) {
    const int block = pos < 4 ? 1 : 0;
    for (int j = 0; j < 3; ++j) {
      const float want = fp8_e4m3_bits_to_f32(cache.data_as<uint8_t>()[(block * 4 + pos % 4) * 3 + j]) * 0.25f;
      EXPECT_EQ(load_f32(dst.data(), DType::bf16, pos * 3 + j),
                bf16_bits_to_f32(f32_to_bf16_bits(want)));
    }
  }
}

TEST(MLAGather, BadInputsThrowAndLeaveDstUntouched) {
  std::mt19937 rng(9);
  Tensor cache = random_host(Shape{3, 4, 6}, DType::f32, rng);
  Tensor dst = random_host(Shape{8, 6}, DType::f32, rng);
  const std::vector<uint8_t> before = bytes_of(dst);
  Tensor bt = i32s({0, 1, 2, 5}, Shape{2, 2});  // row 1 uses block 5: out of range
  const auto run = [&](const std::function<void()>& fn, const std::string& arg) {
    expect_error(fn, arg);
    EXPECT_EQ(bytes_of(dst), before) << "dst changed by a call that failed on " << arg;
  };
  run([&] { gather_and_maybe_dequant_cache(cache, dst, bt, i32s({0, 3, 8}, Shape{3}), 2, "auto"); },
      "block_table");
  Tensor good_bt = i32s({0, 1, 2, 1}, Shape{2, 2});
  run([&] { gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 9, 8}, Shape{3}), 2, "auto"); },
      "cu_seq_lens");  // past dst's rows / decreasing
  run([&] {
        gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 7}, Shape{2}), 1, "auto", 1.f,
                                       i32s({2}, Shape{1}));
      },
      "block_table");  // positions [2, 9) need 3 columns
  run([&] { gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 2}, Shape{2}), 2, "auto"); },
      "cu_seq_lens");  // too short for batch_size 2
  run([&] { gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 2, 3}, Shape{3}), 2, "fp8"); },
      "src_cache");
  run([&] { gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 2, 3}, Shape{3}), 3, "auto"); },
      "block_table");
  run([&] {
        gather_and_maybe_dequant_cache(cache, dst, good_bt, i32s({0, 2, 3}, Shape{3}), 2, "auto",
                                       1.f, i32s({-1, 0}, Shape{2}));
      },
      "seq_starts");
  Tensor narrow_dst = random_host(Shape{8, 5}, DType::f32, rng);
  expect_error([&] { gather_and_maybe_dequant_cache(cache, narrow_dst, good_bt, i32s({0, 1, 2}, Shape{3}), 2, "auto"); },
               "src_cache");
}

// ---- workspace rule --------------------------------------------------------------------------

TEST(MLAWorkspaceRule, MatchesVllmByHand) {
  // min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 Ki), >= max_num_seqs * bs
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(8192, 256, 16), 65536);
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(1024, 8, 16), 8192);
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(100, 64, 64), 16384);
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(4, 1, 16), 64);
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(200000, 8, 16), 65536);
  EXPECT_EQ(mla_chunked_prefill_workspace_tokens(100, 2048, 64), 131072);  // the floor
  expect_error([] { mla_chunked_prefill_workspace_tokens(0, 8, 16); }, "max_model_len");
  expect_error([] { mla_chunked_prefill_workspace_tokens(8, 0, 16); }, "max_num_seqs");
  expect_error([] { mla_chunked_prefill_workspace_tokens(8, 8, 0); }, "block_size");
}

}  // namespace
}  // namespace pagedattn
