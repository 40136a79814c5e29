// KV cache: spec sizes against hand-worked numbers, layout selection precedence, key/value views,
// physical contiguity of allocated caches, and the block pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn {
namespace {

// ---- specs -------------------------------------------------------------------------------------

TEST(KVCacheSpec, FullAttentionPageSizeAndBlocks) {
  const KVCacheSpec s = KVCacheSpec::full_attention(16, 8, 128, DType::bf16);
  EXPECT_EQ(s.kind, KVCacheSpecKind::full_attention);
  EXPECT_EQ(s.page_size_bytes(), 65536);  // 2 * 16 * 8 * 128 * 2
  EXPECT_EQ(s.max_num_blocks_per_request(4096, 2048), 256);
  EXPECT_EQ(s.max_num_blocks_per_request(4097, 2048), 257);
  EXPECT_EQ(s.max_memory_usage_bytes(4096, 2048), 256 * 65536);
  EXPECT_EQ(s.value_head_size(), 128);
  EXPECT_EQ(KVCacheSpec::full_attention(16, 8, 128, DType::fp8_e4m3).page_size_bytes(), 32768);
  EXPECT_EQ(KVCacheSpec::full_attention(32, 2, 64, DType::f32).page_size_bytes(), 32768);
  EXPECT_EQ(s.describe(),
            "full_attention(block_size=16, num_kv_heads=8, head_size=128, dtype=bfloat16, "
            "page_size_bytes=65536)");
}

TEST(KVCacheSpec, DifferentValueHeadSizeUsesTheLarger) {
  // Keys 192, values 128: the cache's last dim is 192 -> 2 * 16 * 8 * 192 * 2.
  const KVCacheSpec s = KVCacheSpec::full_attention(16, 8, 192, DType::bf16, 128);
  EXPECT_EQ(s.value_head_size(), 128);
  EXPECT_EQ(s.page_size_bytes(), 98304);
  // Values larger than keys: the last dim is the value size.
  EXPECT_EQ(KVCacheSpec::full_attention(16, 1, 64, DType::f16, 96).page_size_bytes(),
            2 * 16 * 1 * 96 * 2);
  EXPECT_NE(s.describe().find("head_size_v=128"), std::string::npos) << s.describe();
}

TEST(KVCacheSpec, SlidingWindow) {
  const KVCacheSpec s = KVCacheSpec::sliding_window_attention(16, 8, 128, DType::bf16, 128);
  EXPECT_EQ(s.page_size_bytes(), 65536);
  // min(128 - 1 + 512, 8192) = 639 tokens -> cdiv(639, 16) = 40, + 1 = 41.
  EXPECT_EQ(s.max_num_blocks_per_request(8192, 512), 41);
  // min(639, 300) = 300 -> cdiv(300, 16) = 19, + 1 = 20.
  EXPECT_EQ(s.max_num_blocks_per_request(300, 512), 20);
  EXPECT_EQ(s.max_memory_usage_bytes(300, 512), 20 * 65536);
  EXPECT_NE(s.describe().find("sliding_window=128"), std::string::npos);
  EXPECT_THROW(KVCacheSpec::sliding_window_attention(16, 8, 128, DType::bf16, 0), Error);
}

TEST(KVCacheSpec, ChunkedLocalAttention) {
  const KVCacheSpec s = KVCacheSpec::chunked_local_attention(16, 8, 128, DType::bf16, 8192);
  // min(8192 + 2048, 131072) = 10240 -> 640 blocks.
  EXPECT_EQ(s.max_num_blocks_per_request(131072, 2048), 640);
  // min(10240, 4000) = 4000 -> 250 blocks.
  EXPECT_EQ(s.max_num_blocks_per_request(4000, 2048), 250);
  EXPECT_EQ(s.attention_chunk_size, 8192);
  EXPECT_THROW(KVCacheSpec::chunked_local_attention(16, 8, 128, DType::bf16, -1), Error);
}

TEST(KVCacheSpec, CrossAttention) {
  const KVCacheSpec s = KVCacheSpec::cross_attention(16, 4, 64, DType::f16);
  EXPECT_EQ(s.page_size_bytes(), 2 * 16 * 4 * 64 * 2);
  EXPECT_EQ(s.max_num_blocks_per_request(448, 2048, 1500), 94);  // cdiv(1500, 16)
  EXPECT_EQ(s.max_num_blocks_per_request(448, 2048, 0), 0);
}

TEST(KVCacheSpec, Mla) {
  const KVCacheSpec s = KVCacheSpec::mla(64, 576, DType::bf16);  // kv_lora_rank 512 + rope 64
  EXPECT_EQ(s.num_kv_heads, 1);
  EXPECT_EQ(s.page_size_bytes(), 73728);  // 64 * 576 * 2, one latent per token (no factor 2)
  EXPECT_EQ(s.max_num_blocks_per_request(1000, 256), 16);
  EXPECT_EQ(s.max_memory_usage_bytes(1000, 256), 16 * 73728);
  EXPECT_EQ(KVCacheSpec::mla(64, 576, DType::fp8_e4m3).page_size_bytes(), 36864);
  EXPECT_EQ(s.describe(), "mla(block_size=64, latent_head_size=576, dtype=bfloat16, "
                          "page_size_bytes=73728)");
}

TEST(KVCacheSpec, InvalidArgumentsNameTheArgument) {
  auto argument_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  EXPECT_EQ(argument_of([] { KVCacheSpec::full_attention(0, 8, 128, DType::bf16); }),
            "block_size");
  EXPECT_EQ(argument_of([] { KVCacheSpec::full_attention(16, 0, 128, DType::bf16); }),
            "num_kv_heads");
  EXPECT_EQ(argument_of([] { KVCacheSpec::full_attention(16, 8, -4, DType::bf16); }),
            "head_size");
  EXPECT_EQ(argument_of([] { KVCacheSpec::full_attention(16, 8, 128, DType::i32); }), "dtype");
  EXPECT_EQ(argument_of([] { KVCacheSpec::mla(16, 0, DType::bf16); }), "head_size");
  const KVCacheSpec s = KVCacheSpec::full_attention(16, 8, 128, DType::bf16);
  EXPECT_EQ(argument_of([&] { s.max_num_blocks_per_request(0, 16); }), "max_model_len");
  EXPECT_EQ(kv_cache_spec_kind_name(KVCacheSpecKind::chunked_local_attention),
            "chunked_local_attention");
}

// ---- layout ------------------------------------------------------------------------------------

class LayoutTest : public ::testing::Test {
 protected:
  void SetUp() override { reset(); }
  void TearDown() override { reset(); }
  static void reset() {
    set_kv_cache_layout(std::nullopt);
    unsetenv("PAGEDATTN_KV_CACHE_LAYOUT");
  }
};

TEST_F(LayoutTest, NamesAndParsing) {
  EXPECT_EQ(kv_cache_layout_name(KVCacheLayout::NHD), "NHD");
  EXPECT_EQ(parse_kv_cache_layout("HND"), KVCacheLayout::HND);
  try {
    parse_kv_cache_layout("NDH");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_cache_layout");
    EXPECT_NE(std::string(e.what()).find("'NDH'"), std::string::npos);
  }
}

TEST_F(LayoutTest, PrecedenceOverrideThenEnvThenDefault) {
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::NHD);  // default
  setenv("PAGEDATTN_KV_CACHE_LAYOUT", "HND", 1);
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::HND);  // env, read at each call
  setenv("PAGEDATTN_KV_CACHE_LAYOUT", "NHD", 1);
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::NHD);
  set_kv_cache_layout(KVCacheLayout::HND);
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::HND);  // override beats env
  setenv("PAGEDATTN_KV_CACHE_LAYOUT", "bogus", 1);
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::HND);  // env not even read
  set_kv_cache_layout(std::nullopt);
  try {
    get_kv_cache_layout();
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "PAGEDATTN_KV_CACHE_LAYOUT");
    EXPECT_NE(std::string(e.what()).find("PAGEDATTN_KV_CACHE_LAYOUT = 'bogus'"),
              std::string::npos)
        << e.what();
  }
  unsetenv("PAGEDATTN_KV_CACHE_LAYOUT");
  EXPECT_EQ(get_kv_cache_layout(), KVCacheLayout::NHD);
}

TEST(StrideOrder, StandardOrders) {
  EXPECT_EQ(standard_kv_cache_stride_order(KVCacheLayout::NHD), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(standard_kv_cache_stride_order(KVCacheLayout::HND), (std::vector<int>{0, 1, 3, 2, 4}));
}

// ---- allocation and views ----------------------------------------------------------------------

constexpr int64_t kN = 3, kB = 4, kH = 2, kD = 8;  // num_blocks, block_size, kv heads, head size

// Offset (in elements) of logical (kv, n, b, h, d) in memory laid out in `layout`'s order.
int64_t physical_offset(KVCacheLayout layout, int64_t kv, int64_t n, int64_t b, int64_t h,
                        int64_t d) {
  if (layout == KVCacheLayout::NHD) return (((kv * kN + n) * kB + b) * kH + h) * kD + d;
  return (((kv * kN + n) * kH + h) * kB + b) * kD + d;
}

class AllocateTest : public ::testing::TestWithParam<KVCacheLayout> {};

TEST_P(AllocateTest, PhysicallyContiguousInStrideOrder) {
  const KVCacheLayout layout = GetParam();
  const std::vector<int> order = standard_kv_cache_stride_order(layout);
  Tensor cache = allocate_paged_cache(Shape{2, kN, kB, kH, kD}, order, DType::bf16);
  EXPECT_EQ(cache.shape(), (Shape{2, kN, kB, kH, kD}));
  EXPECT_EQ(cache.nbytes(), static_cast<size_t>(2 * kN * kB * kH * kD * 2));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache.data()) % 64, 0u);
  if (layout == KVCacheLayout::HND) {
    EXPECT_EQ(cache.view().strides(), (Shape{kN * kH * kB * kD, kH * kB * kD, kD, kB * kD, 1}));
  } else {
    EXPECT_EQ(cache.view().strides(), (Shape{kN * kB * kH * kD, kB * kH * kD, kH * kD, kD, 1}));
  }
  // Every logical element lands at its physical offset, and together they tile the buffer.
  std::vector<int> hits(static_cast<size_t>(cache.numel()), 0);
  const auto* base = static_cast<const char*>(cache.data());
  for (int64_t kv = 0; kv < 2; ++kv)
    for (int64_t n = 0; n < kN; ++n)
      for (int64_t b = 0; b < kB; ++b)
        for (int64_t h = 0; h < kH; ++h)
          for (int64_t d = 0; d < kD; ++d) {
            const std::array<int64_t, 5> idx{kv, n, b, h, d};
            const int64_t off =
                (static_cast<const char*>(cache.view().element_ptr(idx)) - base) / 2;
            ASSERT_EQ(off, physical_offset(layout, kv, n, b, h, d));
            ++hits[static_cast<size_t>(off)];
          }
  EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int c) { return c == 1; }));
}

TEST_P(AllocateTest, SplitKvCacheViews) {
  const KVCacheLayout layout = GetParam();
  const std::vector<int> order = standard_kv_cache_stride_order(layout);
  Tensor cache = allocate_paged_cache(Shape{2, kN, kB, kH, kD}, order, DType::f16);
  const KVCacheViews v = split_kv_cache(cache, static_cast<int>(kD), static_cast<int>(kD));
  EXPECT_EQ(v.key_cache.shape(), (Shape{kN, kB, kH, kD}));
  EXPECT_EQ(v.value_cache.shape(), (Shape{kN, kB, kH, kD}));
  if (layout == KVCacheLayout::HND) {
    // block_size dim stride = head_size, head dim stride = block_size * head_size.
    EXPECT_EQ(v.key_cache.strides(), (Shape{kH * kB * kD, kD, kB * kD, 1}));
  } else {
    EXPECT_EQ(v.key_cache.strides(), (Shape{kB * kH * kD, kH * kD, kD, 1}));
  }
  EXPECT_EQ(v.value_cache.strides(), v.key_cache.strides());
  EXPECT_EQ(v.key_cache.data(), cache.data());
  EXPECT_EQ(static_cast<char*>(v.value_cache.data()) - static_cast<char*>(cache.data()),
            kN * kB * kH * kD * 2);
  EXPECT_EQ(v.key_cache.dtype(), DType::f16);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AllocateTest,
                         ::testing::Values(KVCacheLayout::NHD, KVCacheLayout::HND),
                         [](const auto& info) {
                           return std::string(kv_cache_layout_name(info.param));
                         });

TEST(SplitKvCache, DifferentValueHeadSize) {
  const std::vector<int> order = standard_kv_cache_stride_order(KVCacheLayout::NHD);
  Tensor cache = allocate_paged_cache(Shape{2, 2, 16, 1, 192}, order, DType::bf16);
  const KVCacheViews v = split_kv_cache(cache, 192, 128);
  EXPECT_EQ(v.key_cache.shape(), (Shape{2, 16, 1, 192}));
  EXPECT_EQ(v.value_cache.shape(), (Shape{2, 16, 1, 128}));
  EXPECT_EQ(v.value_cache.strides(), (Shape{16 * 192, 192, 192, 1}));
  EXPECT_EQ(split_kv_cache(cache, 192, 0).value_cache.shape(), (Shape{2, 16, 1, 192}));
}

TEST(SplitKvCache, RejectsBadCaches) {
  auto argument_of = [](const TensorView& t, int hs, int hsv) -> std::string {
    try {
      split_kv_cache(t, hs, hsv);
    } catch (const Error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  Tensor four_d(Shape{2, 3, 4, 8}, DType::bf16);
  EXPECT_EQ(argument_of(four_d, 8, 8), "kv_cache");
  Tensor three_halves(Shape{3, 2, 4, 2, 8}, DType::bf16);
  EXPECT_EQ(argument_of(three_halves, 8, 8), "kv_cache");
  Tensor ok(Shape{2, 2, 4, 2, 8}, DType::bf16);
  EXPECT_EQ(argument_of(ok, 16, 8), "head_size");
  EXPECT_EQ(argument_of(ok, 8, 16), "head_size_v");
  EXPECT_EQ(argument_of(ok, 0, 8), "head_size");
  EXPECT_EQ(argument_of(TensorView(), 8, 8), "kv_cache");
  EXPECT_EQ(argument_of(ok, 8, 8), "(no error)");
}

TEST(AllocatePagedCache, RejectsBadStrideOrder) {
  const std::array<int, 5> repeated{0, 1, 2, 2, 4};
  EXPECT_THROW(allocate_paged_cache(Shape{2, 1, 16, 1, 64}, repeated, DType::bf16), Error);
  const std::array<int, 4> short_order{0, 1, 2, 3};
  EXPECT_THROW(allocate_paged_cache(Shape{2, 1, 16, 1, 64}, short_order, DType::bf16), Error);
}

// ---- block pool --------------------------------------------------------------------------------

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.argument() + " | " + e.what();
  }
  return "(no error)";
}

TEST(BlockPool, AllocatesLowestIdsFirstAndRefCounts) {
  BlockPool pool(8);
  EXPECT_EQ(pool.num_blocks(), 8);
  EXPECT_EQ(pool.num_free_blocks(), 8);
  EXPECT_EQ(pool.allocate(3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.allocate(2), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.ref_count(4), 1);
  EXPECT_EQ(pool.ref_count(5), 0);
  EXPECT_TRUE(pool.allocate(0).empty());
  EXPECT_TRUE(pool.can_allocate(3));
  EXPECT_FALSE(pool.can_allocate(4));
  EXPECT_FALSE(pool.can_allocate(-1));
  // Freed blocks come back in the order they were freed.
  const std::vector<int32_t> run{1, 3, 0};
  pool.free(run);
  EXPECT_EQ(pool.num_free_blocks(), 6);
  EXPECT_EQ(pool.ref_count(3), 0);
  EXPECT_EQ(pool.allocate(3), run);
}

TEST(BlockPool, ExhaustionTakesNothing) {
  BlockPool pool(4);
  const std::vector<int32_t> first = pool.allocate(3);
  const std::string err = error_of([&] { pool.allocate(2); });
  EXPECT_EQ(err.substr(0, err.find(" | ")), "num_blocks") << err;
  EXPECT_NE(err.find("2"), std::string::npos);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_EQ(pool.allocate(1), (std::vector<int32_t>{3}));
  EXPECT_EQ(error_of([&] { pool.allocate(1); }).substr(0, 10), "num_blocks");
  EXPECT_EQ(error_of([&] { pool.allocate(-1); }).substr(0, 10), "num_blocks");
  EXPECT_THROW(BlockPool(-1), Error);
  BlockPool empty(0);
  EXPECT_TRUE(empty.allocate(0).empty());
  EXPECT_THROW(empty.allocate(1), Error);
}

TEST(BlockPool, InvalidFreeAndIncrefChangeNothing) {
  BlockPool pool(6);
  const std::vector<int32_t> a = pool.allocate(2);  // {0, 1}
  auto snapshot = [&] {
    std::vector<int> s{pool.num_free_blocks()};
    for (int b = 0; b < pool.num_blocks(); ++b) s.push_back(pool.ref_count(b));
    return s;
  };
  const std::vector<int> before = snapshot();

  const std::vector<int32_t> out_of_range{0, 9};
  EXPECT_EQ(error_of([&] { pool.free(out_of_range); }),
            "blocks | free: blocks[1] = 9 is out of range: expected a block id in [0, 6)");
  const std::vector<int32_t> negative{-1};
  EXPECT_NE(error_of([&] { pool.incref(negative); }).find("blocks[0] = -1"), std::string::npos);
  const std::vector<int32_t> unallocated{1, 4};
  EXPECT_EQ(error_of([&] { pool.free(unallocated); }),
            "blocks | free: blocks[1] = 4 is not allocated (reference count 0)");
  EXPECT_NE(error_of([&] { pool.incref(unallocated); }).find("blocks[1] = 4"), std::string::npos);
  const std::vector<int32_t> twice{0, 1, 0};
  const std::string dbl = error_of([&] { pool.free(twice); });
  EXPECT_NE(dbl.find("blocks[2] = 0"), std::string::npos) << dbl;
  EXPECT_NE(dbl.find("double free"), std::string::npos) << dbl;
  EXPECT_EQ(snapshot(), before);  // nothing changed by any failed call
  EXPECT_THROW(pool.ref_count(6), Error);
  EXPECT_THROW(pool.ref_count(-1), Error);

  pool.free(a);
  const std::string again = error_of([&] { pool.free(a); });  // double free across calls
  EXPECT_EQ(again.substr(0, 6), "blocks") << again;
  EXPECT_EQ(pool.num_free_blocks(), 6);
}

TEST(BlockPool, SharedPrefixLivesUntilLastSharerFrees) {
  BlockPool pool(10);
  // Request A: 4 blocks; request B shares A's first 2 (a common prefix) and adds 2 of its own.
  const std::vector<int32_t> a = pool.allocate(4);  // {0, 1, 2, 3}
  const std::vector<int32_t> prefix(a.begin(), a.begin() + 2);
  pool.incref(prefix);
  std::vector<int32_t> b = prefix;
  const std::vector<int32_t> b_own = pool.allocate(2);  // {4, 5}
  b.insert(b.end(), b_own.begin(), b_own.end());
  EXPECT_EQ(pool.ref_count(0), 2);
  EXPECT_EQ(pool.ref_count(1), 2);
  EXPECT_EQ(pool.ref_count(2), 1);
  EXPECT_EQ(pool.num_free_blocks(), 4);

  pool.free(a);  // the prefix stays with B; A's own blocks 2, 3 return
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.ref_count(2), 0);
  EXPECT_EQ(pool.ref_count(3), 0);
  EXPECT_EQ(pool.num_free_blocks(), 6);
  // A newcomer gets freed blocks, never the shared prefix.
  const std::vector<int32_t> c = pool.allocate(6);
  EXPECT_TRUE(std::none_of(c.begin(), c.end(), [](int32_t x) { return x == 0 || x == 1; }));
  EXPECT_EQ(pool.num_free_blocks(), 0);

  pool.free(b);
  pool.free(c);
  EXPECT_EQ(pool.num_free_blocks(), 10);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(pool.ref_count(i), 0);
  // Same block referenced twice in one call: allowed while references remain.
  const std::vector<int32_t> d = pool.allocate(1);
  const std::vector<int32_t> dd{d[0], d[0]};
  pool.incref(dd);
  EXPECT_EQ(pool.ref_count(d[0]), 3);
  pool.free(dd);
  EXPECT_EQ(pool.ref_count(d[0]), 1);
}

}  // namespace
}  // namespace pagedattn
